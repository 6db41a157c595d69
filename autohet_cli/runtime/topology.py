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

Segments and gradient sync
    Cut the layer range at every stage boundary of every pipeline. Each resulting
    segment is held, in every pipeline, by exactly one stage; the TP rank ``k`` of
    those stages (one per pipeline) all-reduce the segment's gradients. Parameters
    tied across layers (a GPT's embedding and head) are synced over every rank
    that holds any of the tied layers, each rank contributing its copy once.

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
    """Ranks that all-reduce the gradients of ``layers`` (or of one tied parameter)."""

    key: str  # "segment:a-b" or "tied:<parameter name>"
    layers: tuple[int, ...]
    tp_rank: int
    ranks: tuple[int, ...]


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

    def prev_rank(self, rank: int) -> int | None:
        """The same TP rank of the previous stage of this rank's pipeline."""
        i = self.ranks[rank]
        return None if i.is_first_stage else self.rank_of(i.pipeline, i.stage - 1, i.tp_rank)

    def next_rank(self, rank: int) -> int | None:
        i = self.ranks[rank]
        return None if i.is_last_stage else self.rank_of(i.pipeline, i.stage + 1, i.tp_rank)

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

    def sync_groups(self, tied: Iterable[tuple[str, tuple[int, ...]]] = ()) -> list[SyncGroup]:
        """All gradient-sync groups of the plan, in one order every rank agrees on.

        ``tied`` lists parameters shared by several layers as (name, layer indices).
        """
        tp = self.plan.tensor_parallel
        groups = [
            SyncGroup(
                key=f"segment:{a}-{b}",
                layers=tuple(range(a, b)),
                tp_rank=k,
                ranks=self.holders([a], k),
            )
            for a, b in self.segments()
            for k in range(tp)
        ]
        for name, layers in tied:
            groups += [
                SyncGroup(
                    key=f"tied:{name}",
                    layers=tuple(layers),
                    tp_rank=k,
                    ranks=self.holders(layers, k),
                )
                for k in range(tp)
            ]
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
