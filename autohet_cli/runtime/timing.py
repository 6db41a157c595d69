"""What each rank measures of a step, for the report against the plan and for traces.

A ``Clock`` marks points in a step. On a GPU the marks are CUDA events recorded on
the current stream and read once at the end of the step (one synchronize), so
timing neither serialises the step nor measures only kernel launches; on a CPU
they are ``perf_counter`` readings.

Each rank keeps, per step: forward and backward milliseconds (summed over its
micro-batches), time inside point-to-point exchanges (transfers plus waiting for
the neighbour: pipeline bubbles show here), gradient sync, optimizer (clipping
included) and the whole step; and, for the steps being traced, every op with its
start and end relative to the step's start.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

KEEP_STEPS = 1000  # per-step summaries kept for the medians (bounded memory)


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        """Milliseconds from mark ``a`` to mark ``b`` (after ``settle``)."""
        if self.cuda:
            return float(a.elapsed_time(b))
        return float(b - a) * 1e3

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@dataclass(frozen=True, slots=True)
class Op:
    name: str  # F3, B3, p2p, sync, optimizer
    start_ms: float
    end_ms: float


@dataclass(slots=True)
class StepTiming:
    step: int
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    p2p_ms: float = 0.0
    sync_ms: float = 0.0
    optimizer_ms: float = 0.0
    step_ms: float = 0.0
    ops: list[Op] = field(default_factory=list)  # only for traced steps


class StepMarks:
    """Marks of one step, turned into a ``StepTiming`` when the step is over."""

    def __init__(self, clock: Clock, step: int, *, keep_ops: bool) -> None:
        self.clock, self.step, self.keep_ops = clock, step, keep_ops
        self.start = clock.mark()
        self.spans: list[tuple[str, Any, Any]] = []

    def span(self, name: str, a: Any, b: Any) -> None:
        self.spans.append((name, a, b))

    def finish(self) -> StepTiming:
        end = self.clock.mark()
        self.clock.settle()
        t = StepTiming(step=self.step, step_ms=self.clock.ms(self.start, end))
        for name, a, b in self.spans:
            dur = self.clock.ms(a, b)
            kind = name[0] if name[0] in "FB" and name[1:].isdigit() else name
            if kind == "F":
                t.fwd_ms += dur
            elif kind == "B":
                t.bwd_ms += dur
            elif kind == "p2p":
                t.p2p_ms += dur
            elif kind == "sync":
                t.sync_ms += dur
            elif kind == "optimizer":
                t.optimizer_ms += dur
            if self.keep_ops:
                start = self.clock.ms(self.start, a)
                t.ops.append(Op(name=name, start_ms=start, end_ms=start + dur))
        return t


@dataclass(slots=True)
class Timings:
    """A rank's step timings: summaries of recent steps, ops of traced ones."""

    summaries: deque[StepTiming] = field(default_factory=lambda: deque(maxlen=KEEP_STEPS))
    traced: list[StepTiming] = field(default_factory=list)

    def add(self, t: StepTiming) -> None:
        if t.ops:
            self.traced.append(t)
            t = StepTiming(**{**asdict(t), "ops": []})
        self.summaries.append(t)

    def medians(self, skip: int = 2) -> dict[str, float] | None:
        """Median of each term over the kept steps, without the first ``skip`` steps
        of the run when more remain (start-up: allocator, caches, lazy init)."""
        steps: Sequence[StepTiming] = list(self.summaries)
        first = steps[0].step if steps else 0
        later = [t for t in steps if t.step >= first + skip]
        steps = later or steps
        if not steps:
            return None
        names = ("fwd_ms", "bwd_ms", "p2p_ms", "sync_ms", "optimizer_ms", "step_ms")
        out = {n: statistics.median(getattr(t, n) for t in steps) for n in names}
        out["steps"] = float(len(steps))
        return out
