"""Stopping after a verdict: a broken job has nothing to save, so what is left is killed at
once (no TERM and grace); a stop on request still asks with TERM first and waits."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

from autohet_cli.cluster import Cluster, Host
from autohet_cli.launch.executor import Job
from autohet_cli.launch.specs import LaunchSpec
from autohet_cli.transport.pool import ConnectOptions, HostPool
from tests.planting import cpu_host

# Ignores TERM (as a worker waiting to save a step that cannot end would).
STUBBORN = "trap '' TERM; while :; do sleep 0.1; done"


def _host(name: str, tmp: Path) -> Host:
    return cpu_host(name, workdir=str(tmp / name))


def _spec(tmp: Path, name: str, rank: int, script: str, tag: str) -> LaunchSpec:
    run = tmp / name / "runs" / "r1"
    return LaunchSpec(
        host=name,
        address="localhost",
        node_rank=rank,
        nproc_per_node=1,
        gpus=(0,),
        argv=("sh", "-c", script, tag),
        workdir=str(tmp / name),
        plan_path=str(run / "plan.yaml"),
        run_dir=str(run),
        pid_file=str(run / "torchrun.pid"),
        ranks=(rank,),
    )


def _alive(tag: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if tag in ln and "ps -eo" not in ln]


def _job(tmp: Path, scripts: dict[str, str], tag: str) -> tuple[Job, HostPool]:
    cluster = Cluster(name="c", hosts=tuple(_host(n, tmp) for n in scripts), inter_node_gbps=10.0)
    pool = HostPool(cluster, ConnectOptions())
    plan = tmp / "plan.yaml"
    plan.write_text("plan\n")
    specs = [_spec(tmp, n, i, s, tag) for i, (n, s) in enumerate(scripts.items())]
    job = Job(specs, pool, plan, tmp / "local", printer=lambda _: None, start_timeout_s=None)
    return job, pool


def test_after_a_verdict_the_others_are_killed_at_once(tmp_path: Path) -> None:
    tag = f"stubborn-{uuid.uuid4().hex[:8]}"
    job, pool = _job(tmp_path, {"a": "sleep 0.3; exit 3", "b": STUBBORN}, tag)
    job.settle_s = 0.0  # judge at once: only the stop is timed here
    with pool:
        job.start()
        started = time.monotonic()
        outcome = job.watch()
        took = time.monotonic() - started
        job.stop_all()
        job.close()
    assert outcome.status == "failed" and outcome.failed_hosts == ["a"], outcome
    # Before: TERM, then 2 s of grace for a save that cannot come, then KILL.
    assert took < 1.8, took
    assert _alive(tag) == []


def test_a_stop_on_request_still_asks_with_term_first(tmp_path: Path) -> None:
    tag = f"polite-{uuid.uuid4().hex[:8]}"
    said = tmp_path / "got-term"
    polite = f"trap 'touch {said}; exit 0' TERM; while :; do sleep 0.1; done"
    job, pool = _job(tmp_path, {"a": polite}, tag)
    with pool:
        job.start()
        time.sleep(0.3)  # the shell has set its trap
        job.stop_all(grace_s=5.0)
        job.close()
    assert said.exists()
    assert _alive(tag) == []
