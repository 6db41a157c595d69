"""The recover lock lives on the hosts, per plan and job (issue 29, high 5).

Two controllers are two ``HostPool``s (as two ``autohet recover`` runs from two
plans directories would have) over the same hosts; the hosts are local runners.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autohet_cli.cluster import Cluster
from autohet_cli.errors import AutohetError
from autohet_cli.recovery.errors import RecoverLockHeld
from autohet_cli.recovery.hostlock import (
    BREAK_AFTER_S,
    LOCK_FILE,
    HostLock,
    holder_state,
    machine_id,
    this_process,
)
from autohet_cli.transport.pool import ConnectOptions, HostPool
from tests.cli import ROOT
from tests.planting import cpu_host

NS = "lab/20260101T000000Z-abcd"


def _pool(tmp: Path) -> HostPool:
    hosts = tuple(cpu_host(name, checkpoint_dir=str(tmp / name)) for name in ("a", "b"))
    return HostPool(Cluster(name="c", hosts=hosts, inter_node_gbps=10.0), ConnectOptions())


def _lock(tmp: Path, host: str, ns: str = NS) -> Path:
    return tmp / host / ns / LOCK_FILE


def _plant(tmp: Path, host: str, text: str, *, age_s: float = 0.0) -> None:
    path = _lock(tmp, host)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_a_second_recover_of_the_same_job_stops_naming_the_first(tmp_path: Path) -> None:
    said: list[str] = []
    with _pool(tmp_path) as one, _pool(tmp_path) as two:
        with HostLock(one, NS, say=said.append) as first:
            first.take(["a", "b"])
            mine = _lock(tmp_path, "a").read_text()
            second = HostLock(two, NS, say=said.append)
            with pytest.raises(RecoverLockHeld) as info:
                second.take(["a", "b"])
            message = str(info.value)
            assert f"another autohet recover of job {NS} holds its lock on a" in message
            assert f"pid {os.getpid()} on {socket.gethostname()}" in message
            assert "still running" in message and str(_lock(tmp_path, "a")) in message
            assert second.held == ()  # it took nothing, and removed nothing of ours
            assert _lock(tmp_path, "a").read_text() == mine == _lock(tmp_path, "b").read_text()
            # --break-lock never breaks a holder that is alive on this machine
            forced = HostLock(two, NS, break_lock=True, say=said.append)
            with pytest.raises(RecoverLockHeld, match="still running"):
                forced.take(["b", "a"])
            with HostLock(two, "lab/other-job", say=said.append) as other:
                other.take(["a", "b"])  # another job is not blocked
        assert not _lock(tmp_path, "a").exists() and not _lock(tmp_path, "b").exists()
        with HostLock(two, NS, say=said.append) as again:  # given back: free now
            again.take(["a", "b"])
    assert said == []


def test_a_refusal_on_a_later_host_gives_back_the_first_and_errors_give_back_all(
    tmp_path: Path,
) -> None:
    elsewhere = dataclasses.replace(this_process(NS), machine="ctl-2", machine_id="other 1")
    _plant(tmp_path, "b", elsewhere.to_text())
    with _pool(tmp_path) as pool:
        with pytest.raises(RecoverLockHeld, match=r"on b .* pid \d+ on ctl-2 .*--break-lock"):
            HostLock(pool, NS, say=print).take(["a", "b"])
        assert not _lock(tmp_path, "a").exists()
        _lock(tmp_path, "b").unlink()
        with pytest.raises(ValueError, match="boom"):
            with HostLock(pool, NS, say=print) as lock:
                lock.take(["a", "b"])
                raise ValueError("boom")
    assert not _lock(tmp_path, "a").exists() and not _lock(tmp_path, "b").exists()


def test_a_holder_on_another_machine_is_broken_only_with_break_lock_once_old(
    tmp_path: Path,
) -> None:
    elsewhere = dataclasses.replace(this_process(NS), machine="ctl-2", machine_id="other 1")
    said: list[str] = []
    with _pool(tmp_path) as pool:
        _plant(tmp_path, "a", elsewhere.to_text(), age_s=30)
        with pytest.raises(RecoverLockHeld, match="cannot be checked .* --break-lock"):
            HostLock(pool, NS, say=said.append).take(["a"])
        with pytest.raises(RecoverLockHeld, match=r"taken 3\d s ago: --break-lock breaks only"):
            HostLock(pool, NS, break_lock=True, say=said.append).take(["a"])
        assert said == [] and elsewhere.token in _lock(tmp_path, "a").read_text()
        _plant(tmp_path, "a", elsewhere.to_text(), age_s=BREAK_AFTER_S + 60)
        with HostLock(pool, NS, break_lock=True, say=said.append) as lock:
            lock.take(["a"])
            assert elsewhere.token not in _lock(tmp_path, "a").read_text()
        _plant(tmp_path, "a", "garbage {")
        with pytest.raises(RecoverLockHeld, match="unreadable record 'garbage {'"):
            HostLock(pool, NS, say=said.append).take(["a"])
    assert len(said) == 1 and "breaking the recover lock of autohet recover pid" in said[0]
    assert "on ctl-2" in said[0] and "(--break-lock)" in said[0]


def test_a_killed_holder_on_this_machine_is_seen_dead_and_its_lock_broken(
    tmp_path: Path,
) -> None:
    code = (
        "import sys, time; from pathlib import Path\n"
        "from tests.unit.test_recovery_hostlock import NS, _pool\n"
        "from autohet_cli.recovery.hostlock import HostLock\n"
        f"with _pool(Path({str(tmp_path)!r})) as pool, HostLock(pool, NS, say=print) as lock:\n"
        "    lock.take(['a', 'b'])\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    said: list[str] = []
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with _pool(tmp_path) as pool:
            with pytest.raises(RecoverLockHeld, match=f"pid {holder.pid} .*still running"):
                HostLock(pool, NS, say=said.append).take(["a", "b"])
            holder.kill()  # SIGKILL: no finally runs, the locks stay behind
            holder.wait()
            assert _lock(tmp_path, "a").exists() and _lock(tmp_path, "b").exists()
            with HostLock(pool, NS, say=said.append) as lock:
                lock.take(["a", "b"])
    finally:
        holder.kill()
        holder.wait()
    assert len(said) == 2 and all(f"pid {holder.pid}" in s for s in said)
    assert all(s.endswith("(no longer running)") for s in said)


def test_a_reused_pid_is_not_the_holder() -> None:
    me = this_process(NS)
    assert holder_state(me, machine_id()) == "alive"
    assert holder_state(dataclasses.replace(me, pid_start="1"), machine_id()) == "dead"
    assert holder_state(dataclasses.replace(me, machine_id="x"), machine_id()) == "unknown"
    assert holder_state(None, machine_id()) == "unknown"


def test_a_lock_that_cannot_be_written_names_the_host_and_the_cause(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("a file where the checkpoint directory should be")
    with _pool(tmp_path) as pool:
        with pytest.raises(AutohetError, match=r"^a: cannot take the recover lock .*: .+"):
            HostLock(pool, NS, say=print).take(["a"])
