"""Stages with sharded weights (ZeRO-3 / FSDP, issue 48): their time and memory (pure).

A stage with ``shard: weights`` shares its state with its *holders*: the stages of
every pipeline with the same cut (``layer_start``, ``layer_end``), the same TP degree
and ``shard: weights``; P is their number (the stage itself included). TP rank k of
each holder shards with TP rank k of the others, as ZeRO-1's groups do
(``runtime.zero``). Stages with ``shard`` "none" or "optimizer" are not touched here:
``evaluate`` costs them exactly as before.

Memory of one GPU of such a stage (n = its parameters per GPU, layers i of the stage):

- its 1/P of the fp32 master weights, gradients and optimizer state:
  ``n * state_bytes_per_param / P``, except a tied embedding and head
  (``gradsync.tied_layers``), which the runtime leaves out of FSDP: whole, with
  autocast's copy of them, all-reduced over the holders at the end of the step as
  replicated layers are, and neither gathered nor reduce-scattered;
- the gathered working set of the layers FSDP holds (a tied one is neither gathered
  nor reduce-scattered: 0 below), in the compute dtype (c = 2 bytes under bf16/fp16
  on a GPU, 4 in fp32 or on a CPU): the layer being computed and the next one, gathered
  ahead (prefetch), ``c * max_i(n_i + n_{i+1})``; with ``reshard_after_forward:
  false``, the whole stage's gathered weights, ``c * n``, kept from the forward to the
  backward. Assumption: one copy, shared by every micro-batch in flight (they run
  the same modules, whose parameters stay unsharded until their backward);
- one layer's unsharded gradient while the reduce-scatter takes it: the backward
  makes it in the compute dtype and the reduce-scatter sends it in the gradient
  reduce dtype (``settings.GRAD_REDUCE_DTYPE``): ``max_i n_i * (c + 4)`` (``4`` alone
  when c is 4: no cast). An addition to the issue's "state + working set +
  activations": FSDP holds both buffers while a layer's reduce-scatter starts;
- activations, send/receive buffers and the reserve as for any stage; autocast's
  16-bit copies (``StageCost.cast_bytes``) are not counted: the gathered weights are
  already in the compute dtype. A recompute stage's working layer keeps its copy
  in ``transient_bytes`` (a small over-count, left as it is).

Time per micro-batch, per layer i (n_i parameters per GPU), each a ring collective
over the P holders at the slowest link among their hosts (the host's own when they
share one; across hosts, the ranks of a TP group that share a NIC add up their
bytes on it, ``Host.nic_share``, as the gradient sync does): each member moves (P-1)/P of the
bytes, plus P-1 messages at the slowest type's latency, times the calibrated
collective rate (``CostTables.shard_factor``: a calibrated run's measured over
predicted exposed time of such stages, else the gradient all-reduce's factor):

- ``g_i``: all-gather of the 16-bit weights, ``n_i * c`` bytes, before the forward and
  again before the backward (only before the forward with ``reshard_after_forward:
  false``);
- ``r_i``: reduce-scatter of the gradients, ``n_i * 4`` bytes (fp32), after the backward.

Overlap, as FSDP2 runs them: while layer i computes, the next layer's gather runs
(prefetch), and in the backward also the reduce-scatter of the layer that finished
before it; only what the compute does not cover is exposed, plus what nothing can
cover: the first layer's gather in each direction and the last reduce-scatter
(FSDP waits for it at the end of each backward). With forward times f_i and
backward times b_i (layers 0..L-1, the backward from L-1 down):

    forward  += g_0 + sum_{i<L-1} max(0, g_{i+1} - f_i)
    backward += g'_{L-1} + sum_i max(0, g'_{i-1} + r_{i+1} - b_i) + r_0

where g' is g with ``reshard_after_forward`` (0 without) and out-of-range terms are 0.
Assumption: the collectives share the link with nothing else (the pipeline's sends
run on other links, or are small); all-gathers and reduce-scatters in flight at once
add up their bytes.

The end-of-step gradient sync of a segment held only by one group of such stages is
replaced by these reduce-scatters (no all-reduce; ``unsynced``), ZeRO-1 leaves those
stages alone, and the optimizer steps 1/P of the stage's state (update time / P). A
segment that such a stage shares with holders outside its group (another cut, TP
degree or shard mode) keeps today's all-reduce over all its holders: an
approximation, for plans that validation is to refuse (issue 48, the plan side).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.gradsync import Segment, nic_share, tied_layers
from autohet_cli.costmodel.layertable import LayerTable, StageCost
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.costmodel.transfers import transfer_ms
from autohet_cli.plan import Pipeline, Stage
from autohet_cli.settings import GRAD_REDUCE_BYTES

WEIGHTS = "weights"


class LinkMemo(Protocol):
    """What the holders' link needs of ``costmodel.memo.EvalMemo``."""

    cluster: Cluster
    tables: CostTables

    def ring_gbps(self, stages: Sequence[Stage]) -> float: ...


@dataclass(frozen=True, slots=True)
class WeightShard:
    """What a weight-sharded stage's collectives run over: its P holders' link."""

    holders: int  # P
    gbps: float  # the slowest link among the holders' hosts
    nic_share: int  # TP ranks that share one NIC (1 when the holders share a host)
    hop_ms: float  # one message, at the slowest holder type's latency
    rate_factor: float  # calibrated collective rate (CostTables.shard_factor), else 1

    def collective_ms(self, nbytes: float) -> float:
        """A ring all-gather or reduce-scatter of ``nbytes`` (the whole, per member)."""
        P = self.holders
        if P <= 1 or nbytes <= 0:
            return 0.0
        moved = (P - 1) / P * nbytes * self.nic_share
        return (transfer_ms(moved, self.gbps) + (P - 1) * self.hop_ms) * self.rate_factor


def holder_key(s: Stage) -> tuple[int, int, int]:
    return (s.layer_start, s.layer_end, s.tensor_parallel)


def holder_groups(pipelines: Sequence[Pipeline]) -> dict[tuple[int, int, int], list[Stage]]:
    """The weight-sharded stages by holder group (one cut, one TP degree)."""
    groups: dict[tuple[int, int, int], list[Stage]] = {}
    for p in pipelines:
        for s in p.stages:
            if s.shard == WEIGHTS:
                groups.setdefault(holder_key(s), []).append(s)
    return groups


def weight_shards(
    pipelines: Sequence[Pipeline], memo: LinkMemo
) -> tuple[tuple[WeightShard | None, ...], ...] | None:
    """Per (pipeline, stage): the holders' link of a weight-sharded stage, None for
    the others; None in all when no stage shards its weights."""
    groups = holder_groups(pipelines)
    if not groups:
        return None
    tables = memo.tables
    links: dict[tuple[int, int, int], WeightShard] = {}
    for key, stages in groups.items():
        links[key] = WeightShard(
            holders=len(stages),
            gbps=memo.ring_gbps(stages),
            nic_share=nic_share(stages, memo.cluster),
            hop_ms=max(tables.hop_ms(s.gpu_type) for s in stages),
            rate_factor=max(tables.shard_factor(s.gpu_type) for s in stages),
        )
    return tuple(
        tuple(links[holder_key(s)] if s.shard == WEIGHTS else None for s in p.stages)
        for p in pipelines
    )


def unsynced(
    segments: Sequence[Segment], pipelines: Sequence[Pipeline], tied: Collection[int] = ()
) -> list[Segment]:
    """The segments that still need the end-of-step sync: all but those held only
    by one group of weight-sharded stages (their reduce-scatters did it), of which
    only the ``tied`` layers (a tied embedding and head, which FSDP leaves whole)
    are all-reduced, each as a one-layer segment."""
    out = []
    for seg in segments:
        a, b, holders = seg
        stages = [pipelines[pi].stages[si] for pi, si in holders]
        one_group = len({holder_key(s) for s in stages}) == 1
        if not (one_group and all(s.shard == WEIGHTS for s in stages)):
            out.append(seg)
        else:
            out.extend((i, i + 1, holders) for i in sorted(tied) if a <= i < b)
    return out


def compute_bytes(tables: CostTables, gpu_type: str) -> int:
    """Bytes of a gathered weight: the compute dtype's (fp32 on a CPU, whatever the
    plan says: the runtime computes there in fp32)."""
    return 4 if tables.training.precision == "fp32" or gpu_type == "cpu" else 2


def _layers(table: LayerTable, s: Stage) -> list[StageCost]:
    first = s.layer_start + s.recomputed  # layers before it recompute
    return [table.stage(i, i + 1, recompute=i < first) for i in range(s.layer_start, s.layer_end)]


def exposed_ms(
    fwd: Sequence[float],
    bwd: Sequence[float],
    gather: Sequence[float],
    reduce: Sequence[float],
    *,
    reshard_after_forward: bool,
) -> tuple[float, float]:
    """(forward, backward) communication left exposed per micro-batch (module doc)."""
    L = len(fwd)
    f = gather[0] + sum(max(0.0, gather[i + 1] - fwd[i]) for i in range(L - 1))
    g = list(gather) if reshard_after_forward else [0.0] * L
    b = g[L - 1] + reduce[0]
    for i in range(L):
        during = (g[i - 1] if i >= 1 else 0.0) + (reduce[i + 1] if i + 1 < L else 0.0)
        b += max(0.0, during - bwd[i])
    return f, b


def _own(tables: CostTables, s: Stage) -> list[bool]:
    """Per layer of the stage: whether FSDP shards it (False: a tied embedding or
    head, which the runtime leaves replicated and ``gradsync`` all-reduces)."""
    tied = tied_layers(tables.model)
    return [i not in tied for i in range(s.layer_start, s.layer_end)]


def _sharded_params(layers: Sequence[StageCost], own: Sequence[bool]) -> list[int]:
    """Per layer, the parameters FSDP gathers and reduce-scatters (0 for a tied one)."""
    return [lc.num_params if o else 0 for lc, o in zip(layers, own, strict=True)]


def sharded_stage_cost(
    cost: StageCost, table: LayerTable, s: Stage, shard: WeightShard, tables: CostTables
) -> StageCost:
    """``cost`` with its exposed gathers and reduce-scatters added to the forward and
    backward, and the optimizer stepping 1/P of the sharded state (all of a tied
    layer's)."""
    layers = _layers(table, s)
    own = _own(tables, s)
    c = compute_bytes(tables, s.gpu_type)
    mine = _sharded_params(layers, own)  # collective_ms of 0 bytes is 0
    gather = [shard.collective_ms(n * c) for n in mine]
    reduce = [shard.collective_ms(n * GRAD_REDUCE_BYTES) for n in mine]
    tied_update = sum(lc.update_ms for lc, o in zip(layers, own, strict=True) if not o)
    f, b = exposed_ms(
        [lc.fwd_ms for lc in layers],
        [lc.bwd_ms for lc in layers],
        gather,
        reduce,
        reshard_after_forward=s.reshard_after_forward,
    )
    return replace(
        cost,
        fwd_ms=cost.fwd_ms + f,
        bwd_ms=cost.bwd_ms + b,
        update_ms=(cost.update_ms - tied_update) / shard.holders + tied_update,
    )


def sharded_memory_bytes(
    cost: StageCost,
    table: LayerTable,
    s: Stage,
    shard: WeightShard,
    tables: CostTables,
    stage_index: int,
    num_stages: int,
    num_microbatches: int,
) -> int:
    """Peak bytes on one GPU of a weight-sharded stage under 1F1B (module doc)."""
    layers = _layers(table, s)
    params = [lc.num_params for lc in layers]
    own = _own(tables, s)
    # a tied layer's weights stay whole, with autocast's copy of them (plain stage's)
    tied = sum(p for p, o in zip(params, own, strict=True) if not o)
    tied_cast = sum(
        table.stage(i, i + 1).cast_bytes
        for i, o in zip(range(s.layer_start, s.layer_end), own, strict=True)
        if not o
    )
    c = compute_bytes(tables, s.gpu_type)
    mine = _sharded_params(layers, own)
    if s.reshard_after_forward:
        pairs = [a + b for a, b in zip(mine, mine[1:], strict=False)] or mine
        gathered = c * max(pairs)
    else:
        gathered = c * (cost.num_params - tied)
    grad_buffer = max(mine) * (GRAD_REDUCE_BYTES + (c if c != GRAD_REDUCE_BYTES else 0))
    per = tables.training.state_bytes_per_param
    state = (cost.num_params - tied) * per / shard.holders + tied * per + tied_cast
    in_flight = min(num_stages - stage_index, num_microbatches)
    once = cost.transient_bytes + 2.0 * cost.output_bytes + tables.reserve_bytes(s.gpu_type)
    return int(state + gathered + grad_buffer + cost.act_bytes * in_flight + once)
