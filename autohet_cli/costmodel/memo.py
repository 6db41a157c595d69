"""Evaluations of one (cluster, tables) pair, kept for the next one (pure).

The planner evaluates thousands of plans that differ from the last in one
pipeline (refinement moves a boundary or a micro-batch) and shares the rest; so
each pipeline's own part, each sync segment, each ring's link and each step
overhead are computed once. Pure: every entry is a function of its key and the
pair.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.gradsync import ring_gbps, segment_sync_ms
from autohet_cli.costmodel.pipelinepart import PipelinePart, pipeline_part
from autohet_cli.costmodel.sharding import WeightShard
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.plan import Pipeline, Stage

T = TypeVar("T")


class EvalMemo:
    """Evaluations of one (cluster, tables) pair, kept for the next one (see above)."""

    MAX_ENTRIES = 200_000  # per store, then cleared: a long search's memory stays bounded

    def __init__(self, cluster: Cluster, tables: CostTables) -> None:
        self.cluster = cluster  # held: the memo is found by its id
        self.tables = tables
        self.parts: dict[object, PipelinePart] = {}
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

    def pipeline(
        self, p: Pipeline, mbs: int, shards: tuple[WeightShard | None, ...] | None = None
    ) -> PipelinePart:
        key = (p, mbs) if shards is None else (p, mbs, shards)
        return self._get(
            self.parts, key, lambda: pipeline_part(p, self.cluster, self.tables, mbs, shards)
        )

    def overhead(self, gpu: str, tp: int, world: int) -> float:
        return self._get(
            self.overheads, (gpu, tp, world), lambda: self.tables.step_overhead_ms(gpu, tp, world)
        )

    def ring_gbps(self, stages: Sequence[Stage]) -> float:
        names = tuple(sorted({s.host for s in stages}))
        return self._get(self.rings, names, lambda: ring_gbps(stages, self.cluster))

    def segment_sync_ms(self, stages: Sequence[Stage], a: int, b: int, mbs: int) -> float:
        # what the sync of a segment depends on: cheaper to hash than the stages
        key = (a, b, mbs, tuple((s.gpu_type, s.tensor_parallel, s.host) for s in stages))
        return self._get(self.segments, key, lambda: segment_sync_ms(stages, a, b, mbs, self))


def memo_for(cluster: Cluster, tables: CostTables) -> EvalMemo:
    memos = tables.evaluate_memos
    held = memos.get(id(cluster))
    if held is None or held.cluster is not cluster:
        if len(memos) >= 8:
            memos.clear()
        held = memos[id(cluster)] = EvalMemo(cluster, tables)
    return held
