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
the TP ranks that share an inter-node NIC (``nics`` in the cluster file; by
default each GPU has its own) add up their bytes on it: a host with one NIC moves
the segment's full gradient through it. A segment whose holding stages have
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

Stages that shard their weights (``Stage.shard == "weights"``, ZeRO-3 / FSDP) are
costed by ``sharding``: per micro-batch gathers and reduce-scatters among the stage's
holders, exposed where the compute does not cover them, instead of the end-of-step
all-reduce; 1/P of the state on each GPU plus the gathered working set. A plan
without such stages takes none of those paths: its figures are what they were.

The parts, by responsibility: ``pipelinepart`` (one pipeline alone: costs, sends,
simulation, memory), ``gradsync`` (segments, their sync, ZeRO-1's shares),
``sharding`` (weight-sharded stages), ``transfers`` (the link formulas), ``memo``
(what is kept between evaluations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.gradsync import (
    grad_sync_ms,
    sync_segments,
    tied_layers,
    zero_sharded,
)
from autohet_cli.costmodel.memo import memo_for
from autohet_cli.costmodel.pipelinepart import PipelinePart, stage_memory_bytes
from autohet_cli.costmodel.sharding import unsynced, weight_shards
from autohet_cli.costmodel.tables import CostTables, StageCost
from autohet_cli.costmodel.transfers import ring_allreduce_ms, send_copies, transfer_ms
from autohet_cli.plan import Pipeline

# Re-exported: the planner, the profiler and the launch import them from here.
__all__ = [
    "PipelineEval",
    "PlanEval",
    "StageEval",
    "evaluate",
    "ring_allreduce_ms",
    "send_copies",
    "stage_memory_bytes",
    "transfer_ms",
    "zero_sharded",
]


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
    memo = memo_for(cluster, tables)
    shards = weight_shards(pipelines, memo)
    if shards is None:
        parts = [memo.pipeline(p, micro_batch_size) for p in pipelines]
        segments = sync_segments(pipelines)
    else:
        # Every pipeline runs the most micro-batches of any (the runtime pads the
        # others with zero-weight ones, ``runtime.fsdp_stage.padded_microbatches``:
        # the holders' gathers must pair up): their time and activations in flight
        # are those of the padded count; the tokens below stay the real ones.
        most = max(p.num_microbatches for p in pipelines)
        parts = [
            memo.pipeline(
                replace(p, num_microbatches=most),
                micro_batch_size,
                None if all(x is None for x in sh) else sh,
            )
            for p, sh in zip(pipelines, shards, strict=True)
        ]
        segments = unsynced(sync_segments(pipelines), pipelines, tied_layers(tables.model))
    sync = grad_sync_ms(pipelines, micro_batch_size, memo, segments)
    sharded = zero_sharded(pipelines, cluster, tables, micro_batch_size, segments)
    if shards is not None:  # ZeRO-1 leaves stages that shard their weights alone
        sharded = [
            [0.0 if sh[s] is not None else x for s, x in enumerate(row)]
            for row, sh in zip(sharded, shards, strict=True)
        ]
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
    parts: Sequence[PipelinePart],
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


def _update_ms(c: StageCost, sharded_params: float) -> float:
    """A stage's update time when ZeRO-1 steps only its share of ``sharded_params``."""
    if sharded_params <= 0 or c.num_params <= 0:
        return c.update_ms
    return c.update_ms * (1 - sharded_params / c.num_params)


def _without_sharded(c: StageCost, sharded_params: float) -> StageCost:
    if sharded_params <= 0 or c.num_params <= 0:
        return c
    return replace(c, update_ms=_update_ms(c, sharded_params))
