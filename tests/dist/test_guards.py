"""The step loop's guards on real workers: an id outside the vocabulary stops a
TP-2 run at the batch that holds it (the vocab-parallel embedding would mask it and
train on zeros), and a loss that stays non-finite stops a run with exit 1 instead
of training on to "finished"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from realdata import byte_tokens
from test_runtime_exact import ROOT, _env, _free_port, make_plan

from autohet_cli.plan import write_plan

pytestmark = pytest.mark.dist

TIMEOUT_S = 180


def _train(plan_name: str, tmp: Path, tp: int, *extra: str) -> subprocess.CompletedProcess[str]:
    plan = make_plan(plan_name, [(2, [(0, 6)])], tp=tp)
    _, path = write_plan(plan, tmp)
    cmd = [
        sys.executable,
        *("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"),
        *("-m", "autohet_cli.runtime.train", "--plan", str(path), "--device", "cpu"),
        *("--seed", "7", "--metrics", str(tmp / "metrics.jsonl"), "--checkpoint-every", "0"),
        *("--no-emergency-save",),
        *extra,
    ]
    return subprocess.run(
        cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def run_alone(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``cmd``, one worker started as torchrun would start the only rank of a world."""
    env = _env() | {
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
    }  # fmt: skip
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
        check=False, **kwargs,
    )  # fmt: skip


def _losses(tmp: Path) -> list[float]:
    import json

    path = tmp / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x)["loss"] for x in path.read_text().splitlines() if '"loss"' in x]


def _sampled_file(path: Path) -> None:
    """A token file just over the size start-up samples instead of scanning, valid
    (real bytes) in exactly the chunks it samples and id 60000 everywhere else."""
    from autohet_cli.dataset import vocab

    n = vocab.FULL_SCAN_MAX_TOKENS + 1_000_000
    tokens = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(n,))
    tokens[:] = 60_000
    real = np.load(byte_tokens())
    last = n - vocab.SAMPLE_CHUNK_TOKENS
    for start in sorted({int(s) for s in np.linspace(0, last, vocab.SAMPLE_CHUNKS)}):
        chunk = tokens[start : start + vocab.SAMPLE_CHUNK_TOKENS]
        chunk[:] = np.resize(real, chunk.shape)
    tokens.flush()
    del tokens


def test_an_id_outside_the_vocabulary_stops_a_tp_run_at_its_batch(tmp_path: Path) -> None:
    data = tmp_path / "tokens.npy"
    _sampled_file(data)
    proc = _train("oov", tmp_path, 2, "--data", str(data), "--steps", "20")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert "outside the model's vocabulary" in text, text[-3000:]
    assert "token id 60000" in text
    assert "IndexError" not in text
    assert _losses(tmp_path) == []  # not one step trained on it


def test_a_loss_that_stays_non_finite_stops_the_run(tmp_path: Path) -> None:
    # A learning rate no model survives: the weights overflow after the first step.
    proc = _train(
        "nan",
        tmp_path,
        1,
        "--data",
        str(byte_tokens()),
        "--steps",
        "30",
        "--lr",
        "1e38",
        "--grad-clip",
        "0",
        "--lr-schedule",
        "constant",
        "--max-nonfinite-steps",
        "2",
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert "were not finite (--max-nonfinite-steps 2)" in text, text[-3000:]
    losses = _losses(tmp_path)
    assert len(losses) < 30


def test_a_disk_that_refuses_every_save_is_named_and_training_goes_on(tmp_path: Path) -> None:
    """Issue 29: a full disk killed the run at its first save with "workers failed" and
    torch's "unexpected pos 704 vs 598". Here every file over 64 KB is refused
    (RLIMIT_FSIZE, as a quota would): the periodic saves fail with their cause and
    training goes on to the end; the last save fails too, so the run exits 1 saying so."""
    import resource

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    plan = make_plan("full", [(2, [(0, 6)])])
    _, path = write_plan(plan, tmp_path)
    cmd = [
        sys.executable,
        *("-m", "autohet_cli.runtime.train", "--plan", str(path), "--device", "cpu"),
        *("--seed", "7", "--metrics", str(tmp_path / "metrics.jsonl"), "--steps", "6"),
        *("--data", str(byte_tokens()), "--checkpoint-every", "2"),
        *("--checkpoint-dir", str(tmp_path / "ckpt"), "--remote-storage", "none"),
    ]
    proc = run_alone(cmd, preexec_fn=small_files)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    assert "warning: step 2 was not saved: " in err and "File too large" in err, err[-3000:]
    assert "warning: step 4 was not saved" in err and "training goes on" in err
    assert "error: step 6 was not saved" in err
    assert len(_losses(tmp_path)) == 6  # every step trained
    # Nothing half-written stays; with no step saved at all, not even the job.
    assert not (tmp_path / "ckpt" / "full" / "default").exists()
    assert "Traceback" not in err
