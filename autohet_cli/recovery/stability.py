"""How much of a new plan's layer state the old plan already had in place, and the
GPU relabelling that keeps the most of it (pure; *Stability* in ``recovery.replan``).

A placement is a (host, gpu, layer, TP rank, TP degree); a kept placement means that
layer's state (weights, gradients, optimizer state) is already on that GPU's host, so
it needs no transfer and no reshard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from autohet_cli.costmodel.tables import CostTables
from autohet_cli.plan import Device, Plan

_Key = tuple[str, int, int, int, int]  # host, gpu, layer, tp rank, tp degree


@dataclass(frozen=True, slots=True, kw_only=True)
class Stability:
    kept_placements: int
    total_placements: int
    kept_state_bytes: float
    total_state_bytes: float

    @property
    def fraction(self) -> float:
        """Kept share of state bytes (of placements when the model is unknown)."""
        if self.total_state_bytes > 0:
            return self.kept_state_bytes / self.total_state_bytes
        return self.kept_placements / self.total_placements if self.total_placements else 1.0

    @property
    def state_bytes_to_move(self) -> float:
        return self.total_state_bytes - self.kept_state_bytes


def stability(old: Plan, new: Plan, layer_bytes: Sequence[float] | None = None) -> Stability:
    """How much of ``new``'s placement ``old`` already had (see the module doc)."""
    before = _placements(old)
    after = _placements(new)
    kept = [key for key in after if key in before]

    def weight(key: _Key) -> float:
        return layer_bytes[key[2]] / key[4] if layer_bytes is not None else 0.0

    return Stability(
        kept_placements=len(kept),
        total_placements=len(after),
        kept_state_bytes=sum(weight(k) for k in kept),
        total_state_bytes=sum(weight(k) for k in after),
    )


def align_devices(old: Plan, new: Plan, layer_bytes: Sequence[float] | None = None) -> Plan:
    """``new`` with each host's GPU indices permuted to keep the most of ``old``'s
    placements. All GPUs of a host are alike to the cost model, so the predicted
    time does not change. Greedy matching on the overlap per (new GPU, old GPU)."""
    before: dict[tuple[str, int, int, int], set[int]] = {}
    for host, gpu, layer, k, tp in _placements(old):
        before.setdefault((host, layer, k, tp), set()).add(gpu)
    used: dict[str, set[int]] = {}
    overlap: dict[str, dict[tuple[int, int], float]] = {}
    for host, a, layer, k, tp in _placements(new):
        used.setdefault(host, set()).add(a)
        w = layer_bytes[layer] / tp if layer_bytes is not None else 1.0
        pairs = overlap.setdefault(host, {})
        for b in before.get((host, layer, k, tp), ()):
            pairs[(a, b)] = pairs.get((a, b), 0.0) + w
    mapping: dict[tuple[str, int], int] = {}
    for host, gpus in used.items():
        taken: dict[int, int] = {}
        for (a, b), _w in sorted(overlap.get(host, {}).items(), key=lambda x: (-x[1], x[0])):
            if a not in taken and b not in taken.values():
                taken[a] = b
        targets = set(taken.values())
        # Every index here exists on the host: the new plan's or the old plan's.
        pool = sorted((gpus | targets) - targets)
        rest = [a for a in sorted(gpus) if a not in taken]
        for a in rest:  # unmatched GPUs keep their index where it is free
            if a in pool:
                taken[a] = a
                pool.remove(a)
        for a in rest:
            if a not in taken:
                taken[a] = pool.pop(0)
        mapping.update({(host, a): b for a, b in taken.items()})
    return _map_devices(new, lambda d: Device(host=d.host, gpu=mapping[(d.host, d.gpu)]))


def layer_state_bytes(tables: CostTables) -> tuple[float, ...]:
    """Weights + gradients + optimizer state of each partitionable layer (whole, not per TP)."""
    per_param = tables.training.state_bytes_per_param
    return tuple(float(layer.num_params * per_param) for layer in tables.model.layers())


def _placements(plan: Plan) -> dict[_Key, int]:
    """Placement -> layer index, for every GPU and layer of the plan."""
    out: dict[_Key, int] = {}
    for p in plan.pipelines:
        for s in p.stages:
            for k, d in enumerate(s.devices):
                for layer in range(s.layer_start, s.layer_end):
                    out[(d.host, d.gpu, layer, k, s.tensor_parallel)] = layer
    return out


def _map_devices(plan: Plan, fn: Callable[[Device], Device]) -> Plan:
    pipelines = tuple(
        replace(
            p,
            stages=tuple(replace(s, devices=tuple(fn(d) for d in s.devices)) for s in p.stages),
        )
        for p in plan.pipelines
    )
    return replace(plan, pipelines=pipelines)
