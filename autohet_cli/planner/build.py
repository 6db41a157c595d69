"""From a solved grouping to concrete pipelines, then exact local refinement (pure).

Placement puts consecutive stages of a pipeline on consecutive TP groups of its
class in host order, so a pipeline stays inside one host whenever it can
(stage-to-stage sends then use NVLink/PCIe, not the network).

Refinement works on the exact cost model (per-layer costs, simulator): it moves
single stage boundaries and single micro-batches between pipelines while that
lowers the predicted iteration time and every GPU still fits. It corrects the
MILP's mean-block approximation and its closed-form pipeline time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.evaluate import PlanEval, evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import TimeLimitReached
from autohet_cli.plan import Device, Pipeline, Stage, weight_sharded
from autohet_cli.planner.groups import DeviceClass, Template

Score = Callable[[PlanEval], float]


def class_groups(c: DeviceClass) -> list[tuple[Device, ...]]:
    """The class's TP groups of ``c.tp`` consecutive GPUs, host by host."""
    out = []
    for host, n in zip(c.hosts, c.groups_per_host, strict=True):
        for g in range(n):
            out.append(tuple(Device(host=host, gpu=g * c.tp + i) for i in range(c.tp)))
    return out


def place(
    parts: Sequence[tuple[Template, int]],
    blocks: Sequence[Sequence[int]],
    microbatches: Sequence[int],
    extra: Sequence[int],
    classes: Sequence[DeviceClass],
    first_block: int,
    num_layers: int,
    *,
    stage_major: bool = False,
    recompute: bool = False,
    recompute_types: frozenset[str] = frozenset(),
    shard_weights: bool = False,
) -> list[Pipeline] | None:
    """Concrete pipelines for a solution; None if a stage would hold no layer.

    Pipeline-major placement (the default) gives each pipeline consecutive
    groups, keeping its stage-to-stage sends inside a host. Stage-major gives
    the copies of one stage consecutive groups, keeping that stage's gradient
    all-reduce inside a host instead; the search tries both. A stage recomputes
    its activations when ``recompute`` or its GPU type is in ``recompute_types``.
    """
    pools = [iter(class_groups(c)) for c in classes]
    pipelines = []
    for (tpl, k), ns, m, r in zip(parts, blocks, microbatches, extra, strict=True):
        bounds = _bounds(ns, first_block, num_layers)
        if bounds is None:
            return None
        if stage_major or tpl.hosts:
            drawn = [[next(pools[c]) for _ in range(k)] for c in tpl.classes]
            if tpl.hosts and any(
                g[0].host != tpl.hosts[s] for s, row in enumerate(drawn) for g in row
            ):
                return None  # the pools did not line up with the aligned hosts
            grid = [[drawn[s][p] for s in range(len(tpl.classes))] for p in range(k)]
        else:
            grid = [[next(pools[c]) for c in tpl.classes] for _ in range(k)]
        for p in range(k):
            stages = []
            for s, c in enumerate(tpl.classes):
                devices = grid[p][s]
                stages.append(
                    Stage(
                        layer_start=bounds[s],
                        layer_end=bounds[s + 1],
                        gpu_type=classes[c].gpu_type,
                        tensor_parallel=classes[c].tp,
                        devices=devices,
                        recompute=recompute or classes[c].gpu_type in recompute_types,
                        # the k copies of this stage hold 1/k each (request.shard_weights)
                        shard="weights" if shard_weights and k >= 2 else "none",
                    )
                )
            pipelines.append(
                Pipeline(num_microbatches=m + (1 if p < r else 0), stages=tuple(stages))
            )
    return pipelines


def _bounds(ns: Sequence[int], first_block: int, num_layers: int) -> list[int] | None:
    bounds = [0]
    acc = first_block
    for s, n in enumerate(ns):
        acc += n
        bounds.append(num_layers if s == len(ns) - 1 else acc)
    if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        return None
    return bounds


def refine(
    pipelines: list[Pipeline],
    cluster: Cluster,
    tables: CostTables,
    mbs: int,
    score: Score,
    *,
    deadline: float,
) -> tuple[list[Pipeline], PlanEval]:
    """Greedy first-improvement search over boundary and micro-batch moves."""
    best = evaluate(pipelines, cluster, tables, mbs)
    best_score = score(best) if best.fits else float("inf")
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for cand in _neighbours(pipelines, best):
            if time.monotonic() >= deadline:
                break
            try:  # totals only: the stages' details of the one kept, below
                ev = evaluate(cand, cluster, tables, mbs, detail=False)
                if ev.fits and score(ev) < best_score * (1 - 1e-9):
                    best = evaluate(cand, cluster, tables, mbs)
                    pipelines, best_score = cand, score(best)
                    improved = True
                    break
            except TimeLimitReached:  # the planner's hard deadline (costmodel/budget.py)
                return pipelines, best
    return pipelines, best


def _neighbours(pipelines: list[Pipeline], ev: PlanEval) -> list[list[Pipeline]]:
    """Moves that can help the current bottleneck, the most promising first."""
    out: list[list[Pipeline]] = []
    slow = max(range(len(pipelines)), key=lambda i: ev.pipelines[i].time_ms)
    order = [slow] + [i for i in range(len(pipelines)) if i != slow]
    # Micro-batches: from the slowest pipeline to each other one (fastest first).
    fast_first = sorted(range(len(pipelines)), key=lambda i: ev.pipelines[i].time_ms)
    if pipelines[slow].num_microbatches > 1:
        for dst in fast_first:
            if dst != slow:
                out.append(_move_microbatch(pipelines, slow, dst))
    # Boundaries of alike pipelines together: when copies share the bottleneck,
    # moving one copy's boundary leaves the other as slow as before.
    for members in _alike(pipelines).values():
        if len(members) < 2:
            continue
        stages = pipelines[members[0]].stages
        for b in range(len(stages) - 1):
            for delta in (-1, 1):
                if _shift(stages, b, delta) is None:
                    continue
                cand = list(pipelines)
                for i in members:
                    moved = _shift(pipelines[i].stages, b, delta)
                    assert moved is not None
                    cand[i] = replace(pipelines[i], stages=moved)
                out.append(cand)
    if weight_sharded(pipelines):
        return out  # the holders of a sharded stage share its cut: copies move together
    # Boundaries: shift each boundary of each pipeline by one layer either way; of
    # copies alike in layers, types and micro-batches, the first only (the others'
    # moves differ from its own by links alone: on 256 GPUs, 80 copies made
    # refinement the planner's longest phase).
    seen: set[tuple[object, ...]] = set()
    for i in order:
        key = (
            pipelines[i].num_microbatches,
            tuple((s.layer_start, s.layer_end, s.gpu_type) for s in pipelines[i].stages),
        )
        if key in seen:
            continue
        seen.add(key)
        stages = pipelines[i].stages
        for b in range(len(stages) - 1):
            for delta in (-1, 1):
                moved = _shift(stages, b, delta)
                if moved is not None:
                    cand = list(pipelines)
                    cand[i] = replace(pipelines[i], stages=moved)
                    out.append(cand)
    return out


def _alike(pipelines: list[Pipeline]) -> dict[tuple[object, ...], list[int]]:
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, p in enumerate(pipelines):
        key = tuple((s.layer_start, s.layer_end, s.gpu_type) for s in p.stages)
        groups.setdefault(key, []).append(i)
    return groups


def _move_microbatch(pipelines: list[Pipeline], src: int, dst: int) -> list[Pipeline]:
    cand = list(pipelines)
    cand[src] = replace(cand[src], num_microbatches=cand[src].num_microbatches - 1)
    cand[dst] = replace(cand[dst], num_microbatches=cand[dst].num_microbatches + 1)
    return cand


def _shift(stages: tuple[Stage, ...], b: int, delta: int) -> tuple[Stage, ...] | None:
    left, right = stages[b], stages[b + 1]
    cut = left.layer_end + delta
    if cut <= left.layer_start or cut >= right.layer_end:
        return None
    new = list(stages)
    new[b] = _with_layers(left, left.layer_start, cut)
    new[b + 1] = _with_layers(right, cut, right.layer_end)
    return tuple(new)


def _with_layers(s: Stage, start: int, end: int) -> Stage:
    """``s`` over layers [start, end), recomputing as many of its first layers as
    before where it still has them: a partial stage (``recompute: N``) that loses
    layers would otherwise count more than it holds, which Plan.validate refuses
    (the cost model clamps, so refinement scored it as every layer)."""
    moved = replace(s, layer_start=start, layer_end=end)
    if s.recompute_layers and s.recompute_layers >= end - start:
        return replace(moved, recompute=True, recompute_layers=0)
    return moved
