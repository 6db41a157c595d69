"""What one pipeline's evaluation owes to the pipeline alone (pure).

Its stages' costs, the sends between them, the 1F1B simulation and the closed form
beside it, and each stage's memory before ZeRO-1 takes its share: everything of
``evaluate`` that the other pipelines do not change, so the memo of
``costmodel.memo`` keeps it per pipeline. A stage that shards its weights depends on
its holders in the other pipelines only through their number and link
(``sharding.WeightShard``), which the caller passes and the memo keys on.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.pipeline import SimResult, closed_form_1f1b, simulate_1f1b
from autohet_cli.costmodel.sharding import WeightShard, sharded_memory_bytes, sharded_stage_cost
from autohet_cli.costmodel.tables import CostTables, LayerTable, StageCost
from autohet_cli.costmodel.transfers import send_copies, transfer_ms
from autohet_cli.plan import Pipeline, Stage


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
    # autocast's copies of the weights: one for the step through its cache on a plain
    # stage; a stage recomputing some layers runs without it (runtime.pipeline.
    # autocast_contexts), so each micro-batch in flight keeps its own copies of the
    # plain layers' weights (``cast_bytes``: 0 when every layer recomputes)
    cast = cost.cast_bytes * (in_flight if cost.recompute else 1)
    once = cost.transient_bytes + buffers + reserve
    return int(state + cost.act_bytes * in_flight + cast + once)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelinePart:
    """What a pipeline's evaluation owes to the pipeline alone (not to the others)."""

    costs: tuple[StageCost, ...]
    sends: tuple[float, ...]
    sim: SimResult
    closed_ms: float
    idle_fraction: float
    mem_bytes: tuple[int, ...]  # before ZeRO-1 takes its share of the optimizer state
    capacity_bytes: tuple[int, ...]


def pipeline_part(
    p: Pipeline,
    cluster: Cluster,
    tables: CostTables,
    mbs: int,
    shards: tuple[WeightShard | None, ...] | None = None,
) -> PipelinePart:
    """``shards``: per stage, the holders of a stage that shards its weights (None:
    no stage of this pipeline does)."""
    if shards is not None:
        return _sharded_part(p, cluster, tables, mbs, shards)
    costs = tuple(_stage_cost(s, cluster, tables, mbs) for s in p.stages)
    n = len(p.stages)
    mem = tuple(
        stage_memory_bytes(c, tables, st.gpu_type, i, n, p.num_microbatches)
        for i, (c, st) in enumerate(zip(costs, p.stages, strict=True))
    )
    return _part(p, cluster, tables, costs, mem)


def _part(
    p: Pipeline,
    cluster: Cluster,
    tables: CostTables,
    costs: tuple[StageCost, ...],
    mem: tuple[int, ...],
) -> PipelinePart:
    sends = tuple(
        _send_ms(p.stages[s], p.stages[s + 1], costs[s].output_bytes, cluster, tables)
        for s in range(len(p.stages) - 1)
    )
    sim, closed = _pipeline_time(
        tuple(c.fwd_ms for c in costs), tuple(c.bwd_ms for c in costs), p.num_microbatches, sends
    )
    return PipelinePart(
        costs=costs,
        sends=sends,
        sim=sim,
        closed_ms=closed,
        idle_fraction=sum(sim.idle_fraction) / len(sim.idle_fraction),
        mem_bytes=mem,
        capacity_bytes=tuple(cluster.host(st.host).gpu_mem_bytes for st in p.stages),
    )


def _sharded_part(
    p: Pipeline,
    cluster: Cluster,
    tables: CostTables,
    mbs: int,
    shards: tuple[WeightShard | None, ...],
) -> PipelinePart:
    """A pipeline with weight-sharded stages: theirs costed by ``costmodel.sharding``."""
    n, m = len(p.stages), p.num_microbatches
    costs, mem = [], []
    for i, (st, shard) in enumerate(zip(p.stages, shards, strict=True)):
        c = _stage_cost(st, cluster, tables, mbs)
        if shard is None:
            costs.append(c)
            mem.append(stage_memory_bytes(c, tables, st.gpu_type, i, n, m))
            continue
        table = _table(st, cluster, tables, mbs)
        costs.append(sharded_stage_cost(c, table, st, shard, tables))
        mem.append(sharded_memory_bytes(c, table, st, shard, tables, i, n, m))
    return _part(p, cluster, tables, tuple(costs), tuple(mem))


@lru_cache(maxsize=8192)
def _pipeline_time(
    fwd: tuple[float, ...], bwd: tuple[float, ...], m: int, sends: tuple[float, ...]
) -> tuple[SimResult, float]:
    """Simulated and closed-form time; memoised because data-parallel replicas
    and the planner's neighbouring candidates repeat the same pipelines."""
    sim = simulate_1f1b(fwd, bwd, m, sends)
    closed = closed_form_1f1b([f + b for f, b in zip(fwd, bwd, strict=True)], m, sends, fwd_ms=fwd)
    return sim, closed


def _table(s: Stage, cluster: Cluster, tables: CostTables, mbs: int) -> LayerTable:
    return tables.table(s.gpu_type, s.tensor_parallel, mbs, cluster.host(s.host).intra_node_gbps)


def _stage_cost(s: Stage, cluster: Cluster, tables: CostTables, mbs: int) -> StageCost:
    return _table(s, cluster, tables, mbs).stage(
        s.layer_start, s.layer_end, recompute_first=s.recomputed
    )


def _send_ms(a: Stage, b: Stage, nbytes: float, cluster: Cluster, tables: CostTables) -> float:
    latency = tables.p2p_latency_ms(a.gpu_type, b.gpu_type)
    copies = send_copies(a.tensor_parallel, b.tensor_parallel)
    return latency + transfer_ms(nbytes * copies, cluster.link_gbps(a.host, b.host))
