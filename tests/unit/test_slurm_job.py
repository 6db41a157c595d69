"""SlurmJob's stop request (the first Ctrl-C), with Slurm's commands faked: a running
job's steps get SIGTERM through ``scancel --signal=TERM`` (the notice that saves the
step; tests/e2e/test_slurm.py runs it on a real Slurm), a queued one is cancelled at
once, since nothing runs there to save."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autohet_cli.launch.specs import LaunchSpec
from autohet_cli.slurm import ctl
from autohet_cli.slurm.job import SlurmJob


def _job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: str
) -> tuple[SlurmJob, list[list[str]]]:
    calls: list[list[str]] = []

    def run(argv: Any, **_kw: Any) -> str:
        calls.append(list(argv))
        return ""

    spec = LaunchSpec(
        host="sn1", address="127.0.0.2", node_rank=0, nproc_per_node=1, gpus=(0,), argv=()
    )
    pool: Any = None  # never used: the nodes are reached through Slurm only
    job = SlurmJob([spec], pool, tmp_path / "p.yaml", tmp_path)
    job.job_id = "7"
    monkeypatch.setattr(
        ctl,
        "job_state",
        lambda _id: ctl.JobState(components={"7": state}, reasons={"7": "None"}, nodes={}),
    )
    monkeypatch.setattr(ctl, "node_states", lambda _nodes: {})
    monkeypatch.setattr(ctl, "run", run)
    return job, calls


def test_the_first_stop_signals_a_running_job_s_steps_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, calls = _job(tmp_path, monkeypatch, "RUNNING")
    job.notify_all()
    assert calls == [["scancel", "--signal=TERM", "7"]]  # no --full/-b: not the batch shell
    assert not job.kill_requested.is_set()


def test_the_first_stop_cancels_a_queued_job_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, calls = _job(tmp_path, monkeypatch, "PENDING")
    job.notify_all()
    assert calls == [] and job.kill_requested.is_set()  # the watch then scancels it
