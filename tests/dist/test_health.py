"""A worker killed mid-run: every other worker exits within 60 s, naming the lost rank.

Four workers of a 2 x 2 pipeline plan are started the way one torchrun agent per
host starts them (RANK, MASTER_ADDR, ... set per process, no agent that would stop
the survivors for us). Once training runs, rank 2 (pipeline 1, stage 0) gets
SIGKILL. Sharing one run directory, the survivors see its heartbeat's process
gone; with one run directory each (workers on different hosts), they see its
beats stop in the rendezvous store.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_runtime_exact import ROOT, _env, _free_port, make_plan

from autohet_cli.plan import write_plan

pytestmark = pytest.mark.dist

VICTIM = 2
EXIT_WITHIN_S = 60
LOST = f"lost contact with rank {VICTIM} (host localhost, pipeline 1 stage 0) at step "


def _start(plan_path: Path, run_dirs: list[Path]) -> list[subprocess.Popen[str]]:
    port = str(_free_port())
    procs = []
    for rank, run_dir in enumerate(run_dirs):
        env = _env() | {
            "RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        cmd = [
            *(sys.executable, "-m", "autohet_cli.runtime.train", "--plan", str(plan_path)),
            *("--steps", "100000", "--device", "cpu", "--run-dir", str(run_dir)),
            *("--heartbeat-interval", "1", "--collective-timeout", "30"),
        ]
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        )
    return procs


def _wait_for_steps(metrics: Path, procs: list[subprocess.Popen[str]], steps: int) -> None:
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
        assert all(p.poll() is None for p in procs), "a worker ended before the kill"
        assert time.monotonic() < deadline, "training did not start within 120 s"
        time.sleep(0.2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("hosts", ["one-run-dir", "run-dir-per-worker"])
@pytest.mark.slow("two ranks under torchrun, one killed: the survivor's exit is waited for")
def test_killed_worker_makes_the_others_exit_naming_it(hosts: str, tmp_path: Path) -> None:
    _, path = write_plan(
        make_plan("health", [(3, [(0, 3), (3, 6)]), (5, [(0, 2), (2, 6)])]), tmp_path
    )
    shared = hosts == "one-run-dir"
    run_dirs = [tmp_path / ("run" if shared else f"run{r}") for r in range(4)]
    procs = _start(path, run_dirs)
    try:
        _wait_for_steps(run_dirs[0] / "metrics.jsonl", procs, 3)
        beat = json.loads((run_dirs[VICTIM] / "heartbeat" / f"rank{VICTIM}").read_text())
        assert beat["pid"] == procs[VICTIM].pid and beat["state"] == "running"
        assert (beat["pipeline"], beat["stage"], beat["host"]) == (1, 0, "localhost")
        procs[VICTIM].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        stderr = {}
        for rank, p in enumerate(procs):
            if rank != VICTIM:
                left = killed + EXIT_WITHIN_S - time.monotonic()
                _, stderr[rank] = p.communicate(timeout=max(left, 0.1))
        took = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert took < EXIT_WITHIN_S
    print(f"survivors exited {took:.1f} s after the kill")
    for rank, err in stderr.items():
        assert procs[rank].returncode != 0, f"rank {rank} exited 0:\n{err[-2000:]}"
        state = json.loads((run_dirs[rank] / "heartbeat" / f"rank{rank}").read_text())["state"]
        assert state == "failed", rank
    for rank, err in stderr.items():  # nobody blames a survivor
        blamed = set(re.findall(r"lost contact with rank (\d+)", err))
        assert blamed <= {str(VICTIM)}, f"rank {rank} blames {blamed}:\n{err[-1500:]}"
    named = [r for r, err in stderr.items() if f"autohet runtime: error: {LOST}" in err]
    assert named, "no survivor named the lost rank:\n" + "\n".join(
        err[-1500:] for err in stderr.values()
    )
