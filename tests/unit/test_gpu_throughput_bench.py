"""benchmarks/gpu_throughput: its FLOP count, its model config, and its harness end to end.

No GPU here, so the harness runs in its CPU smoke mode (a tiny llama): the planner's
plan, the runtime and both HF trainers in their own processes, and the table.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autohet_cli.hfconfig import load_hf_config
from autohet_cli.models import ModelSpec
from benchmarks.gpu_throughput import BIG, flops_per_token, hf_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_model_is_the_issues_1_2b_llama(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    import json

    path.write_text(json.dumps(hf_config(BIG)))
    spec: ModelSpec = load_hf_config(path)
    assert spec.num_params == pytest.approx(1.236e9, rel=0.01)
    assert spec.tied_embeddings and spec.padded_vocab_size == 128256
    # 6N + 12 L h s: what the issue's MFU column counts
    n = spec.num_params
    assert flops_per_token(BIG) == pytest.approx(6 * n + 12 * 16 * 2048 * 2048, rel=1e-3)


@pytest.mark.timeout(600)
def test_the_harness_runs_all_three_trainers_in_smoke_mode() -> None:
    env = dict(os.environ, AUTOHET_BENCH_GPU_SMOKE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "gpu_throughput"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for trainer in ("autohet", "hf eager", "hf compile"):  # micro-batch, tokens/s, MFU, memory
        row = next((line for line in lines if re.match(rf"{trainer}\s+\d+ x \d+ ", line)), "")
        assert re.search(r"[\d,]+\s+[\d.]+%\s+[\d.]+ GiB$", row), proc.stdout
    assert "autohet / HF+compile tokens/s:" in proc.stdout
    assert "analytic memory, tensors" in proc.stdout and "vs reserved" in proc.stdout
