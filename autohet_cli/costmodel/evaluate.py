"""Time and memory of a whole plan (pure): what the planner minimises and explains.

Iteration time = slowest pipeline (1F1B over its micro-batches, stage-to-stage
sends included) + gradient sync + optimizer step. The pipeline time is taken
from the discrete-event simulator (the reference); the closed form is reported
beside it.

Gradient sync with asymmetric pipelines: cut the layer range at every stage
boundary of every pipeline; each segment is held by exactly one stage per
pipeline, and those stages' TP ranks all-reduce its gradients (ring,
``2(D-1)/D * bytes`` over the slowest link among the hosts involved). A stage
syncs its segments one after the other; different stages run in parallel, so
the sync phase lasts as long as the busiest stage. When the ring crosses hosts,
the t ranks of a TP group share their host's NIC, so together they move the
segment's full gradient through it. A segment whose holding stages have
different TP degrees syncs through the full gradient (runtime.topology): each
TP group gathers it inside its host (ring all-gather), one rank per stage
all-reduces it (the same NIC bytes as t rings of 1/t), then broadcasts it back
inside its host; the slowest gather and broadcast count.

Sends between stages: a stage's boundary activations are replicated over its TP
ranks, and every rank of the receiving stage gets one copy from one sender
(TP rank k from rank k mod a), so a sender of degree a sends ceil(b / a) copies to
a receiver of degree b, one after the other, and the gradients come back
ceil(a / b) copies per sender. The simulator has one send time per link for both
directions, so it charges the larger (``send_copies``).

ZeRO-1 (``training.zero1``, runtime.zero): the optimizer state of a segment held
at one TP degree by P > 1 pipelines is split over them, so each holder keeps
1/P of it and steps 1/P of its update; the gradient reduce-scatter and the
parameter all-gather move the bytes of the all-reduce they replace, so on NCCL the
sync time is unchanged; gloo's pair takes 3.5x its all-reduce
(``FixedCosts.zero1_sync_factor``). Tied weights (embedding and head) stay replicated.

Memory of a GPU: (weights + grads + optimizer state) of its layers / TP, the
activations of the micro-batches in flight (stage s of S holds min(S - s, m)
under 1F1B), send/receive buffers and a fixed runtime reserve. A stage that
recomputes (``Stage.recompute``, tables.py) keeps only its layers' inputs per
micro-batch in flight, plus one layer's activations while that layer runs its
backward, and its backward includes the re-run forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TypeVar

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.pipeline import SimResult, closed_form_1f1b, simulate_1f1b
from autohet_cli.costmodel.tables import CostTables, StageCost
from autohet_cli.estimates.fixed import ring_latency_ms
from autohet_cli.models import ModelSpec
from autohet_cli.plan import Pipeline, Stage

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageEval:
    cost: StageCost
    send_ms: float  # one-way, to the next stage (0 for the last)
    grad_sync_ms: float
    mem_bytes: int
    mem_capacity_bytes: int

    @property
    def mem_fraction(self) -> float:
        return self.mem_bytes / self.mem_capacity_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineEval:
    stages: tuple[StageEval, ...]
    time_ms: float  # simulated 1F1B
    closed_form_ms: float
    idle_fraction: float  # bubble share, averaged over stages

    @property
    def bottleneck(self) -> int:
        return max(
            range(len(self.stages)),
            key=lambda s: self.stages[s].cost.fwd_ms + self.stages[s].cost.bwd_ms,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanEval:
    pipelines: tuple[PipelineEval, ...]
    pipeline_ms: float
    grad_sync_ms: float
    optimizer_ms: float
    iteration_ms: float
    closed_form_iteration_ms: float
    tokens_per_s: float
    memory_peak_fraction: float

    @property
    def fits(self) -> bool:
        return self.memory_peak_fraction <= 1.0


def stage_memory_bytes(
    cost: StageCost,
    tables: CostTables,
    gpu_type: str,
    stage_index: int,
    num_stages: int,
    num_microbatches: int,
) -> int:
    """Peak bytes on one GPU of a stage under 1F1B (recompute or not: ``cost`` says)."""
    in_flight = min(num_stages - stage_index, num_microbatches)
    state = cost.num_params * tables.training.state_bytes_per_param
    buffers = 2.0 * cost.output_bytes
    reserve = tables.reserve_bytes(gpu_type)
    once = cost.transient_bytes + cost.cast_bytes + buffers + reserve
    return int(state + cost.act_bytes * in_flight + once)


def transfer_ms(nbytes: float, gbps: float) -> float:
    """Milliseconds to move ``nbytes`` over a link of ``gbps`` gigabits per second."""
    return nbytes / (gbps * 1e9 / 8) * 1e3


def ring_allreduce_ms(nbytes: float, participants: int, gbps: float) -> float:
    if participants <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (participants - 1) / participants * nbytes / (gbps * 1e9 / 8) * 1e3


def evaluate(
    pipelines: Sequence[Pipeline],
    cluster: Cluster,
    tables: CostTables,
    micro_batch_size: int,
    *,
    detail: bool = True,
) -> PlanEval:
    """Predict a plan's iteration time, throughput and per-GPU memory.

    ``detail`` False leaves ``PlanEval.pipelines`` empty: the totals alone, for the
    planner's local search, which scores thousands of neighbours and keeps few."""
    memo = _memo(cluster, tables)
    parts = [memo.pipeline(p, micro_batch_size) for p in pipelines]
    segments = _segments(pipelines)
    sync = _grad_sync_ms(pipelines, cluster, tables, micro_batch_size, memo, segments)
    sharded = zero_sharded(pipelines, cluster, tables, micro_batch_size, segments)
    opt_bytes = tables.training.optimizer_bytes_per_param
    pipeline_ms = max(part.sim.makespan_ms for part in parts)
    sync_ms = max(t for row in sync for t in row)
    update_ms = 0.0
    peak = 0.0
    for pi, part in enumerate(parts):
        for s, c in enumerate(part.costs):
            off = sharded[pi][s]
            update_ms = max(update_ms, _update_ms(c, off))
            mem = part.mem_bytes[s] - int(off * opt_bytes)
            peak = max(peak, mem / part.capacity_bytes[s])
    # The fixed per-step cost every rank pays (calibrated per GPU type, else measured
    # by the probe or the catalog's, with the step's world all-reduces).
    world = sum(s.tensor_parallel for p in pipelines for s in p.stages)
    kinds = {(s.gpu_type, s.tensor_parallel) for p in pipelines for s in p.stages}
    opt_ms = update_ms + max(memo.overhead(gpu, tp, world) for gpu, tp in kinds)
    iteration = pipeline_ms + sync_ms + opt_ms
    tokens = micro_batch_size * sum(p.num_microbatches for p in pipelines) * tables.training.seq_len
    return PlanEval(
        pipelines=_pipeline_evals(parts, sync, sharded, opt_bytes) if detail else (),
        pipeline_ms=pipeline_ms,
        grad_sync_ms=sync_ms,
        optimizer_ms=opt_ms,
        iteration_ms=iteration,
        closed_form_iteration_ms=max(part.closed_ms for part in parts) + sync_ms + opt_ms,
        tokens_per_s=tokens / (iteration / 1e3),
        memory_peak_fraction=peak,
    )


def _pipeline_evals(
    parts: Sequence[_PipelinePart],
    sync: Sequence[Sequence[float]],
    sharded: Sequence[Sequence[float]],
    opt_bytes: float,
) -> tuple[PipelineEval, ...]:
    return tuple(
        PipelineEval(
            stages=tuple(
                StageEval(
                    cost=_without_sharded(c, sharded[pi][s]),
                    send_ms=part.sends[s] if s < len(part.sends) else 0.0,
                    grad_sync_ms=sync[pi][s],
                    mem_bytes=part.mem_bytes[s] - int(sharded[pi][s] * opt_bytes),
                    mem_capacity_bytes=part.capacity_bytes[s],
                )
                for s, c in enumerate(part.costs)
            ),
            time_ms=part.sim.makespan_ms,
            closed_form_ms=part.closed_ms,
            idle_fraction=part.idle_fraction,
        )
        for pi, part in enumerate(parts)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _PipelinePart:
    """What a pipeline's evaluation owes to the pipeline alone (not to the others)."""

    costs: tuple[StageCost, ...]
    sends: tuple[float, ...]
    sim: SimResult
    closed_ms: float
    idle_fraction: float
    mem_bytes: tuple[int, ...]  # before ZeRO-1 takes its share of the optimizer state
    capacity_bytes: tuple[int, ...]


class _Memo:
    """Evaluations of one (cluster, tables) pair, kept for the next one.

    The planner evaluates thousands of plans that differ from the last in one
    pipeline (refinement moves a boundary or a micro-batch) and shares the rest;
    so each pipeline's own part, each sync segment, each ring's link and each step
    overhead are computed once. Pure: every entry is a function of its key and
    the pair."""

    MAX_ENTRIES = 200_000  # per store, then cleared: a long search's memory stays bounded

    def __init__(self, cluster: Cluster, tables: CostTables) -> None:
        self.cluster = cluster  # held: the memo is found by its id
        self.tables = tables
        self.parts: dict[object, _PipelinePart] = {}
        self.segments: dict[object, float] = {}
        self.rings: dict[object, float] = {}
        self.overheads: dict[object, float] = {}

    def _get(self, store: dict[object, T], key: object, make: Callable[[], T]) -> T:
        found = store.get(key)
        if found is None:
            if len(store) >= self.MAX_ENTRIES:
                store.clear()
            found = store[key] = make()
        return found

    def pipeline(self, p: Pipeline, mbs: int) -> _PipelinePart:
        return self._get(
            self.parts, (p, mbs), lambda: _pipeline_part(p, self.cluster, self.tables, mbs)
        )

    def overhead(self, gpu: str, tp: int, world: int) -> float:
        return self._get(
            self.overheads, (gpu, tp, world), lambda: self.tables.step_overhead_ms(gpu, tp, world)
        )

    def ring_gbps(self, stages: Sequence[Stage]) -> float:
        names = tuple(sorted({s.host for s in stages}))
        return self._get(self.rings, names, lambda: _ring_gbps(stages, self.cluster))

    def segment_sync_ms(self, stages: Sequence[Stage], a: int, b: int, mbs: int) -> float:
        # what the sync of a segment depends on: cheaper to hash than the stages
        key = (a, b, mbs, tuple((s.gpu_type, s.tensor_parallel, s.host) for s in stages))
        return self._get(self.segments, key, lambda: _segment_sync_ms(stages, a, b, mbs, self))


def _memo(cluster: Cluster, tables: CostTables) -> _Memo:
    memos = tables.evaluate_memos
    held = memos.get(id(cluster))
    if held is None or held.cluster is not cluster:
        if len(memos) >= 8:
            memos.clear()
        held = memos[id(cluster)] = _Memo(cluster, tables)
    return held


def _pipeline_part(p: Pipeline, cluster: Cluster, tables: CostTables, mbs: int) -> _PipelinePart:
    costs = tuple(_stage_cost(s, cluster, tables, mbs) for s in p.stages)
    sends = tuple(
        _send_ms(p.stages[s], p.stages[s + 1], costs[s].output_bytes, cluster, tables)
        for s in range(len(p.stages) - 1)
    )
    sim, closed = _pipeline_time(
        tuple(c.fwd_ms for c in costs), tuple(c.bwd_ms for c in costs), p.num_microbatches, sends
    )
    n = len(p.stages)
    return _PipelinePart(
        costs=costs,
        sends=sends,
        sim=sim,
        closed_ms=closed,
        idle_fraction=sum(sim.idle_fraction) / len(sim.idle_fraction),
        mem_bytes=tuple(
            stage_memory_bytes(c, tables, st.gpu_type, i, n, p.num_microbatches)
            for i, (c, st) in enumerate(zip(costs, p.stages, strict=True))
        ),
        capacity_bytes=tuple(cluster.host(st.host).gpu_mem_bytes for st in p.stages),
    )


@lru_cache(maxsize=8192)
def _pipeline_time(
    fwd: tuple[float, ...], bwd: tuple[float, ...], m: int, sends: tuple[float, ...]
) -> tuple[SimResult, float]:
    """Simulated and closed-form time; memoised because data-parallel replicas
    and the planner's neighbouring candidates repeat the same pipelines."""
    sim = simulate_1f1b(fwd, bwd, m, sends)
    closed = closed_form_1f1b([f + b for f, b in zip(fwd, bwd, strict=True)], m, sends, fwd_ms=fwd)
    return sim, closed


def _stage_cost(s: Stage, cluster: Cluster, tables: CostTables, mbs: int) -> StageCost:
    host = cluster.host(s.host)
    table = tables.table(s.gpu_type, s.tensor_parallel, mbs, host.intra_node_gbps)
    return table.stage(s.layer_start, s.layer_end, recompute=s.recompute)


def _send_ms(a: Stage, b: Stage, nbytes: float, cluster: Cluster, tables: CostTables) -> float:
    latency = tables.p2p_latency_ms(a.gpu_type, b.gpu_type)
    copies = send_copies(a.tensor_parallel, b.tensor_parallel)
    return latency + transfer_ms(nbytes * copies, cluster.link_gbps(a.host, b.host))


def send_copies(a: int, b: int) -> int:
    """Copies one rank sends, one after the other, between neighbours of TP degrees
    ``a`` and ``b``: ceil(b/a) activations forward, ceil(a/b) gradients back."""
    return max(-(-b // a), -(-a // b))


Segment = tuple[int, int, list[tuple[int, int]]]  # [a, b) and its (pipeline, stage) holders


def _segments(pipelines: Sequence[Pipeline]) -> list[Segment]:
    """The layer range cut at every stage boundary of every pipeline: each segment
    with the stage of each pipeline that holds it (one walk per pipeline)."""
    cuts = sorted({s.layer_end for p in pipelines for s in p.stages} | {0})
    holders: list[list[tuple[int, int]]] = [[] for _ in cuts[1:]]
    for pi, p in enumerate(pipelines):
        si = 0
        for k, a in enumerate(cuts[:-1]):
            while p.stages[si].layer_end <= a:
                si += 1
            holders[k].append((pi, si))
    return [(a, b, h) for a, b, h in zip(cuts, cuts[1:], holders, strict=False)]


def _grad_sync_ms(
    pipelines: Sequence[Pipeline],
    cluster: Cluster,
    tables: CostTables,
    mbs: int,
    memo: _Memo | None = None,
    segments: Sequence[Segment] | None = None,
) -> list[list[float]]:
    """Per (pipeline, stage): time to all-reduce the gradients of its layers."""
    out = [[0.0] * len(p.stages) for p in pipelines]
    if len(pipelines) < 2:
        return out
    memo = memo or _memo(cluster, tables)
    for a, b, holders in segments if segments is not None else _segments(pipelines):
        t = memo.segment_sync_ms([pipelines[pi].stages[si] for pi, si in holders], a, b, mbs)
        for pi, si in holders:
            out[pi][si] += t
    return out


def _segment_sync_ms(stages: Sequence[Stage], a: int, b: int, mbs: int, memo: _Memo) -> float:
    """One segment [a, b) synced among its holders (one stage per pipeline)."""
    sharded = len({s.tensor_parallel for s in stages}) == 1
    t = (_sharded_sync_ms if sharded else _full_sync_ms)(stages, a, b, mbs, memo)
    if sharded and memo.tables.training.zero1 and len(stages) > 1:
        t *= _zero1_sync_factor(stages, a, b, memo.tables)
    return t * max(memo.tables.sync_factor(st.gpu_type) for st in stages)  # calibrated, else 1


def _zero1_sync_factor(stages: Sequence[Stage], a: int, b: int, tables: CostTables) -> float:
    """ZeRO-1's reduce-scatter + all-gather against the all-reduce, for the share of
    [a, b)'s parameters it shards (tied weights stay all-reduced; ``zero_sharded``)."""
    f = max(tables.spec(s.gpu_type).fixed.zero1_sync_factor for s in stages)
    if f == 1.0:
        return 1.0
    layers = tables.model.layers()
    total = sum(layers[i].num_params for i in range(a, b))
    kept = total - sum(layers[i].num_params for i in _tied_layers(tables.model) if a <= i < b)
    return 1.0 + (f - 1.0) * (kept / total if total > 0 else 1.0)


def _tied_layers(model: ModelSpec) -> set[int]:
    """The layers ZeRO-1 leaves replicated: a tied embedding and head."""
    if not model.tied_embeddings:
        return set()
    return {i for i, layer in enumerate(model.layers()) if layer.kind in ("embedding", "head")}


def _sharded_sync_ms(stages: Sequence[Stage], a: int, b: int, mbs: int, memo: _Memo) -> float:
    """Holders of one degree t: t rings, TP rank k with TP rank k."""
    cluster, tables, participants = memo.cluster, memo.tables, len(stages)
    nbytes = _segment_bytes(stages[0], a, b, cluster, tables, mbs)
    if len({s.host for s in stages}) == 1:
        measured = tables.intra_allreduce_ms(stages[0].gpu_type, nbytes, participants)
        if measured is not None:
            return measured
    else:
        nbytes *= stages[0].tensor_parallel  # the TP group's rings share the host NIC
    return ring_allreduce_ms(nbytes, participants, memo.ring_gbps(stages)) + _ring_latency(
        stages, tables, participants
    )


def _full_sync_ms(stages: Sequence[Stage], a: int, b: int, mbs: int, memo: _Memo) -> float:
    """Holders of different degrees: gather in each TP group, one ring over the
    stages' TP rank 0, broadcast back in each TP group."""
    cluster, tables, participants = memo.cluster, memo.tables, len(stages)
    full = max(_segment_bytes(s, a, b, cluster, tables, mbs) * s.tensor_parallel for s in stages)
    inside = max(
        (
            # ring all-gather of (t-1)/t, then a broadcast of the whole, inside the host
            transfer_ms(full * (s.tensor_parallel - 1) / s.tensor_parallel + full, gbps)
            for s in stages
            if s.tensor_parallel > 1
            for gbps in [cluster.host(s.host).intra_node_gbps]
        ),
        default=0.0,
    )
    ring = ring_allreduce_ms(full, participants, memo.ring_gbps(stages))
    return inside + ring + _ring_latency(stages, tables, participants)


def _ring_latency(stages: Sequence[Stage], tables: CostTables, participants: int) -> float:
    """The messages of a ring all-reduce among these stages, at the slowest type's
    latency (``estimates.fixed``)."""
    return ring_latency_ms(max(tables.hop_ms(s.gpu_type) for s in stages), participants)


def _segment_bytes(
    s: Stage, a: int, b: int, cluster: Cluster, tables: CostTables, mbs: int
) -> float:
    """Gradient bytes of layers [a, b) on one GPU of stage ``s``."""
    table = tables.table(s.gpu_type, s.tensor_parallel, mbs, cluster.host(s.host).intra_node_gbps)
    return table.params(a, b) * tables.training.grad_bytes_per_param


def _ring_gbps(stages: Sequence[Stage], cluster: Cluster) -> float:
    """The link a ring over these stages runs at: the host's own when they share
    one, else the slowest link between their hosts."""
    names = sorted({s.host for s in stages})
    if len(names) == 1:
        return cluster.host(names[0]).intra_node_gbps
    return min(cluster.link_gbps(x, y) for x in names for y in names if x < y)


def zero_sharded(
    pipelines: Sequence[Pipeline],
    cluster: Cluster,
    tables: CostTables,
    mbs: int,
    segments: Sequence[Segment] | None = None,
) -> list[list[float]]:
    """Per (pipeline, stage): parameters per GPU whose optimizer state ZeRO-1 takes
    off it (each holder of a sharded segment keeps 1/P of the state)."""
    out = [[0.0] * len(p.stages) for p in pipelines]
    P = len(pipelines)
    if not tables.training.zero1 or P < 2:
        return out
    tied = _tied_layers(tables.model)
    # per (type, degree, link, segment): recover's refinement evaluates 200 pipelines'
    # plans ~1,600 times, and a sum per holder per layer was half of its time
    kept: dict[tuple[str, int, float, int, int], int] = {}
    for a, b, holders in segments if segments is not None else _segments(pipelines):
        stages = [pipelines[pi].stages[si] for pi, si in holders]
        if len({s.tensor_parallel for s in stages}) > 1:
            continue  # synced through the full gradient, not sharded
        for (pi, si), st in zip(holders, stages, strict=True):
            gbps = cluster.host(st.host).intra_node_gbps
            key = (st.gpu_type, st.tensor_parallel, gbps, a, b)
            params = kept.get(key)
            if params is None:
                table = tables.table(st.gpu_type, st.tensor_parallel, mbs, gbps)
                params = kept[key] = table.params(a, b) - sum(
                    table.params(i, i + 1) for i in tied if a <= i < b
                )
            out[pi][si] += params * (1 - 1 / P)
    return out


def _update_ms(c: StageCost, sharded_params: float) -> float:
    """A stage's update time when ZeRO-1 steps only its share of ``sharded_params``."""
    if sharded_params <= 0 or c.num_params <= 0:
        return c.update_ms
    return c.update_ms * (1 - sharded_params / c.num_params)


def _without_sharded(c: StageCost, sharded_params: float) -> StageCost:
    if sharded_params <= 0 or c.num_params <= 0:
        return c
    return replace(c, update_ms=_update_ms(c, sharded_params))
