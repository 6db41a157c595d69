"""A real spot shutdown: SIGTERM to every process of a host at once (torchrun's agent and
its workers, in any order, repeated), through real sshd hosts and real torchrun trees.

One notice: every rank agrees on a step, saves it, exits 0; launch says ``preempted``;
``--auto-recover`` resumes from exactly that step on the survivors, and with no
survivor the hint is a ``--resume`` of the same run, which continues exactly."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autohet_cli.ckpt.notice import LAST_SAVE_FILE
from autohet_cli.plan import write_plan
from autohet_cli.runtime.agent import child_pids
from tests.cli import start_autohet
from tests.e2e.sshd import SshdFarm
from tests.e2e.test_launch import ROOT, _cluster_file, _launch, _plan, _workers_alive, free_port
from tests.e2e.test_recover import _losses, _reference
from tests.e2e.test_slurm import _rest
from tests.planting import plan_of, stage

pytestmark = pytest.mark.e2e
STEPS = 40  # far beyond the notice: the run stops at the notice's step


def _host_pids(root: Path) -> list[int]:
    """Every live process of one fake host: command lines that point into its workdir
    (the torchrun agent and its workers; sshd's own processes do not)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,stat=,args="], capture_output=True, text=True)
    pids = []
    for line in out.stdout.splitlines():
        pid, stat, args = line.split(None, 2)
        if str(root / "work") in args and not stat.startswith("Z") and "ps -ww" not in args:
            pids.append(int(pid))
    return pids


def _shutdown(roots: list[Path], rng: random.Random) -> int:
    """What a VM's shutdown does to each host: SIGTERM to all of its processes at
    once, in a shuffled order, then once more to all of them 0.3 s later."""
    pids = [p for r in roots for p in _host_pids(r)]
    assert len(pids) >= 2 * len(roots), pids  # an agent and at least one worker per host
    _terminate_twice(pids, rng)
    return len(pids)


def _terminate_twice(pids: list[int], rng: random.Random) -> None:
    """SIGTERM to all of ``pids`` in a shuffled order, then again 0.3 s later."""
    for _ in range(2):
        rng.shuffle(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(0.3)


def _run_until_step(proc: subprocess.Popen[str], step: int) -> list[str]:
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if f"step {step} " in line:
            return seen
    raise AssertionError("".join(seen)[-4000:])


def _shut_down_mid_run(
    farm: SshdFarm, tmp: Path, hosts: list[str], seed: int, *extra: str
) -> tuple[str, int, int | None]:
    """Launch on three sshd hosts (a remote copy for shards no survivor holds, or that a
    rank of another host reads), shut ``hosts`` down after step 2; (output, saved step,
    launch's exit code)."""
    farm.start(3)
    cluster = _cluster_file(farm, tmp / "cluster.yaml", str(tmp / "remote"))
    proc = _launch(
        _plan(tmp, cluster),
        tmp,
        *("--steps", str(STEPS), "--train-arg=--lr=0.003", "--train-arg=--lr-schedule=constant"),
        *extra,
    )
    seen = _run_until_step(proc, 2)
    _shutdown([h.root for h in farm.hosts if h.name in hosts], random.Random(seed))
    out = "".join(seen) + _rest(proc, 600)
    assert "SignalException" not in out, out[-4000:]
    saved = re.search(r"emergency checkpoint: step (\d+) saved on every rank", out)
    assert saved, out[-4000:]
    assert re.search(r"COMPLETE \d+\.\d s after the notice", out), out[-4000:]
    return out, int(saved.group(1)), proc.returncode


@pytest.mark.slow("a 3-host launch, one host's shutdown, then the auto-recovered run")
def test_a_shutdown_of_one_host_saves_the_step_and_auto_recovery_continues_it(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    out, step, code = _shut_down_mid_run(
        sshd_farm,
        tmp_path,
        ["fake-4"],
        1,
        *("--checkpoint-every", "0", "--auto-recover"),  # the notice saves anyway
    )
    assert code == 0, out[-6000:]  # the recovered run finished
    first, _, after = out.partition("auto-recover: autohet recover")
    assert "--lost fake-4" in after.splitlines()[0], out[-6000:]
    assert "host preempting: fake-4 (SIGTERM)" in first, first[-4000:]
    assert "preempted: host preempting" in first
    before, resumed = _losses(first), _losses(after)
    assert max(before) == step - 1  # the last printed step is in the checkpoint
    assert min(resumed) == step and f"at step {step}" in after
    ref = _reference(tmp_path, STEPS)
    for s, loss in {**before, **resumed}.items():
        assert loss == pytest.approx(ref[s], abs=1e-4), (s, loss, ref[s])
    assert not _workers_alive(sshd_farm)


@pytest.mark.slow("a 3-host launch, every host's shutdown, then the printed resume")
def test_a_shutdown_of_every_host_saves_the_step_and_the_hint_resumes_it(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    out, step, code = _shut_down_mid_run(
        sshd_farm, tmp_path, ["fake-2", "fake-3", "fake-4"], 2, "--checkpoint-every", "1000"
    )
    assert code == 3, out[-6000:]  # preempted
    assert "preempted: host preempting" in out, out[-4000:]
    assert max(_losses(out)) == step - 1
    (rank0,) = (sshd_farm.hosts[0].checkpoint_dir / "e2e").glob(f"*/step-{step:08d}")
    partners = set(json.loads((rank0 / "manifest.json").read_text())["replicas"]["fake-2"])
    for h in sshd_farm.hosts:  # every host's shards; COMPLETE on rank 0's (fake-2) and
        # possibly on its partner (the replicas of an emergency save race the shutdown)
        (d,) = (h.checkpoint_dir / "e2e").glob(f"*/step-{step:08d}")
        assert list(d.glob("*.distcp"))
        if h.name == "fake-2":
            assert (d / "COMPLETE").is_file()
        elif h.name not in partners:
            assert not (d / "COMPLETE").exists()
        assert float((d.parent / LAST_SAVE_FILE).read_text()) > 0  # for the next launch
    assert "to continue on the survivors" not in out  # nobody survives: no recover hint
    hint = re.search(r"no host of the plan survives .*?; to resume the job once .*?: (.*)", out)
    assert hint, out[-3000:]
    assert "launch" in hint.group(1) and "--resume" in hint.group(1)
    assert not _workers_alive(sshd_farm)
    # The hint's command, as printed, on the same hosts (back up), to step + 2.
    argv = hint.group(1).split()[1:]
    argv[argv.index("--steps") + 1] = str(step + 2)
    resumed = _launch(Path(argv[1]), tmp_path, *argv[2:], "--master-port", str(free_port()))
    again, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, again[-6000:]
    assert f"at step {step}" in again
    after = _losses(again)
    assert min(after) == step and max(after) == step + 1
    ref = _reference(tmp_path, step + 2)
    for s, loss in {**_losses(out), **after}.items():
        assert loss == pytest.approx(ref[s], abs=1e-4), (s, loss, ref[s])


def test_the_agent_is_torchrun_with_a_sigterm_that_waits(tmp_path: Path) -> None:
    """Without sshd: the agent parses torchrun's own flags (--help is torchrun's)."""
    res = subprocess.run(
        [sys.executable, "-m", "autohet_cli.runtime.agent", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and "--nproc-per-node" in res.stdout


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (the launcher, its torchrun agent, the workers)."""
    out = [pid]
    for kid in child_pids(pid):
        out += _tree(kid)
    return out


def test_a_shutdown_of_the_machine_running_launcher_and_workers_is_a_preemption(
    tmp_path: Path,
) -> None:
    """The embedded localhost cluster: the shutdown signals the launcher too. It is a
    preemption (exit 3, the step saved), and the printed --resume continues it."""
    stages = [stage(0, 3, "localhost", 0), stage(3, 6, "localhost", 1)]
    plan = plan_of(stages, microbatches=4, precision="fp32", name="local", version=0)
    _, path = write_plan(plan, tmp_path / "plans")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    proc = start_autohet(
        *("launch", str(path), "--steps", str(STEPS), "--checkpoint-every", "0"),
        *("--master-port", str(free_port())),
        cwd=tmp_path,
        env=env,
    )
    seen = _run_until_step(proc, 2)
    pids = _tree(proc.pid)
    assert len(pids) >= 4, pids  # launcher, agent, two workers
    _terminate_twice(pids, random.Random(3))
    out = "".join(seen) + _rest(proc, 300)
    assert proc.returncode == 3, out[-5000:]
    assert "preempted: host preempting (localhost: SIGTERM)" in out, out[-3000:]
    saved = re.search(r"emergency checkpoint: step (\d+) saved on every rank", out)
    assert saved, out[-3000:]
    step = int(saved.group(1))
    assert max(_losses(out)) == step - 1
    hint = re.search(r"no host of the plan survives .*?; to resume the job once .*?: (.*)", out)
    assert hint and "to continue on the survivors" not in out, out[-3000:]
    argv = hint.group(1).split()[1:]
    argv[argv.index("--steps") + 1] = str(step + 2)
    again = subprocess.run(
        [sys.executable, "-m", "autohet_cli", *argv, "--master-port", str(free_port())],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
    after = _losses(again.stdout)
    assert f"at step {step}" in again.stdout and min(after) == step, again.stdout[-3000:]
