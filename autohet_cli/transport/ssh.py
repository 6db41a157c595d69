"""Run commands and move files on a remote host over SSH (paramiko).

One connection per runner, opened on first use (or by ``connect()``) and reopened
if it dropped; every command is its own session channel running the quoted
command line from :mod:`~autohet_cli.transport.quoting`. Files go over SFTP, to a
temp name first and then renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import posixpath
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import paramiko

from autohet_cli.cluster import Host
from autohet_cli.errors import HostUnreachable, SessionsExhausted, TransportError
from autohet_cli.transport.base import Command, Liveness, ProcessHandle, Runner, show_command
from autohet_cli.transport.connect import Connection, open_connection, reason
from autohet_cli.transport.lines import LineCallback, ReadsLines, strip_newline
from autohet_cli.transport.local import atomic_target, not_a_file
from autohet_cli.transport.pings import Pinger
from autohet_cli.transport.quoting import parse_pid_line, remote_command, sftp_path
from autohet_cli.transport.target import SshOptions, load_ssh_config, resolve

_SESSION_ERRORS = (paramiko.SSHException, OSError, EOFError)


class _PidFilter:
    """Takes our ``__autohet_pid__ N`` line out of stdout and reports the pid."""

    def __init__(self, source: ReadsLines, on_pid: Callable[[int | None], None]) -> None:
        self._source = source
        self._on_pid = on_pid
        self._found = False

    def readline(self) -> bytes:
        line = self._source.readline()
        while not self._found:
            if not line:
                self._on_pid(None)  # ended before announcing (e.g. the shell failed)
                self._found = True
                break
            pid = parse_pid_line(strip_newline(line))
            if pid is None:
                return line  # output before ours, e.g. from a chatty ~/.bashrc
            self._on_pid(pid)
            self._found = True
            line = self._source.readline()
        return line


class SshProcess(ProcessHandle):
    def __init__(
        self,
        runner: SshRunner,
        chan: paramiko.Channel,
        argv: Sequence[str],
        *,
        command: str,
        on_line: LineCallback | None,
    ) -> None:
        super().__init__(host=runner.host_name, argv=argv, on_line=on_line)
        self._runner = runner
        self._chan = chan
        self._pid: int | None = None
        self._pid_known = threading.Event()
        chan.exec_command(command)
        chan.shutdown_write()  # no stdin: a command reading it sees EOF
        out = _PidFilter(chan.makefile("rb"), self._set_pid)
        self._pumps = [
            self.log.pump("stdout", out, name=f"{self.host}-stdout"),
            self.log.pump("stderr", chan.makefile_stderr("rb"), name=f"{self.host}-stderr"),
        ]

    def _set_pid(self, pid: int | None) -> None:
        self._pid = pid
        self._pid_known.set()

    @property
    def pid(self) -> int | None:
        return self._pid

    def poll(self) -> int | None:
        if not self._chan.exit_status_ready():
            return None
        return self._exit_code()

    def _wait_exit(self, timeout_s: float | None) -> int | None:
        if not self._chan.status_event.wait(timeout_s):
            return None
        return self._exit_code()

    def _exit_code(self) -> int:
        code = self._chan.exit_status
        if code == -1 and not self._runner.is_connected():
            raise HostUnreachable(
                f"host {self._runner.target.label}: connection lost while running "
                f"{' '.join(self.argv)[:100]!r}",
                host=self.host,
            )
        return code

    def _kill_group(self, grace_s: float) -> None:
        running = not self._chan.status_event.is_set()
        if running:
            self._pid_known.wait(self._runner.options.connect_timeout_s)
        if self._pid is not None:
            if running and grace_s > 0:
                self._signal("TERM")
                self._chan.status_event.wait(grace_s)
            self._signal("KILL")  # stragglers: ignored SIGTERM, or outlived their leader
            self._chan.status_event.wait(grace_s)
        self._chan.close()

    def _signal(self, name: str) -> None:
        pid = self._pid
        assert pid is not None and pid > 1  # parse_pid_line never yields 0 or 1
        # The shell builtin, with the pid we parsed as an int: no user text in this line.
        try:
            self._runner.exec_quick(f"kill -s {name} -- -{pid} 2>/dev/null; true")
        except TransportError:
            pass  # host gone: nothing left to kill there that we could reach


class SshRunner(Runner):
    """Commands and files on one host over SSH (see :class:`SshOptions` for the knobs)."""

    def __init__(
        self,
        host: Host,
        options: SshOptions | None = None,
        *,
        config: paramiko.SSHConfig | None = None,
    ) -> None:
        self.host_name = host.name
        self.options = options or SshOptions()
        ssh_config = config if config is not None else load_ssh_config(self.options.ssh_config)
        self.target = resolve(host, ssh_config)
        self._lock = threading.Lock()
        self._sftp_lock = threading.Lock()
        self._conn: Connection | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._closed = False
        self._pinger: Pinger | None = None

    @property
    def num_jumps(self) -> int:
        return len(self.target.jumps)

    def connect(self) -> None:
        """Open the connection now (otherwise the first command does)."""
        self._transport()

    def start_pings(self, every_s: float) -> None:
        """Keep-alives that want a reply on this connection (opened now if need be);
        a connection reopened later is not pinged until asked again."""
        transport = self._transport()
        with self._lock:
            if self._pinger is not None and self._pinger.transport is transport:
                return
            if self._pinger is not None:
                self._pinger.stop()
            self._pinger = Pinger(transport, every_s, name=f"{self.host_name}-pings")

    def liveness(self) -> Liveness | None:
        """None once the pinged connection closed (its channels tell that)."""
        pinger = self._pinger
        if pinger is None or not pinger.transport.is_active():
            return None
        return pinger.liveness()

    def is_connected(self) -> bool:
        conn = self._conn
        return conn is not None and conn.transport.is_active()

    def _transport(self) -> paramiko.Transport:
        with self._lock:
            if self._closed:
                raise TransportError(f"host {self.host_name}: runner already closed")
            if self._conn is None or not self._conn.transport.is_active():
                if self._conn is not None:
                    self._conn.close()
                    self._sftp = None
                self._conn = open_connection(self.target, self.options)
            return self._conn.transport

    def _session(self, doing: str, transport: paramiko.Transport | None = None) -> paramiko.Channel:
        """A session channel; ``doing`` ("to run ...") goes into any error."""
        try:
            t = transport or self._transport()
            return t.open_session(timeout=self.options.connect_timeout_s)
        except paramiko.ChannelException as exc:
            raise SessionsExhausted(
                f"host {self.target.label}: the server refused another session {doing} "
                f"({reason(exc)}); sshd allows MaxSessions (default 10) open sessions per "
                "connection",
                host=self.host_name,
            ) from exc
        except _SESSION_ERRORS as exc:
            raise HostUnreachable(
                f"host {self.target.label}: cannot open an SSH session {doing}: {reason(exc)}",
                host=self.host_name,
            ) from exc

    def _start(self, command: Command, on_line: LineCallback | None) -> SshProcess:
        argv, env, cwd = command.argv, command.env, command.cwd
        line = remote_command(argv, env=env, cwd=cwd, announce_pid=True, pid_file=command.pid_file)
        chan = self._session(f"to run {_brief(argv)}")
        try:
            return SshProcess(self, chan, argv, command=line, on_line=on_line)
        except _SESSION_ERRORS as exc:
            chan.close()
            raise HostUnreachable(
                f"host {self.target.label}: cannot start {_brief(argv)}: {reason(exc)}",
                host=self.host_name,
            ) from exc

    def exec_quick(self, command: str) -> int:
        """Run a fixed shell line of ours (no user input) and wait; for housekeeping.

        If this connection has no session left (sshd's MaxSessions), a second
        connection is opened for it, so a kill always gets through.
        """
        doing = f"to run {_brief([command])}"
        try:
            return self._exec_wait(self._session(doing), command)
        except SessionsExhausted:
            conn = open_connection(self.target, self.options)
            try:
                return self._exec_wait(self._session(doing, conn.transport), command)
            finally:
                conn.close()

    def _exec_wait(self, chan: paramiko.Channel, command: str) -> int:
        timeout_s = self.options.connect_timeout_s
        try:
            chan.exec_command(command)
            if not chan.status_event.wait(timeout_s):
                raise HostUnreachable(
                    f"host {self.target.label}: no answer within {timeout_s:g} s to "
                    f"{_brief([command])}",
                    host=self.host_name,
                )
            return chan.exit_status
        except _SESSION_ERRORS as exc:
            raise HostUnreachable(
                f"host {self.target.label}: running {_brief([command])} failed: {reason(exc)}",
                host=self.host_name,
            ) from exc
        finally:
            chan.close()

    def put(self, local: str | Path, remote: str) -> None:
        src = Path(local).expanduser()
        if not src.is_file():
            raise TransportError(f"host {self.host_name}: {not_a_file(src)}", host=self.host_name)
        dst = sftp_path(remote)
        tmp = posixpath.join(
            posixpath.dirname(dst), f".{posixpath.basename(dst)}.{uuid.uuid4().hex[:8]}.tmp"
        )
        with self._sftp_lock:
            sftp = self._sftp_client(f"to write {remote}")
            try:
                _makedirs(sftp, posixpath.dirname(dst))
                sftp.put(str(src), tmp)
                sftp.chmod(tmp, src.stat().st_mode & 0o777)
                sftp.posix_rename(tmp, dst)
            except _SESSION_ERRORS as exc:
                _remove_quietly(sftp, tmp)
                raise self._file_error("cannot write", remote, exc) from exc

    def get(self, remote: str, local: str | Path) -> None:
        with self._sftp_lock:
            sftp = self._sftp_client(f"to read {remote}")
            try:
                with atomic_target(Path(local).expanduser()) as tmp:
                    sftp.get(sftp_path(remote), str(tmp))
            except _SESSION_ERRORS as exc:
                raise self._file_error("cannot read", remote, exc) from exc

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._pinger is not None:
                self._pinger.stop()
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            self._sftp = None

    def _sftp_client(self, doing: str) -> paramiko.SFTPClient:
        transport = self._transport()
        if self._sftp is None or self._sftp.get_channel() is None or not transport.is_active():
            try:
                self._sftp = paramiko.SFTPClient.from_transport(transport)
            except _SESSION_ERRORS as exc:
                raise HostUnreachable(
                    f"host {self.target.label}: cannot start SFTP {doing}: {reason(exc)}",
                    host=self.host_name,
                ) from exc
            if self._sftp is None:
                raise TransportError(
                    f"host {self.target.label}: the server refused SFTP {doing} (is its sftp "
                    "subsystem enabled?)",
                    host=self.host_name,
                )
        return self._sftp

    def _file_error(self, what: str, path: str, exc: BaseException) -> TransportError:
        return TransportError(
            f"host {self.host_name}: {what} {path}: {reason(exc)}", host=self.host_name
        )


def _brief(argv: Sequence[str]) -> str:
    return show_command(argv, limit=100)


def _makedirs(sftp: paramiko.SFTPClient, path: str) -> None:
    """``mkdir -p`` over SFTP (relative paths are under the login directory)."""
    if path in ("", ".", "/"):
        return
    try:
        sftp.stat(path)
        return
    except FileNotFoundError:
        pass
    _makedirs(sftp, posixpath.dirname(path))
    try:
        sftp.mkdir(path)
    except OSError:
        sftp.stat(path)  # raced with another writer: fine if it exists now


def _remove_quietly(sftp: paramiko.SFTPClient, path: str) -> None:
    try:
        sftp.remove(path)
    except _SESSION_ERRORS:
        pass
