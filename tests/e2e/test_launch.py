"""`autohet launch` across real sshd "hosts" on loopback with real torchrun workers."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from autohet_cli.plan import Stage, write_plan
from autohet_cli.yamlio import sha256_file
from tests.cli import read_until, start_autohet
from tests.e2e.sshd import SshdFarm
from tests.planting import plan_of, stage

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _cluster_file(
    farm: SshdFarm,
    path: Path,
    remote_storage: str | None = None,
    gpus: dict[str, int] | None = None,
    checks: dict[str, dict[str, object]] | None = None,
) -> Path:
    """``gpus``: CPU "GPUs" per host name where not 1; ``checks``: preemption checks."""
    hosts = []
    for h in farm.hosts:
        hosts.append(h.cluster_entry((gpus or {}).get(h.name, 1)))
        if checks and h.name in checks:
            hosts[-1]["preemption_check"] = checks[h.name]
    doc = {
        "schema": "autohet.cluster/v1",
        "name": "fake",
        "network": {"inter_node_gbps": 10},
        "hosts": hosts,
    }
    if remote_storage:
        doc["remote_storage"] = remote_storage
    path.write_text(yaml.safe_dump(doc))
    return path


# (micro-batches, ((layer start, layer end, host[, tp]), ...)) per pipeline.
Layout = tuple[tuple[int, tuple[tuple[int, int, str] | tuple[int, int, str, int], ...]], ...]
# Two asymmetric pipelines over three hosts: 2 stages (uneven split) and 1 stage.
THREE_HOSTS: Layout = ((5, ((0, 2, "fake-2"), (2, 6, "fake-3"))), (3, ((0, 6, "fake-4"),)))


def _plan(tmp: Path, cluster: Path, layout: Layout = THREE_HOSTS) -> Path:
    """A gpt-tiny plan of ``layout`` on CPU devices (a stage of TP t takes the next t
    of its host), made for ``cluster``."""
    used: dict[str, int] = {}

    def st(a: int, b: int, host: str, tp: int = 1) -> Stage:
        first = used.get(host, 0)
        used[host] = first + tp
        return stage(a, b, host, *range(first, first + tp))

    plan = plan_of(
        *([st(*s) for s in stages] for _, stages in layout),
        microbatches=[m for m, _ in layout],
        precision="fp32",
        name="e2e",
        version=0,
        inputs={"cluster": {"path": str(cluster), "sha256": sha256_file(cluster)}},
    )
    _, path = write_plan(plan, tmp / "plans")
    return path


def free_port() -> int:
    """A port free on the master's loopback address now (CI may run other jobs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        return int(s.getsockname()[1])


def _launch(plan: Path, cwd: Path, *extra: str) -> subprocess.Popen[str]:
    if "--master-port" not in extra:  # options go before a `--` user script
        extra = ("--master-port", str(free_port()), *extra)
    known_hosts = str(cwd / "sshd" / "known_hosts")
    return start_autohet("launch", str(plan), "--known-hosts", known_hosts, *extra, cwd=cwd)


def _workers_alive(farm: SshdFarm) -> list[str]:
    """Processes whose command line points into a fake host's workdir."""
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid,stat,args"], capture_output=True, text=True
    ).stdout
    roots = [str(h.root / "work") for h in farm.hosts]
    return [
        ln
        for ln in out.splitlines()
        if any(r in ln for r in roots) and " Z" not in ln and "ps -eo" not in ln
    ]


def _workers_gone(farm: SshdFarm, within_s: float = 1.0, keep: str | None = None) -> list[str]:
    """What of the run is still alive ``within_s`` after it ended (a wait on the event,
    not a fixed sleep: usually nothing is left by the first look); ``keep``: lines with
    it are not the run's."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [ln for ln in _workers_alive(farm) if keep is None or keep not in ln]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@pytest.fixture
def farm3(sshd_farm: SshdFarm) -> SshdFarm:
    sshd_farm.start(3)
    return sshd_farm


def _trains_20_steps(plan: Path, cwd: Path) -> str:
    """Launch 20 steps of ``plan``: it ends well and its loss falls; its output."""
    proc = _launch(plan, cwd, "--steps", "20", "--train-arg=--lr=0.003")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    losses = [float(m.group(1)) for m in re.finditer(r"step \d+ loss ([0-9.]+)", out)]
    assert len(losses) >= 20
    # the synthetic corpus is learnable but gpt-tiny learns slowly: compare the ends
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.02, losses
    return out


def test_asymmetric_plan_trains_20_steps_over_three_hosts(farm3: SshdFarm, tmp_path: Path) -> None:
    plan = _plan(tmp_path, _cluster_file(farm3, tmp_path / "cluster.yaml"))
    out = _trains_20_steps(plan, tmp_path)
    for host in ("fake-2", "fake-3", "fake-4"):
        assert f"[{host}]" in out or host in out
    runs = list((tmp_path / "runs").glob("e2e.v1/*/events.json"))
    assert runs and json.loads(runs[0].read_text())["status"] == "finished"
    assert not _workers_alive(farm3)


# TP per stage over three hosts: TP 2 on fake-2's two devices feeding TP 1 on fake-3,
# beside a one-stage TP-1 pipeline on fake-4. Layers [0, 3) and the tied embedding
# and head are held at TP 2 and TP 1, so they sync through the full gradient.
MIXED_TP: Layout = ((5, ((0, 3, "fake-2", 2), (3, 6, "fake-3"))), (3, ((0, 6, "fake-4"),)))


@pytest.mark.slow("20 steps over three hosts, so the loss is seen to fall")
def test_mixed_tp_plan_trains_over_three_hosts(farm3: SshdFarm, tmp_path: Path) -> None:
    cluster = _cluster_file(farm3, tmp_path / "cluster.yaml", gpus={"fake-2": 2})
    _trains_20_steps(_plan(tmp_path, cluster, MIXED_TP), tmp_path)
    assert not _workers_alive(farm3)


@pytest.mark.slow("a 3-host launch stopped by Ctrl-C after its first step, which every rank saves")
def test_ctrl_c_leaves_no_process_on_any_host(farm3: SshdFarm, tmp_path: Path) -> None:
    plan = _plan(tmp_path, _cluster_file(farm3, tmp_path / "cluster.yaml"))
    proc = _launch(plan, tmp_path, "--steps", "100000")
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    for line in proc.stdout:
        if "step 1 " in line or time.monotonic() > deadline:
            break
    assert len(_workers_alive(farm3)) >= 3
    os.killpg(proc.pid, signal.SIGINT)  # the first Ctrl-C: save the step, then stop
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-4000:]
    saved = re.search(r"interrupted: stopped on request; every rank saved step (\d+)", out)
    assert saved, out[-4000:]
    assert not _workers_gone(farm3)


def test_a_second_ctrl_c_stops_at_once_without_waiting_for_a_save(
    farm3: SshdFarm, tmp_path: Path
) -> None:
    plan = _plan(tmp_path, _cluster_file(farm3, tmp_path / "cluster.yaml"))
    proc = _launch(plan, tmp_path, "--steps", "100000")
    assert proc.stdout is not None
    for line in proc.stdout:
        if "step 1 " in line:
            break
    # Rank 0's host frozen: no step can end, so no save can finish.
    fake2 = [int(ln.split()[0]) for ln in _workers_alive(farm3) if "host-2" in ln]
    for pid in fake2:
        os.kill(pid, signal.SIGSTOP)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(2)
    assert proc.poll() is None  # waiting for the save
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert time.monotonic() - started < 30, out[-3000:]
    assert proc.returncode == 130 and "interrupted: stopped on request" in out, out[-3000:]
    for pid in fake2:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert not _workers_gone(farm3)


def test_a_vanished_host_is_detected_and_survivors_stopped(farm3: SshdFarm, tmp_path: Path) -> None:
    cluster = _cluster_file(farm3, tmp_path / "cluster.yaml")
    plan = _plan(tmp_path, cluster)
    proc = _launch(plan, tmp_path, "--steps", "100000")
    seen = read_until(proc, "step 2 ", [])
    killed_at = time.monotonic()
    farm3.hosts[2].stop()  # fake-4: its sshd and every process under it
    rest, _ = proc.communicate(timeout=120)
    detected_s = time.monotonic() - killed_at
    out = "".join(seen) + rest
    assert detected_s < 30, out
    assert proc.returncode != 0
    assert "autohet recover" in out and "--lost fake-4" in out, out
    assert not _workers_gone(farm3)
    events = json.loads(next((tmp_path / "runs").glob("e2e.v1/*/events.json")).read_text())
    assert events["status"] == "host_lost" and events["lost_hosts"] == ["fake-4"], events


@pytest.mark.slow(
    "3-host launch, a host frozen until heartbeats go stale, then the auto-recovered run"
)
def test_frozen_workers_are_caught_by_heartbeat_and_auto_recovered(
    farm3: SshdFarm, tmp_path: Path
) -> None:
    """fake-4's workers stop (SIGSTOP) while its SSH stays up: only heartbeats tell."""
    cluster = _cluster_file(farm3, tmp_path / "cluster.yaml", remote_storage=str(tmp_path / "r"))
    plan = _plan(tmp_path, cluster)
    train = ("--train-arg=--checkpoint-every=3", "--train-arg=--collective-timeout=300")
    proc = _launch(plan, tmp_path, "--steps", "12", *train, "--auto-recover")
    seen = read_until(proc, "step 7 ", [])
    frozen = [
        ln.split()[0]
        for ln in _workers_alive(farm3)
        if str(farm3.hosts[2].root) in ln and "runtime.train" in ln
    ]
    assert frozen
    for pid in frozen:
        os.kill(int(pid), signal.SIGSTOP)
    frozen_at = time.monotonic()
    read_until(proc, "lost: fake-4: heartbeats stale", seen)
    detected_s = time.monotonic() - frozen_at
    rest, _ = proc.communicate(timeout=300)
    out = "".join(seen) + rest
    assert detected_s < 30, out
    assert "auto-recover: autohet recover" in out, out
    assert proc.returncode == 0, out  # the recovered run finished on the survivors
    assert re.search(r"step 11 loss", rest), rest
    for pid in frozen:  # killed by the launcher's process-group stop
        assert subprocess.run(
            ["ps", "-p", pid, "-o", "stat="], capture_output=True, text=True
        ).stdout.strip() in ("", "Z")


def test_user_script_synced_to_every_host_runs_under_torchrun(
    farm3: SshdFarm, tmp_path: Path
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "my_train.py").write_text(
        "import os, sys\n"
        "print('hello from', os.environ['AUTOHET_HOST'], 'rank', os.environ['RANK'],\n"
        "      'of', os.environ['WORLD_SIZE'], 'args', sys.argv[1:], flush=True)\n"
    )
    plan = _plan(tmp_path, _cluster_file(farm3, tmp_path / "cluster.yaml"))
    proc = _launch(plan, tmp_path, "--sync-dir", str(code), "--", "my_train.py", "--epochs", "3")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    for host in ("fake-2", "fake-3", "fake-4"):
        assert f"hello from {host}" in out, out
    assert out.count("of 3 args ['--epochs', '3']") == 3, out
    for h in farm3.hosts:
        assert (h.root / "work" / "my_train.py").exists()
