"""Predicted and measured 1F1B schedules as Chrome / Perfetto traces (pure).

One process per pipeline, one row (thread) per stage; forward ``F<i>`` and
backward ``B<i>`` boxes per micro-batch, ``send`` boxes for stage-to-stage
transfers (predicted) or ``p2p`` for the time a rank spent in exchanges
(measured: transfer plus waiting), then ``sync`` (gradient all-reduce) and
``optimizer``. ``autohet estimate PLAN --trace OUT.json`` writes the prediction;
the runtime's ``--trace`` writes the measurement in the same form, so the two
open side by side in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    pipeline: int
    stage: int
    name: str  # F3 | B3 | send | p2p | sync | optimizer
    start_ms: float
    end_ms: float
    step: int = 0

    @property
    def category(self) -> str:
        if self.name[:1] in ("F", "B") and self.name[1:].isdigit():
            return "forward" if self.name[0] == "F" else "backward"
        return self.name


def chrome_trace(
    spans: Iterable[Span], *, title: str, stage_labels: dict[tuple[int, int], str] | None = None
) -> dict[str, Any]:
    """The Trace Event Format (``ph: X`` complete events, microseconds)."""
    spans = sorted(spans, key=lambda s: (s.pipeline, s.stage, s.start_ms))
    events: list[dict[str, Any]] = []
    rows = sorted({(s.pipeline, s.stage) for s in spans} | set(stage_labels or {}))
    for p in sorted({r[0] for r in rows}):
        events.append(_meta("process_name", p, 0, f"pipeline {p}"))
        events.append(_meta("process_sort_index", p, 0, p))
    for p, s in rows:
        label = (stage_labels or {}).get((p, s), f"stage {s}")
        events.append(_meta("thread_name", p, s, label))
        events.append(_meta("thread_sort_index", p, s, s))
    for sp in spans:
        events.append(
            {
                "name": sp.name,
                "cat": sp.category,
                "ph": "X",
                "pid": sp.pipeline,
                "tid": sp.stage,
                "ts": round(sp.start_ms * 1e3, 3),
                "dur": round(max(0.0, sp.end_ms - sp.start_ms) * 1e3, 3),
                "args": {"step": sp.step},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}


def _meta(name: str, pid: int, tid: int, value: object) -> dict[str, Any]:
    key = "name" if name.endswith("_name") else "sort_index"
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def predicted_spans(
    timelines: Sequence[Sequence[tuple[int, str, int, float, float]]],
    sends_ms: Sequence[Sequence[float]],
    sync_ms: Sequence[Sequence[float]],
    optimizer_ms: Sequence[Sequence[float]],
    pipeline_ms: float,
) -> list[Span]:
    """Spans of one predicted iteration from each pipeline's simulated timeline
    (``costmodel.pipeline.simulate_1f1b(..., timeline=True)``): every pipeline's
    gradient sync starts when the slowest pipeline ends, then the optimizer."""
    out: list[Span] = []
    for p, ops in enumerate(timelines):
        for stage, kind, mb, start, end in ops:
            name = f"{kind}{mb}"
            out.append(Span(pipeline=p, stage=stage, name=name, start_ms=start, end_ms=end))
            links = sends_ms[p]
            if kind == "F" and stage < len(links) and links[stage] > 0:
                done = end + links[stage]
                out.append(Span(pipeline=p, stage=stage, name="send", start_ms=end, end_ms=done))
        for stage, (sync, opt) in enumerate(zip(sync_ms[p], optimizer_ms[p], strict=True)):
            if sync > 0:
                out.append(
                    Span(
                        pipeline=p,
                        stage=stage,
                        name="sync",
                        start_ms=pipeline_ms,
                        end_ms=pipeline_ms + sync,
                    )
                )
            start = pipeline_ms + sync
            out.append(
                Span(pipeline=p, stage=stage, name="optimizer", start_ms=start, end_ms=start + opt)
            )
    return out
