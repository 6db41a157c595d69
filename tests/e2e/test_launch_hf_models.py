"""A HuggingFace ``config.json`` plans and launches through the CLI, and trains.

The tiny LLaMA (with LLaMA-3.1 rope scaling), Qwen2 (q/k/v biases, tied head) and
Mistral configs shipped under ``profiles/models/`` are planned for a localhost
cluster of two CPU devices (``autohet plan --model .../config.json``) and run
with ``autohet launch PLAN --steps 20``: the plan file alone tells the workers
what to build. Localhost needs no sshd; workers are real torchrun processes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.cli import autohet

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


def _autohet(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # HOME: the localhost workdir (~/autohet) lands in the test's folder.
    return autohet(*args, cwd=cwd, timeout=240, env={"HOME": str(cwd), "OMP_NUM_THREADS": "1"})


def _cluster(tmp: Path) -> Path:
    path = tmp / "localhost.yaml"
    path.write_text(
        "schema: autohet.cluster/v1\nname: localhost\n"
        f"remote_storage: {tmp / 'remote'}\n"
        "hosts:\n"
        "  - {name: localhost, address: localhost, gpus: {type: cpu, count: 2}, "
        f"checkpoint_dir: {tmp / 'ckpt'}}}\n"
    )
    return path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_hf_config_plans_and_launches_with_the_loss_falling(model: str, tmp_path: Path) -> None:
    config = ROOT / "profiles" / "models" / model / "config.json"
    planned = _autohet(
        *("plan", "--cluster", str(_cluster(tmp_path)), "--model", str(config)),
        *("--global-batch-size", "8", "--precision", "fp32", "--seq-len", "64"),
        *("--time-limit", "5", "--json", "--out-dir", "plans"),
        cwd=tmp_path,
    )
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)["plan_path"]
    run = _autohet(
        *("launch", plan, "--steps", str(STEPS), "--train-arg=--lr=3e-3", "--json"),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    metrics = sorted((tmp_path / "autohet" / "runs").glob("*/*/metrics.jsonl"))
    assert len(metrics) == 1, list((tmp_path / "autohet").rglob("*"))
    lines = map(json.loads, metrics[0].read_text().splitlines())
    losses = [m["loss"] for m in lines if "loss" in m]  # not the save records
    assert len(losses) == STEPS
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.05, losses
