"""benchmarks/gpu_throughput's harness end to end (its FLOP count and model config are
tests/unit/test_gpu_throughput_bench.py).

No GPU here, so the harness runs in its CPU smoke mode (a tiny llama): the planner's
plan, the runtime and both HF trainers in their own processes, and the table.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.cli import run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow("three trainers (ours, HF eager, HF compiled) each start and train")
@pytest.mark.timeout(600)
def test_the_harness_runs_all_three_trainers_in_smoke_mode() -> None:
    env = dict(os.environ, AUTOHET_BENCH_GPU_SMOKE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = run(
        [sys.executable, "-m", "benchmarks", "gpu_throughput"], cwd=ROOT, env=env, timeout=580
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for trainer in ("autohet", "hf eager", "hf compile"):  # micro-batch, tokens/s, MFU, memory
        row = next((line for line in lines if re.match(rf"{trainer}\s+\d+ x \d+ ", line)), "")
        assert re.search(r"[\d,]+\s+[\d.]+%\s+[\d.]+ GiB$", row), proc.stdout
    assert "autohet / HF+compile tokens/s:" in proc.stdout
    assert "analytic memory, tensors" in proc.stdout and "vs reserved" in proc.stdout
