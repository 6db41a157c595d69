"""Gradient sync and ZeRO-1's shares of a plan's pipelines (pure).

Cut the layer range at every stage boundary of every pipeline; each segment is
held by exactly one stage per pipeline, and those stages' TP ranks all-reduce its
gradients (``costmodel.evaluate`` says how, and what ZeRO-1 changes). The rings'
links and each segment's time are kept by the memo (``costmodel.memo``), seen
here through ``SyncMemo`` so that it can sit above this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.costmodel.transfers import ring_allreduce_ms, transfer_ms
from autohet_cli.estimates.fixed import ring_latency_ms
from autohet_cli.models import ModelSpec
from autohet_cli.plan import Pipeline, Stage


class SyncMemo(Protocol):
    """What the sync needs of ``costmodel.memo.EvalMemo``: its pair, and the cached
    ring links and segment times."""

    cluster: Cluster
    tables: CostTables

    def ring_gbps(self, stages: Sequence[Stage]) -> float: ...

    def segment_sync_ms(self, stages: Sequence[Stage], a: int, b: int, mbs: int) -> float: ...


Segment = tuple[int, int, list[tuple[int, int]]]  # [a, b) and its (pipeline, stage) holders


def sync_segments(pipelines: Sequence[Pipeline]) -> list[Segment]:
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


def grad_sync_ms(
    pipelines: Sequence[Pipeline], mbs: int, memo: SyncMemo, segments: Sequence[Segment]
) -> list[list[float]]:
    """Per (pipeline, stage): time to all-reduce the gradients of its layers."""
    out = [[0.0] * len(p.stages) for p in pipelines]
    if len(pipelines) < 2:
        return out
    for a, b, holders in segments:
        t = memo.segment_sync_ms([pipelines[pi].stages[si] for pi, si in holders], a, b, mbs)
        for pi, si in holders:
            out[pi][si] += t
    return out


def segment_sync_ms(stages: Sequence[Stage], a: int, b: int, mbs: int, memo: SyncMemo) -> float:
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
    kept = total - sum(layers[i].num_params for i in tied_layers(tables.model) if a <= i < b)
    return 1.0 + (f - 1.0) * (kept / total if total > 0 else 1.0)


def tied_layers(model: ModelSpec) -> set[int]:
    """The layers ZeRO-1 and FSDP leave replicated: a tied embedding and head (each
    whole: the position embedding beside the tied one is counted with it)."""
    if not model.tied_embeddings:
        return set()
    return {i for i, layer in enumerate(model.layers()) if layer.kind in ("embedding", "head")}


def _sharded_sync_ms(stages: Sequence[Stage], a: int, b: int, mbs: int, memo: SyncMemo) -> float:
    """Holders of one degree t: t rings, TP rank k with TP rank k."""
    cluster, tables, participants = memo.cluster, memo.tables, len(stages)
    nbytes = _segment_bytes(stages[0], a, b, cluster, tables, mbs)
    if len({s.host for s in stages}) == 1:
        measured = tables.intra_allreduce_ms(stages[0].gpu_type, nbytes, participants)
        if measured is not None:
            return measured
    else:  # the TP group's rings add up on a NIC its ranks share
        nbytes *= nic_share(stages, cluster)
    return ring_allreduce_ms(nbytes, participants, memo.ring_gbps(stages)) + _ring_latency(
        stages, tables, participants
    )


def _full_sync_ms(stages: Sequence[Stage], a: int, b: int, mbs: int, memo: SyncMemo) -> float:
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


def nic_share(stages: Sequence[Stage], cluster: Cluster) -> int:
    """The TP ranks of one holder that add up their ring bytes on a NIC
    (``Host.nic_share``; 1 when the holders share a host: the ring stays inside it).
    The holders share one TP degree (the segment's sharded sync, a sharded stage's
    holders)."""
    hosts = {s.host for s in stages}
    if len(hosts) == 1:
        return 1
    return max(cluster.host(h).nic_share(stages[0].tensor_parallel) for h in hosts)


def ring_gbps(stages: Sequence[Stage], cluster: Cluster) -> float:
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
    tied = tied_layers(tables.model)
    # per (type, degree, link, segment): recover's refinement evaluates 200 pipelines'
    # plans ~1,600 times, and a sum per holder per layer was half of its time
    kept: dict[tuple[str, int, float, int, int], int] = {}
    for a, b, holders in segments if segments is not None else sync_segments(pipelines):
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
