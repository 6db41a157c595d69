"""LocalRunner with real short-lived processes: streaming, exit codes, env, cwd,
timeouts that kill the whole process group, file copies, start() handles; and
fan_out / runner_for, which need no SSH."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from autohet_cli.cluster import Host
from autohet_cli.errors import CommandFailed, CommandTimeout, TransportError
from autohet_cli.transport import LocalRunner, RunResult, fan_out, runner_for
from tests.planting import cpu_host

PY = sys.executable


def _host(name: str, address: str = "localhost") -> Host:
    return cpu_host(name, address, gpu_mem_bytes=4 << 30)


def _alive(pid: int) -> bool:
    """True if pid runs (a zombie waiting for an absent reaper counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _wait_until(cond: object, timeout_s: float = 5.0) -> bool:
    assert callable(cond)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def test_lines_stream_in_arrival_order_across_streams() -> None:
    script = (
        "import sys, time\n"
        "print('one', flush=True); time.sleep(0.1)\n"
        "print('two', file=sys.stderr, flush=True); time.sleep(0.1)\n"
        "sys.stdout.write('three\\r\\nno newline at end'); sys.stdout.flush()\n"
    )
    seen: list[tuple[str, str]] = []
    result = LocalRunner().run([PY, "-c", script], on_line=lambda s, ln: seen.append((s, ln)))
    assert seen == [
        ("stdout", "one"),
        ("stderr", "two"),
        ("stdout", "three"),
        ("stdout", "no newline at end"),
    ]
    assert result.stdout == "one\nthree\nno newline at end\n"
    assert result.stderr == "two\n"
    assert result.exit_code == 0 and result.ok
    assert result.duration_s >= 0.2


def test_lines_arrive_while_the_process_still_runs(tmp_path: Path) -> None:
    """The child waits for a file that only our callback creates on its first line."""
    go = tmp_path / "go"
    script = (
        "import os, time\n"
        "print('ready', flush=True)\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "print('done', flush=True)\n"
    )

    def on_line(stream: str, line: str) -> None:
        if line == "ready":
            go.touch()

    result = LocalRunner().run([PY, "-c", script], on_line=on_line, timeout_s=20)
    assert result.stdout == "ready\ndone\n"


def test_exit_codes_and_check() -> None:
    runner = LocalRunner("node-a")
    result = runner.run(["sh", "-c", "echo bad thing >&2; exit 7"])
    assert result.exit_code == 7 and not result.ok
    with pytest.raises(CommandFailed, match=r"node-a.*exited with code 7:\nbad thing") as info:
        result.check()
    assert info.value.exit_code == 7 and info.value.host == "node-a"
    assert runner.run(["true"]).check().exit_code == 0
    killed = runner.run(["sh", "-c", "kill -TERM $$"])
    assert killed.exit_code == -15


def test_env_is_added_to_ours_and_taken_literally() -> None:
    value = "$(touch /tmp/autohet-pwned) `id` ;rm -rf x 'q\" \n2nd line"
    result = LocalRunner().run(
        [PY, "-c", "import os; print(repr(os.environ['HOSTILE'])); print(os.environ['PATH'])"],
        env={"HOSTILE": value},
    )
    lines = result.stdout.splitlines()
    assert lines[0] == repr(value)
    assert lines[1] == os.environ["PATH"]


def test_cwd_and_home_expansion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work dir"
    work.mkdir()
    assert LocalRunner().run(["pwd"], cwd=str(work)).stdout == f"{work}\n"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert LocalRunner().run(["pwd"], cwd="~/work dir").stdout == f"{work}\n"


def test_missing_program_or_cwd_is_a_transport_error(tmp_path: Path) -> None:
    with pytest.raises(TransportError, match="cannot start 'no-such-program-xyz'"):
        LocalRunner().run(["no-such-program-xyz"])
    with pytest.raises(TransportError, match="cannot start 'true' in"):
        LocalRunner().run(["true"], cwd=str(tmp_path / "missing"))


def test_bad_argv_is_rejected_before_running() -> None:
    runner = LocalRunner()
    with pytest.raises(ValueError, match="argv is empty"):
        runner.run([])
    with pytest.raises(ValueError, match="list of strings"):
        runner.run("echo hi")
    with pytest.raises(ValueError, match="not a valid identifier"):
        runner.run(["true"], env={"A B": "x"})


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "bg.pid"
    script = f"sleep 60 & echo $! > {pidfile}; echo started; wait"
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout, match=r"timed out after 0.5 s and was killed") as info:
        LocalRunner().run(["bash", "-c", script], timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    assert info.value.stdout == "started\n" and info.value.timeout_s == 0.5
    background = int(pidfile.read_text())
    assert _wait_until(lambda: not _alive(background)), "background child survived the timeout"


def test_kill_reaches_children_that_ignore_sigterm(tmp_path: Path) -> None:
    script = "trap '' TERM; sleep 60 & sleep 60 & echo up; wait"
    proc = LocalRunner().start(["bash", "-c", script])
    assert next(iter(proc.lines())) == ("stdout", "up")
    assert proc.poll() is None
    assert len(_group_members(proc.pid)) == 3
    t0 = time.monotonic()
    proc.kill(grace_s=0.3)
    assert time.monotonic() - t0 < 3
    assert proc.poll() is not None
    assert _wait_until(lambda: not _group_members(proc.pid)), "processes left in the group"


def test_start_writes_the_pid_file_first(tmp_path: Path) -> None:
    pid_file = tmp_path / "run" / "p.pid"
    pid_file.parent.mkdir()
    proc = LocalRunner().start(["sleep", "30"], pid_file=str(pid_file))
    assert pid_file.read_text() == f"{proc.pid}\n"
    proc.kill(grace_s=0)
    with pytest.raises(TransportError, match="cannot write the pid file"):
        LocalRunner().start(["sleep", "30"], pid_file=str(tmp_path / "no" / "p.pid"))


def test_start_handle_wait_poll_and_lines() -> None:
    proc = LocalRunner("n0").start(["sh", "-c", "echo a; sleep 0.2; echo b >&2; exit 3"])
    assert proc.pid > 0 and proc.host == "n0"
    assert list(proc.lines()) == [("stdout", "a"), ("stderr", "b")]
    assert proc.wait(timeout_s=10) == 3
    assert proc.poll() == 3
    result = proc.result(3)
    assert isinstance(result, RunResult) and result.stdout == "a\n" and result.stderr == "b\n"


def test_wait_timeout_leaves_the_process_running_for_the_caller() -> None:
    proc = LocalRunner().start(["sleep", "30"])
    with pytest.raises(CommandTimeout, match="still running after 0.2 s"):
        proc.wait(timeout_s=0.2)
    assert proc.poll() is None
    proc.kill()
    assert not _alive(proc.pid)


def test_an_exception_in_on_line_surfaces_from_run() -> None:
    def boom(stream: str, line: str) -> None:
        raise RuntimeError(f"callback failed on {line}")

    with pytest.raises(RuntimeError, match="callback failed on x"):
        LocalRunner().run(["sh", "-c", "echo x; echo y"], on_line=boom)


def test_put_and_get_copy_files_atomically(tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 10)
    src.chmod(0o640)
    runner = LocalRunner()
    runner.put(src, str(tmp_path / "remote" / "deep" / "dst.bin"))
    remote = tmp_path / "remote" / "deep" / "dst.bin"
    assert remote.read_bytes() == src.read_bytes()
    assert remote.stat().st_mode & 0o777 == 0o640
    runner.get(str(remote), tmp_path / "back" / "copy.bin")
    assert (tmp_path / "back" / "copy.bin").read_bytes() == src.read_bytes()
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["copy.bin"]
    with pytest.raises(TransportError, match="no such file"):
        runner.get(str(tmp_path / "nope"), tmp_path / "x")


def test_runner_for_local_addresses() -> None:
    for address in ("localhost", "local"):
        with runner_for(_host("me", address)) as runner:
            assert isinstance(runner, LocalRunner) and runner.host_name == "me"


def test_fan_out_collects_errors_per_host_and_bounds_threads() -> None:
    hosts = [_host(f"h{i}") for i in range(6)]
    active = 0
    peak = 0
    lock = threading.Lock()

    def job(host: Host) -> str:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        try:
            time.sleep(0.1)
            if host.name == "h3":
                raise TransportError(f"host {host.name}: gone", host=host.name)
            return LocalRunner(host.name).run(["echo", host.name]).stdout.strip()
        finally:
            with lock:
                active -= 1

    out = fan_out(hosts, job, max_workers=2)
    assert list(out) == [h.name for h in hosts]
    assert isinstance(out["h3"], TransportError)
    assert {k: v for k, v in out.items() if k != "h3"} == {
        f"h{i}": f"h{i}" for i in range(6) if i != 3
    }
    assert peak == 2
    assert fan_out([], job) == {}
    with pytest.raises(ValueError, match="duplicate host names"):
        fan_out([hosts[0], hosts[0]], job)
