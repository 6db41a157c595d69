"""Helpers shared by the benchmarks: timing, plain-text tables, plan summaries."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

from autohet_cli.plan import Pipeline

T = TypeVar("T")


def timed(fn: Callable[[], T], repeats: int) -> tuple[float, list[float], T]:
    """Median wall time over ``repeats`` runs, all the times, and the last result."""
    times = []
    result: T | None = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    assert result is not None
    return statistics.median(times), times, result


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned columns (left-aligned first column), one header rule."""
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def describe(pipelines: Sequence[Pipeline]) -> str:
    """Pipelines grouped by shape: ``3x[A100-40:26] m=5`` (GPU type:layers per stage)."""
    shapes: Counter[str] = Counter()
    for p in pipelines:
        stages = "|".join(f"{s.gpu_type}:{s.num_layers}" for s in p.stages)
        shapes[f"[{stages}] m={p.num_microbatches}"] += 1
    return " ".join(f"{k}x{shape}" for shape, k in shapes.items())


def fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"
