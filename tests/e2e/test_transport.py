"""The SSH transport against real OpenSSH servers on 127.0.0.2, 127.0.0.3, ...

Never any address outside loopback: host names that would need DNS are answered
by a fake resolver (the system resolver is not on loopback).
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from autohet_cli.cluster import Host
from autohet_cli.errors import (
    AuthError,
    CommandTimeout,
    ConnectTimeout,
    HostKeyError,
    HostUnreachable,
    TransportError,
)
from autohet_cli.transport import RunResult, SshRunner, fan_out, runner_for
from autohet_cli.transport.target import resolve
from tests.e2e.sshd import FakeSshHost, SshdFarm, _descendants
from tests.planting import cpu_host

pytestmark = pytest.mark.e2e

PY = sys.executable  # same machine, so the remote side has it too
REPORT = (
    "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], "
    "'env': os.environ.get('HOSTILE'), 'cwd': os.getcwd()}))"
)


@pytest.fixture
def no_dns(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Resolve IP literals only; record any name asked for and fail it like NXDOMAIN."""
    asked: list[str] = []
    real = socket.getaddrinfo

    def fake(host: object, *args: object, **kwargs: object) -> object:
        try:
            socket.inet_aton(str(host))
        except OSError:
            asked.append(str(host))
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return asked


def _ssh(farm: SshdFarm, fake: FakeSshHost, **options: object) -> SshRunner:
    return SshRunner(fake.as_host(), farm.options(**options))


def test_fan_out_runs_on_three_hosts_in_parallel(sshd_farm: SshdFarm) -> None:
    fakes = sshd_farm.start(3)

    def job(host: Host) -> RunResult:
        with runner_for(
            host, known_hosts=sshd_farm.known_hosts, ssh_config=sshd_farm.ssh_config
        ) as runner:
            return runner.run(["sh", "-c", 'sleep 1.5; echo "$SSH_CONNECTION"'], timeout_s=20)

    t0 = time.monotonic()
    out = fan_out([f.as_host() for f in fakes], job)
    elapsed = time.monotonic() - t0
    for fake in fakes:
        result = out[fake.name]
        assert isinstance(result, RunResult), result
        assert result.exit_code == 0
        # SSH_CONNECTION = client ip, client port, server ip, server port
        assert result.stdout.split()[2:] == [fake.address, str(fake.port)]
    assert elapsed < 4.0, f"3 x 1.5 s commands took {elapsed:.1f} s: not parallel"


def test_streaming_exit_code_env_and_cwd(sshd_farm: SshdFarm) -> None:
    (fake,) = sshd_farm.start(1)
    seen: list[tuple[str, str]] = []
    script = 'echo out; sleep 0.2; echo err >&2; sleep 0.2; echo "$A"; pwd; exit 5'
    with _ssh(sshd_farm, fake) as runner:
        result = runner.run(
            ["sh", "-c", script],
            env={"A": "x y"},
            cwd=str(fake.checkpoint_dir),
            on_line=lambda s, ln: seen.append((s, ln)),
        )
    assert seen == [
        ("stdout", "out"),
        ("stderr", "err"),
        ("stdout", "x y"),
        ("stdout", str(fake.checkpoint_dir)),
    ]
    assert result.exit_code == 5 and result.host == fake.name


def test_timeout_and_kill_reach_the_remote_process_group(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    (fake,) = sshd_farm.start(1)
    pidfile = tmp_path / "bg.pid"
    with _ssh(sshd_farm, fake) as runner:
        with pytest.raises(CommandTimeout, match=f"host {fake.name}: .* timed out after 0.5 s"):
            runner.run(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], timeout_s=0.5)
        assert _gone(int(pidfile.read_text()))
        proc = runner.start(["sh", "-c", "trap '' TERM; echo up; sleep 60; wait"])
        assert next(iter(proc.lines())) == ("stdout", "up")
        assert proc.pid is not None and proc.poll() is None
        proc.kill(grace_s=0.3)
        assert proc.poll() is not None
        assert _gone(proc.pid)


def _gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def test_put_and_get_a_file(sshd_farm: SshdFarm, tmp_path: Path) -> None:
    (fake,) = sshd_farm.start(1)
    src = tmp_path / "shard.bin"
    src.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    src.chmod(0o640)
    remote = fake.checkpoint_dir / "step-10" / "rank 0" / "shard.bin"
    with _ssh(sshd_farm, fake) as runner:
        runner.put(src, str(remote))
        assert remote.read_bytes() == src.read_bytes()
        assert remote.stat().st_mode & 0o777 == 0o640
        assert sorted(p.name for p in remote.parent.iterdir()) == ["shard.bin"]
        runner.get(str(remote), tmp_path / "back" / "shard.bin")
        with pytest.raises(TransportError, match=f"host {fake.name}: cannot read .*missing"):
            runner.get(str(fake.checkpoint_dir / "missing"), tmp_path / "x")
    assert (tmp_path / "back" / "shard.bin").read_bytes() == src.read_bytes()
    assert not (tmp_path / "x").exists()


def test_unknown_host_key_refused_then_accepted_and_recorded(sshd_farm: SshdFarm) -> None:
    (fake,) = sshd_farm.start(1, trusted=False)
    before = sshd_farm.known_hosts.read_text()
    with pytest.raises(HostKeyError) as info:
        _ssh(sshd_farm, fake).connect()
    message = str(info.value)
    assert fake.name in message and "unknown host key" in message
    assert "--accept-new-host-keys" in message and "SHA256:" in message
    assert sshd_farm.known_hosts.read_text() == before

    with _ssh(sshd_farm, fake, accept_new_host_keys=True) as runner:
        assert runner.run(["true"]).ok
    assert sshd_farm.known_hosts.read_text() == before + fake.known_hosts_line() + "\n"
    with _ssh(sshd_farm, fake) as runner:  # now known: no flag needed
        assert runner.run(["true"]).ok


def test_changed_host_key_is_always_refused(sshd_farm: SshdFarm) -> None:
    (fake,) = sshd_farm.start(1)
    with _ssh(sshd_farm, fake) as runner:
        assert runner.run(["true"]).ok
    fake.restart(new_host_key=True)
    before = sshd_farm.known_hosts.read_text()
    for accept in (False, True):
        with pytest.raises(HostKeyError, match="HOST KEY HAS CHANGED") as info:
            _ssh(sshd_farm, fake, accept_new_host_keys=accept).connect()
        assert "man-in-the-middle" in str(info.value) and fake.name in str(info.value)
        assert f"ssh-keygen -R '[{fake.address}]:{fake.port}'" in str(info.value)
    assert sshd_farm.known_hosts.read_text() == before


def test_stopped_sshd_is_connection_refused_while_others_succeed(sshd_farm: SshdFarm) -> None:
    fakes = sshd_farm.start(3)
    fakes[1].stop()
    options = sshd_farm.options()

    def job(host: Host) -> RunResult:
        with SshRunner(host, options) as runner:
            return runner.run(["echo", host.name])

    out = fan_out([f.as_host() for f in fakes], job)
    error = out[fakes[1].name]
    assert isinstance(error, HostUnreachable) and not isinstance(error, ConnectTimeout)
    assert f"host {fakes[1].name}" in str(error) and "connection refused" in str(error)
    assert error.host == fakes[1].name
    for fake in (fakes[0], fakes[2]):
        result = out[fake.name]
        assert isinstance(result, RunResult) and result.stdout == f"{fake.name}\n"


def test_host_vanishing_mid_command_is_reported(sshd_farm: SshdFarm) -> None:
    (fake,) = sshd_farm.start(1)
    with _ssh(sshd_farm, fake) as runner:
        proc = runner.start(["sleep", "30"])
        deadline = time.monotonic() + 5
        while proc.pid is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.pid is not None
        fake.stop()  # sshd, its sessions and their processes die: the connection drops
        with pytest.raises(HostUnreachable, match=f"host {fake.name}.*connection lost"):
            proc.wait(timeout_s=10)


@pytest.fixture
def silent_listener() -> Iterator[tuple[str, int]]:
    """Accepts TCP connections and never says a word (no SSH banner)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield srv.getsockname()
    stop.set()
    thread.join()
    for s in [*held, srv]:
        s.close()


@pytest.fixture
def full_backlog() -> Iterator[tuple[str, int]]:
    """A listener whose accept queue is full: the kernel drops further SYNs, so a
    connect really times out, on loopback, with no packet leaving the machine."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    filler = socket.create_connection(srv.getsockname(), timeout=1)
    yield srv.getsockname()
    filler.close()
    srv.close()


def _plain_host(name: str, address: str, port: int = 22) -> Host:
    return cpu_host(name, address, gpu_mem_bytes=4 << 30, port=port, user="nobody")


def test_timeouts_name_the_host_and_the_phase(
    sshd_farm: SshdFarm, silent_listener: tuple[str, int], full_backlog: tuple[str, int]
) -> None:
    options = sshd_farm.options(connect_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(
        ConnectTimeout, match=r"host mute .*0.5 s waiting for the SSH greeting"
    ) as info:
        SshRunner(_plain_host("mute", *silent_listener), options).connect()
    assert info.value.host == "mute"
    with pytest.raises(ConnectTimeout, match=r"host jammed .*timed out after 0.5 s"):
        SshRunner(_plain_host("jammed", *full_backlog), options).connect()
    assert time.monotonic() - t0 < 5


def test_dns_failure_and_hostile_host_names_run_nothing(
    sshd_farm: SshdFarm, no_dns: list[str], tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    evil = f"nosuch.invalid;touch {marker}$(touch {marker})`touch {marker}`"
    with pytest.raises(HostUnreachable, match=r"host evil.*cannot resolve host name") as info:
        SshRunner(_plain_host("evil", evil), sshd_farm.options()).connect()
    assert evil in str(info.value) and "DNS" in str(info.value)
    assert no_dns == [evil]  # handed to the resolver as one literal name
    assert not marker.exists()


def test_hostile_argv_env_cwd_and_paths_run_nothing_remotely(
    sshd_farm: SshdFarm, tmp_path: Path
) -> None:
    (fake,) = sshd_farm.start(1)
    marker = tmp_path / "pwned"
    m = str(marker)
    hostile = [f"$(touch {m})", f"`touch {m}`", f";touch {m}", f"'\"\n touch {m}", "$HOME *"]
    workdir = fake.checkpoint_dir / "d $(touch pwned) ;touch pwned `touch pwned`"
    workdir.mkdir()
    with _ssh(sshd_farm, fake) as runner:
        for value in hostile:
            result = runner.run(
                [PY, "-c", REPORT, *hostile], env={"HOSTILE": value}, cwd=str(workdir)
            ).check()
            assert json.loads(result.stdout) == {"argv": hostile, "env": value, "cwd": str(workdir)}
        src = tmp_path / "f.txt"
        src.write_text("data")
        weird = workdir / f"x $(touch {m}) ;touch {m}"
        runner.put(src, str(weird))
        runner.get(str(weird), tmp_path / "back.txt")
    assert weird.read_text() == "data" and (tmp_path / "back.txt").read_text() == "data"
    assert not marker.exists() and not (workdir / "pwned").exists()
    assert not (fake.checkpoint_dir / "pwned").exists()


def test_auth_failure_names_user_and_host(sshd_farm: SshdFarm) -> None:
    (fake,) = sshd_farm.start(1, authorized=False)
    with pytest.raises(AuthError, match=rf"host {fake.name} .*authentication failed for user"):
        _ssh(sshd_farm, fake).connect()
    missing = fake.as_host(identity_file="/nonexistent/id_ed25519")
    with pytest.raises(AuthError, match="identity file /nonexistent/id_ed25519 not found"):
        SshRunner(missing, sshd_farm.options()).connect()


def test_ssh_config_and_proxy_jump(sshd_farm: SshdFarm) -> None:
    jump, target = sshd_farm.start(2)
    key = sshd_farm.client_key.private_path
    sshd_farm.ssh_config.write_text(
        f"Host bastion\n  HostName {jump.address}\n  Port {jump.port}\n  IdentityFile {key}\n"
        f"Host inner\n  HostName {target.address}\n  Port {target.port}\n"
        f"  User {target.user}\n  IdentityFile {key}\n  ProxyJump bastion\n"
    )
    # Only the alias in the cluster file: address, port, user, key come from ssh config.
    host = cpu_host("inner-node", "inner", gpu_mem_bytes=4 << 30)
    runner = runner_for(host, known_hosts=sshd_farm.known_hosts, ssh_config=sshd_farm.ssh_config)
    assert isinstance(runner, SshRunner) and runner.num_jumps == 1
    with runner:
        result = runner.run(["sh", "-c", 'echo "$SSH_CONNECTION"']).check()
    assert result.stdout.split()[2:] == [target.address, str(target.port)]
    assert "Accepted publickey" in jump.log()
    # Proof that the route goes through the jump host: without it, the target is unreachable.
    jump.stop()
    with pytest.raises(HostUnreachable, match=r"host inner-node: jump host bastion .*refused"):
        runner_for(host, known_hosts=sshd_farm.known_hosts, ssh_config=sshd_farm.ssh_config).run(
            ["true"]
        )


def test_cluster_fields_win_over_ssh_config(sshd_farm: SshdFarm) -> None:
    (fake,) = sshd_farm.start(1)
    sshd_farm.ssh_config.write_text(
        f"Host {fake.address}\n  Port 1\n  User nobody\n  IdentityFile /nonexistent/key\n"
    )
    # The cluster's explicit port, user and identity_file are used; ssh config's are not.
    with _ssh(sshd_farm, fake) as runner:
        assert runner.target.port == fake.port and runner.target.user == fake.user
        assert runner.run(["true"]).ok


def test_proxy_jump_specs_are_parsed() -> None:
    config = paramiko.SSHConfig.from_text(
        "Host a\n  ProxyJump alice@j1:2200,[::1]:2222,j3\n"
        "Host j3\n  HostName 127.0.0.9\n  User carol\n  Port 2300\n"
        "Host b\n  ProxyJump none\n"
    )
    jumps = resolve(_plain_host("a-node", "a"), config).jumps
    assert [(j.user, j.hostname, j.port) for j in jumps] == [
        ("alice", "j1", 2200),
        (getpass.getuser(), "::1", 2222),
        ("carol", "127.0.0.9", 2300),
    ]
    assert resolve(_plain_host("b-node", "b"), config).jumps == ()


def test_a_kill_gets_through_when_all_sessions_are_in_use(sshd_farm: SshdFarm) -> None:
    """sshd allows MaxSessions (10) per connection; kill then uses a second connection."""
    (fake,) = sshd_farm.start(1)
    with _ssh(sshd_farm, fake) as runner:
        procs = [runner.start(["sleep", "30"]) for _ in range(10)]
        with pytest.raises(TransportError, match="MaxSessions"):
            runner.start(["true"])
        deadline = time.monotonic() + 5
        while any(p.pid is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        for proc in procs:
            pid = proc.pid
            assert pid is not None
            proc.kill(grace_s=0.5)
            assert _gone(pid)


def test_keepalives_show_a_host_that_stops_answering(sshd_farm: SshdFarm, tmp_path: Path) -> None:
    """A stopped sshd closes nothing (as a host powered off): only an unanswered
    keep-alive shows it; once it runs again, the answers resume. A pid file is written
    by the start command itself, before the command runs."""
    (fake,) = sshd_farm.start(1)
    with _ssh(sshd_farm, fake) as runner:
        assert runner.liveness() is None  # nobody asks yet
        pid_file = tmp_path / "cmd.pid"
        proc = runner.start(["sleep", "30"], pid_file=str(pid_file))
        runner.start_pings(0.1)
        time.sleep(0.5)
        first = runner.liveness()
        assert first is not None and first.answered_sent_s is not None
        assert proc.pid is not None and pid_file.read_text() == f"{proc.pid}\n"
        assert fake.proc is not None
        stopped = [fake.proc.pid, *_descendants(fake.proc.pid)]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(1.0)
            quiet = runner.liveness()
            assert quiet is not None and quiet.waiting_since_s is not None
            assert time.monotonic() - quiet.waiting_since_s > 0.7
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.5)
        back = runner.liveness()  # the keep-alive that waited was answered
        assert back is not None and (back.answered_sent_s or 0) >= quiet.waiting_since_s
        proc.kill(grace_s=0)
