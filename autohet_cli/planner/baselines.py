"""Baselines scored by the same cost model, to show what the planner buys (pure).

- ``megatron``: what a user writes today with homogeneous flags: one TP degree,
  one pipeline depth and data-parallel width everywhere, blocks split as evenly
  as possible, the batch split evenly; the best such configuration that fits.
- ``whale``: the same uniform shapes, but each pipeline's share of the batch is
  proportional to the peak compute of its GPUs (Whale, ATC'22).
- ``only-<TYPE>``: the planner itself restricted to the hosts of one GPU type.

Each baseline recomputes activations exactly when the search does
(``SearchRequest.recompute``, ``recompute_types``), and with ``measured_only`` uses only GPU types
measured at its (TP, micro-batch size), so that the comparison stays fair.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.budget import check_deadline
from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.errors import InfeasibleError, TimeLimitReached
from autohet_cli.plan import Device, Pipeline, Stage
from autohet_cli.planner.groups import block_range
from autohet_cli.planner.search import Candidate, SearchRequest, scorer, search


def _groups(cluster: Cluster, tp: int) -> list[tuple[str, tuple[Device, ...]]]:
    out = []
    for h in cluster.hosts:
        for g in range(h.num_gpus // tp):
            out.append((h.gpu_type, tuple(Device(host=h.name, gpu=g * tp + i) for i in range(tp))))
    return out


def even_bounds(num_layers: int, first_block: int, end_block: int, pp: int) -> list[int] | None:
    n = end_block - first_block
    if pp > n:
        return None
    sizes = [n // pp + (1 if i < n % pp else 0) for i in range(pp)]
    bounds = [0]
    acc = first_block
    for i, size in enumerate(sizes):
        acc += size
        bounds.append(num_layers if i == pp - 1 else acc)
    return bounds


def _uniform_shapes(
    req: SearchRequest,
) -> Iterator[tuple[int, int, list[list[tuple[str, tuple[Device, ...]]]], list[int]]]:
    a, b = block_range(req.model)
    max_gpus = max(h.num_gpus for h in req.cluster.hosts)
    for tp in req.tp_candidates:
        if tp > max_gpus:
            continue
        groups = _groups(req.cluster, tp)
        for pp in range(1, len(groups) + 1):
            if len(groups) % pp and pp & (pp - 1):
                continue  # users pick depths that divide the fleet, or powers of two
            bounds = even_bounds(req.model.num_layers, a, b, pp)
            if bounds is None:
                break
            dp = len(groups) // pp
            contiguous = [groups[d * pp : (d + 1) * pp] for d in range(dp)]
            strided = [[groups[s * dp + d] for s in range(pp)] for d in range(dp)]
            for mbs in req.mbs_candidates:
                if req.global_batch_size % mbs or req.global_batch_size // mbs < dp:
                    continue
                yield tp, mbs, contiguous, bounds
                if dp > 1 and pp > 1:
                    yield tp, mbs, strided, bounds


def _pipelines(
    layout: list[list[tuple[str, tuple[Device, ...]]]],
    bounds: list[int],
    shares: Sequence[int],
    tp: int,
    recompute: bool = False,
    recompute_types: frozenset[str] = frozenset(),
) -> list[Pipeline]:
    return [
        Pipeline(
            num_microbatches=m,
            stages=tuple(
                Stage(
                    layer_start=bounds[s],
                    layer_end=bounds[s + 1],
                    gpu_type=gpu,
                    tensor_parallel=tp,
                    devices=devs,
                    recompute=recompute or gpu in recompute_types,
                )
                for s, (gpu, devs) in enumerate(row)
            ),
        )
        for row, m in zip(layout, shares, strict=True)
    ]


def _proportional(total: int, weights: Sequence[float]) -> list[int]:
    """Largest-remainder split of ``total`` into positive integers by weight."""
    raw = [total * w / sum(weights) for w in weights]
    shares = [max(1, int(x)) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    i = 0
    while sum(shares) < total:
        shares[order[i % len(order)]] += 1
        i += 1
    while sum(shares) > total:
        j = max(range(len(shares)), key=lambda x: shares[x])
        shares[j] -= 1
    return shares


def _peak(req: SearchRequest, gpu_type: str) -> float:
    return req.tables.spec(gpu_type).peak_tflops_at(req.tables.training.precision)


def uniform_baseline(req: SearchRequest, proportional: bool) -> Candidate | None:
    score = scorer(req.cluster, req.objective)
    best: Candidate | None = None
    measured: dict[tuple[str, int, int], bool] = {}
    for tp, mbs, layout, bounds in _uniform_shapes(req):
        if req.measured_only and not all(
            _measured(req, measured, gpu, tp, mbs) for row in layout for gpu, _ in row
        ):
            continue
        M = req.global_batch_size // mbs
        if proportional:
            weights = [sum(_peak(req, g) for g, _ in row) for row in layout]
            shares = _proportional(M, weights)
        else:
            if M % len(layout):
                continue
            shares = [M // len(layout)] * len(layout)
        pipelines = _pipelines(layout, bounds, shares, tp, req.recompute, req.recompute_types)
        ev = evaluate(pipelines, req.cluster, req.tables, mbs)
        if not ev.fits:
            continue
        s = score(pipelines, ev)
        if best is None or s < best.score:
            best = Candidate(pipelines=pipelines, tp=tp, mbs=mbs, eval=ev, score=s)
    return best


def _measured(
    req: SearchRequest, seen: dict[tuple[str, int, int], bool], gpu: str, tp: int, mbs: int
) -> bool:
    key = (gpu, tp, mbs)
    if key not in seen:
        seen[key] = req.tables.is_measured(gpu, tp, mbs)
    return seen[key]


def single_type_baselines(
    req: SearchRequest, skipped: list[str] | None = None
) -> dict[str, Candidate | None]:
    out: dict[str, Candidate | None] = {}
    types = req.cluster.gpu_types()
    if len(types) < 2:
        return out
    for gpu in types:
        lost = {h.name for h in req.cluster.hosts if h.gpu_type != gpu}
        sub = req.cluster.without(lost)
        try:
            check_deadline()
            res = search(replace(req, cluster=sub, time_limit_s=max(0.5, req.time_limit_s / 8)))
            out[f"only-{gpu}"] = res.best
        except TimeLimitReached:  # before InfeasibleError, its base class
            if skipped is not None:
                skipped.append(f"the only-{gpu} baseline")
        except InfeasibleError:
            out[f"only-{gpu}"] = None
    return out


def baselines(req: SearchRequest, skipped: list[str] | None = None) -> dict[str, Candidate | None]:
    """Every baseline the planner's deadline (costmodel/budget.py) leaves time for;
    the others are named in ``skipped`` rather than scored on part of their shapes."""
    out: dict[str, Candidate | None] = {}
    for name, proportional in (("megatron", False), ("whale", True)):
        try:
            out[name] = uniform_baseline(req, proportional=proportional)
        except TimeLimitReached:
            if skipped is not None:
                skipped.append(f"the {name} baseline")
    out.update(single_type_baselines(req, skipped))
    return out
