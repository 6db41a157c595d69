"""Who does what in a plan: rank mapping, layer segments, sync groups, batch shares (pure).

Nothing here imports torch, so the launcher's reasoning and the unit tests can use
the same rules the workers follow.

Rank order
    A plan's devices are numbered in *plan order*: pipelines in the order the plan
    lists them, inside a pipeline its stages first to last, inside a stage its
    ``devices`` (the stage's TP ranks) in order. Device number ``r`` in that order
    is logical rank ``r``; it is exactly ``plan.devices()[r]``. Under a launcher
    that starts torchrun ranks in plan order, logical rank == ``RANK``. When one
    torchrun agent per host is used instead (torchrun numbers ranks contiguously
    per host, which plan order need not be), a worker names its host and is the
    ``LOCAL_RANK``-th device of that host in plan order (``slot_for_host``); the
    runtime then exchanges logical ranks once at start-up.

Stages of different TP degrees
    Each stage has its own TP degree. A stage's boundary activations (and their
    gradients) are replicated over its TP ranks, so a rank needs them from any one
    rank of its neighbour: TP rank ``k`` of a stage of degree ``b`` receives from
    TP rank ``k mod a`` of its neighbour of degree ``a``, and a sender sends to every
    rank that maps to it (none, when it has more ranks than the receiver). With
    equal degrees that is rank ``k`` to rank ``k``, as before.

Segments and gradient sync
    Cut the layer range at every stage boundary of every pipeline. Each resulting
    segment is held, in every pipeline, by exactly one stage. Where those stages
    have one TP degree, the TP rank ``k`` of each (one per pipeline) all-reduce
    the segment's gradients: their shards line up. Where the degrees differ, the
    shards do not, and the segment syncs through the full gradient (``SyncGroup
    .full``): each holding stage gathers it over its TP group, TP rank 0 of every
    holding stage all-reduces it, and each broadcasts the sum back to its TP
    group, which keeps its own shard. Why not reshard: a TP-1 stage holds plain
    tensors that do not say along which dimension another stage shards them;
    the full gradient needs no such knowledge (DTensor gathers and re-shards it),
    and it moves the same bytes through each host's NIC as the sharded rings do
    (the t rings of a TP group carry 1/t each); the gather and the broadcast stay
    inside a host. Parameters tied across layers (a GPT's embedding and head) are
    synced over every stage that holds any of the tied layers, each contributing
    its copy once, by the same two rules.

Batch shares
    Pipeline ``p`` takes the contiguous slice of the global batch that starts after
    the samples of pipelines ``0..p-1`` and holds ``num_microbatches_p *
    micro_batch_size`` samples; its micro-batch ``j`` is the ``j``-th consecutive
    ``micro_batch_size`` samples of that slice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from autohet_cli.plan import Device, Plan

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """One logical rank's place in the plan."""

    rank: int
    pipeline: int
    stage: int
    tp_rank: int
    num_stages: int
    tp_size: int
    layer_start: int
    layer_end: int
    num_microbatches: int
    device: Device

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    def holds(self, layer: int) -> bool:
        return self.layer_start <= layer < self.layer_end


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncGroup:
    """Ranks that all-reduce the gradients of ``layers`` (or of one tied parameter).

    ``full``: the holding stages have different TP degrees; ``ranks`` (TP rank 0 of
    each holding stage) all-reduce the full gradient, and ``members`` (every rank of
    those stages) gather it before and receive the sum after, over their TP group.
    Otherwise ``members == ranks``: TP rank ``tp_rank`` of each holding stage."""

    key: str  # "segment:a-b" or "tied:<parameter name>"
    layers: tuple[int, ...]
    tp_rank: int
    ranks: tuple[int, ...]
    full: bool = False
    members: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.members:
            object.__setattr__(self, "members", self.ranks)


class Topology:
    """The plan seen as ranks; every worker computes the same answers from the same plan."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        infos: list[RankInfo] = []
        for p, pipe in enumerate(plan.pipelines):
            for s, stage in enumerate(pipe.stages):
                for k, device in enumerate(stage.devices):
                    infos.append(
                        RankInfo(
                            rank=len(infos),
                            pipeline=p,
                            stage=s,
                            tp_rank=k,
                            num_stages=len(pipe.stages),
                            tp_size=stage.tensor_parallel,
                            layer_start=stage.layer_start,
                            layer_end=stage.layer_end,
                            num_microbatches=pipe.num_microbatches,
                            device=device,
                        )
                    )
        self.ranks: tuple[RankInfo, ...] = tuple(infos)
        self._index = {(i.pipeline, i.stage, i.tp_rank): i.rank for i in infos}

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def rank_of(self, pipeline: int, stage: int, tp_rank: int) -> int:
        return self._index[(pipeline, stage, tp_rank)]

    def stage_ranks(self, pipeline: int, stage: int) -> tuple[int, ...]:
        """The TP group of one stage, in TP-rank order."""
        tp = self.plan.pipelines[pipeline].stages[stage].tensor_parallel
        return tuple(self.rank_of(pipeline, stage, k) for k in range(tp))

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Every stage's TP group, in plan order."""
        return [
            self.stage_ranks(p, s)
            for p, pipe in enumerate(self.plan.pipelines)
            for s in range(len(pipe.stages))
        ]

    def _degree(self, pipeline: int, stage: int) -> int:
        return self.plan.pipelines[pipeline].stages[stage].tensor_parallel

    def prev_rank(self, rank: int) -> int | None:
        """The rank of the previous stage this rank receives activations from
        (TP rank ``k mod a`` of a previous stage of degree ``a``)."""
        i = self.ranks[rank]
        if i.is_first_stage:
            return None
        return self.rank_of(
            i.pipeline, i.stage - 1, i.tp_rank % self._degree(i.pipeline, i.stage - 1)
        )

    def next_rank(self, rank: int) -> int | None:
        """The rank of the next stage this rank receives gradients from."""
        i = self.ranks[rank]
        if i.is_last_stage:
            return None
        return self.rank_of(
            i.pipeline, i.stage + 1, i.tp_rank % self._degree(i.pipeline, i.stage + 1)
        )

    def send_next(self, rank: int) -> tuple[int, ...]:
        """The ranks of the next stage this rank sends its activations to."""
        i = self.ranks[rank]
        if i.is_last_stage:
            return ()
        n = self._degree(i.pipeline, i.stage + 1)
        return tuple(
            self.rank_of(i.pipeline, i.stage + 1, k) for k in range(i.tp_rank, n, i.tp_size)
        )

    def send_prev(self, rank: int) -> tuple[int, ...]:
        """The ranks of the previous stage this rank sends input gradients to."""
        i = self.ranks[rank]
        if i.is_first_stage:
            return ()
        n = self._degree(i.pipeline, i.stage - 1)
        return tuple(
            self.rank_of(i.pipeline, i.stage - 1, k) for k in range(i.tp_rank, n, i.tp_size)
        )

    # ----------------------------------------------------------------- gradient sync

    def segments(self) -> tuple[tuple[int, int], ...]:
        """The layer range cut at every stage boundary of every pipeline."""
        cuts = {0, self.plan.num_layers}
        for pipe in self.plan.pipelines:
            cuts.update(s.layer_end for s in pipe.stages)
        edges = sorted(cuts)
        return tuple(zip(edges[:-1], edges[1:], strict=True))

    def holders(self, layers: Iterable[int], tp_rank: int) -> tuple[int, ...]:
        """Ranks of TP rank ``tp_rank`` that hold any of ``layers``, in rank order."""
        wanted = set(layers)
        return tuple(
            i.rank for i in self.ranks if i.tp_rank == tp_rank and any(i.holds(x) for x in wanted)
        )

    def _groups_for(self, key: str, layers: tuple[int, ...]) -> list[SyncGroup]:
        """The sync groups of parameters held by the stages holding any of ``layers``."""
        wanted = set(layers)
        holding = [i for i in self.ranks if any(i.holds(x) for x in wanted)]
        degrees = {i.tp_size for i in holding}
        if len(degrees) == 1:
            return [
                SyncGroup(key=key, layers=layers, tp_rank=k, ranks=self.holders(layers, k))
                for k in range(degrees.pop())
            ]
        return [
            SyncGroup(
                key=key,
                layers=layers,
                tp_rank=0,
                ranks=tuple(i.rank for i in holding if i.tp_rank == 0),
                full=True,
                members=tuple(i.rank for i in holding),
            )
        ]

    def writes_layout(self, rank: int, layers: Iterable[int]) -> bool:
        """Whether ``rank`` saves the parameters of ``layers`` to a checkpoint: all their
        holders do when they share one TP degree; where degrees differ, only those
        at the degree of the first holder in rank order. DCP stores one set of chunks
        per name; a TP-2 stage's two halves and a TP-1 stage's whole tensor of the
        same name would collide (both start at offset 0). Loading reshards from
        whichever layout was saved, so every rank still loads every parameter."""
        wanted = set(layers)
        holding = [i for i in self.ranks if any(i.holds(x) for x in wanted)]
        me = self.ranks[rank]
        return me in holding and me.tp_size == holding[0].tp_size

    def sync_groups(self, tied: Iterable[tuple[str, tuple[int, ...]]] = ()) -> list[SyncGroup]:
        """All gradient-sync groups of the plan, in one order every rank agrees on.

        ``tied`` lists parameters shared by several layers as (name, layer indices).
        """
        groups: list[SyncGroup] = []
        for a, b in self.segments():
            # A stage holding any layer of a segment holds all of it: no stage cuts inside.
            groups += self._groups_for(f"segment:{a}-{b}", tuple(range(a, b)))
        for name, layers in tied:
            groups += self._groups_for(f"tied:{name}", tuple(layers))
        return groups

    # ----------------------------------------------------------------- data

    def sample_range(self, pipeline: int) -> tuple[int, int]:
        """[start, stop) of pipeline ``pipeline``'s samples in the global batch."""
        mbs = self.plan.training.micro_batch_size
        start = sum(p.num_microbatches for p in self.plan.pipelines[:pipeline]) * mbs
        return start, start + self.plan.pipelines[pipeline].num_microbatches * mbs

    # ----------------------------------------------------------------- launch

    def slot_for_host(self, host: str, local_rank: int) -> int:
        """Logical rank of the ``local_rank``-th device of ``host`` in plan order."""
        on_host = [i.rank for i in self.ranks if i.device.host == host]
        if not on_host:
            raise ValueError(f"host {host!r} holds no device of plan {self.plan.name!r}")
        if not 0 <= local_rank < len(on_host):
            raise ValueError(
                f"LOCAL_RANK {local_rank} on host {host!r}: the plan puts {len(on_host)} "
                "workers there"
            )
        return on_host[local_rank]


def one_f_one_b(num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The compute order of one stage under 1F1B (PipeDream-flush).

    ``min(num_stages - stage - 1, m)`` warm-up forwards, then alternate one forward
    and one backward, then drain the remaining backwards. Works for any m >= 1,
    including fewer micro-batches than stages.
    """
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    order = [(FORWARD, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(FORWARD, warmup + i), (BACKWARD, i)]
    order += [(BACKWARD, i) for i in range(m - warmup, m)]
    return order
