"""One layer table: a profile entry's per-layer costs as prefix sums, so any stage's
cost is O(1) (pure).

``CostTables`` (``costmodel.tables``) decides which entry a GPU type, TP degree
and micro-batch size get (measured, calibrated or analytic) and what is added to
it (TP all-reduces, autocast's weight copies, each layer's input bytes); a
``LayerTable`` only sums, and its ``stage`` is what ``evaluate`` and the planner
ask thousands of times. Recomputation follows ``costmodel.tables``' module doc.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from autohet_cli.estimates.profile import ProfileEntry


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCost:
    """One stage's cost on one GPU of its TP group, per micro-batch (a ``LayerTable``
    range): what ``evaluate`` schedules and the memory it holds."""

    fwd_ms: float
    bwd_ms: float  # with recompute, the re-run forward included
    update_ms: float
    num_params: int  # per GPU of the TP group
    act_bytes: float  # kept for backward, per in-flight micro-batch
    output_bytes: float  # sent to the next stage per micro-batch
    transient_bytes: float = 0.0  # held once, during one layer's backward (recompute)
    recompute: bool = False
    cast_bytes: float = 0.0  # autocast's 16-bit weight copies, held once for the step


class LayerTable:
    """Prefix sums over one profile entry (plus TP communication if analytic).

    ``input_bytes`` are per layer the bytes of what enters it (one micro-batch),
    which is what a recompute stage keeps; the largest ``act_bytes`` of a layer
    range comes from a sparse table, so ``stage()`` stays O(1) for any range
    (the planner's refinement evaluates thousands of candidate stages; a scan
    would be cheap for short stages, but a whole-model stage is 100+ layers).
    """

    def __init__(
        self,
        entry: ProfileEntry,
        tp_comm_ms: list[float],
        input_bytes: Sequence[float],
        cast_bytes: Sequence[float] | None = None,
    ) -> None:
        self.source = entry.source
        layers = entry.layers
        self.num_layers = len(layers)
        if len(input_bytes) != self.num_layers:
            raise ValueError(f"{len(input_bytes)} input sizes for {self.num_layers} layers")
        self._fwd = [
            0.0,
            *accumulate(lt.fwd_ms + c for lt, c in zip(layers, tp_comm_ms, strict=True)),
        ]
        self._bwd = [
            0.0,
            *accumulate(lt.bwd_ms + c for lt, c in zip(layers, tp_comm_ms, strict=True)),
        ]
        self._rfwd = [
            0.0,
            *accumulate(lt.rc_fwd_ms + c for lt, c in zip(layers, tp_comm_ms, strict=True)),
        ]
        self._rbwd = [
            0.0,
            *accumulate(lt.rc_bwd_ms + 2 * c for lt, c in zip(layers, tp_comm_ms, strict=True)),
        ]
        self._upd = [0.0, *accumulate(lt.update_ms for lt in layers)]
        self._params = [0, *accumulate(lt.num_params for lt in layers)]
        cast = list(cast_bytes) if cast_bytes is not None else [0.0] * self.num_layers
        self._act = [0.0, *accumulate(lt.act_bytes for lt in layers)]
        self._cast = [0.0, *accumulate(cast)]
        self._out = [lt.output_bytes for lt in layers]
        self._in = [0.0, *accumulate(input_bytes)]
        # a recompute stage's working layer: its activations and its weights' copies
        self._act_max = _sparse_max([lt.act_bytes + c for lt, c in zip(layers, cast, strict=True)])

    def stage(
        self, start: int, end: int, *, recompute: bool = False, recompute_first: int = 0
    ) -> StageCost:
        """Layers [start, end); ``recompute``: every layer recomputes, else the first
        ``recompute_first`` of them (``Stage.recomputed``)."""
        if not recompute and 0 < recompute_first < end - start:
            return self._partial(start, end, start + recompute_first)
        if recompute_first >= end - start > 0:
            recompute = True
        fwd = self._fwd[end] - self._fwd[start]
        bwd = self._bwd[end] - self._bwd[start]
        if recompute:
            return StageCost(
                fwd_ms=self._rfwd[end] - self._rfwd[start],
                bwd_ms=self._rbwd[end] - self._rbwd[start],
                update_ms=self._upd[end] - self._upd[start],
                num_params=self._params[end] - self._params[start],
                act_bytes=self._in[end] - self._in[start],
                output_bytes=self._out[end - 1],
                transient_bytes=self.max_act_bytes(start, end),
                recompute=True,
            )
        return StageCost(
            fwd_ms=fwd,
            bwd_ms=bwd,
            update_ms=self._upd[end] - self._upd[start],
            num_params=self._params[end] - self._params[start],
            act_bytes=self._act[end] - self._act[start],
            output_bytes=self._out[end - 1],
            cast_bytes=self._cast[end] - self._cast[start],
        )

    def _partial(self, start: int, end: int, cut: int) -> StageCost:
        """[start, cut) recomputing, [cut, end) not: their times add up; the stage
        keeps the first part's inputs and the rest's activations per micro-batch in
        flight, the first part's working layer once, and the rest's weight copies."""
        r = self.stage(start, cut, recompute=True)
        k = self.stage(cut, end)
        return StageCost(
            fwd_ms=r.fwd_ms + k.fwd_ms,
            bwd_ms=r.bwd_ms + k.bwd_ms,
            update_ms=r.update_ms + k.update_ms,
            num_params=r.num_params + k.num_params,
            act_bytes=r.act_bytes + k.act_bytes,
            output_bytes=k.output_bytes,
            transient_bytes=r.transient_bytes,
            recompute=True,
            cast_bytes=k.cast_bytes,
        )

    def max_act_bytes(self, start: int, end: int) -> float:
        """The largest ``act_bytes`` (with the layer's weight copies) of one layer in
        [start, end): O(1)."""
        level = (end - start).bit_length() - 1
        row = self._act_max[level]
        return max(row[start], row[end - (1 << level)])

    def compute_ms(self, start: int, end: int, *, recompute: bool = False) -> float:
        if recompute:
            return self._rfwd[end] - self._rfwd[start] + self._rbwd[end] - self._rbwd[start]
        return self._fwd[end] - self._fwd[start] + self._bwd[end] - self._bwd[start]

    def params(self, start: int, end: int) -> int:
        return self._params[end] - self._params[start]


def _sparse_max(values: Sequence[float]) -> list[list[float]]:
    """Row k holds the max of each window of 2**k values (a sparse table)."""
    rows = [list(values)]
    while 2 << (len(rows) - 1) <= len(values):
        prev, half = rows[-1], 1 << (len(rows) - 1)
        rows.append([max(prev[i], prev[i + half]) for i in range(len(prev) - half)])
    return rows
