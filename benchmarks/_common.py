"""Helpers shared by the benchmarks: timing, worker processes, plain-text tables, plan
summaries."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from autohet_cli.plan import Pipeline

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    wall_s: list[float]
    cpu_s: list[float]  # this process only: what other jobs on the machine do not inflate

    @property
    def median_s(self) -> float:
        return statistics.median(self.wall_s)

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.cpu_s)

    def spread(self) -> str:
        return f"{min(self.wall_s):.2f}-{max(self.wall_s):.2f}" if len(self.wall_s) > 1 else "-"


def timed(fn: Callable[[], T], repeats: int) -> tuple[Timing, T]:
    """Wall and CPU time of ``repeats`` runs, and the last result."""
    wall, cpu = [], []
    result: T | None = None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    assert result is not None
    return Timing(wall_s=wall, cpu_s=cpu), result


def worker_times(
    cmd: Sequence[str], variant: str, out: Path, env: Mapping[str, str] | None = None
) -> list[float]:
    """Run a benchmark's worker ``cmd`` from the repository (one thread per process,
    ``env`` added, no launcher variables of ours) and read the step times it wrote to
    ``out``; exit with its stderr if it failed."""
    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full.pop(name, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    times: list[float] = json.loads(out.read_text())
    return times


def machine() -> str:
    """CPU count and load, so timings can be read against what else was running."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs, load average {load} (1/5/15 min)"


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
    """Pipelines grouped by shape: ``3x[A100-40:26] m=5`` (GPU type:layers per stage;
    ``V100-16/tp2:3`` for a stage at TP 2)."""
    shapes: Counter[str] = Counter()
    for p in pipelines:
        stages = "|".join(
            f"{s.gpu_type}{f'/tp{s.tensor_parallel}' if s.tensor_parallel > 1 else ''}:"
            f"{s.num_layers}"
            for s in p.stages
        )
        shapes[f"[{stages}] m={p.num_microbatches}"] += 1
    return " ".join(f"{k}x{shape}" for shape, k in shapes.items())


def fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"
