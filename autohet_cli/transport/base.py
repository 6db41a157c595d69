"""The one runner interface: run commands and move files on a host, local or SSH.

Commands are argv lists, never shell strings. ``run`` waits for the command and
returns a :class:`RunResult`; ``start`` returns a :class:`ProcessHandle` for a
long-running process (launch uses it). Both stream output line by line to
``on_line(stream, line)`` as it arrives. A timeout kills the command's whole
process group and raises :class:`~autohet_cli.errors.CommandTimeout`. ``start_pings``
and ``liveness`` tell whether a host still answers at all (a host powered off
closes no connection: only an unanswered question shows it).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from autohet_cli.errors import CommandFailed, CommandTimeout
from autohet_cli.transport.lines import LineCallback, LineLog
from autohet_cli.transport.quoting import check_argv

DEFAULT_KILL_GRACE_S = 2.0
# After the process exited, how long to keep reading output that a leftover child
# (e.g. a backgrounded grandchild still holding the pipe) may keep open.
DRAIN_S = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    host: str
    argv: tuple[str, ...]
    exit_code: int  # negative: killed by that signal (local); -1: no status (SSH signal)
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self) -> RunResult:
        """Return self if the command succeeded, else raise CommandFailed with its stderr."""
        if self.exit_code != 0:
            tail = "\n".join(self.stderr.splitlines()[-20:])
            raise CommandFailed(
                f"host {self.host}: {show_command(self.argv)} exited with code {self.exit_code}"
                + (f":\n{tail}" if tail else " (no stderr)"),
                host=self.host,
                exit_code=self.exit_code,
                stderr=self.stderr,
            )
        return self


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    """What ``Runner.start`` runs: ``argv`` with ``env`` added, in ``cwd`` (None: the
    host's default), its pid written to ``pid_file`` (on the host) first."""

    argv: tuple[str, ...]
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    pid_file: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Liveness:
    """A host's answers to keep-alives, on this process's monotonic clock (seconds)."""

    waiting_since_s: float | None = None  # the oldest unanswered keep-alive went out then
    answered_sent_s: float | None = None  # the newest answered one went out then


def show_command(argv: Sequence[str], limit: int = 120) -> str:
    """A command as errors quote it: enough to recognise, never a whole script."""
    text = " ".join(argv)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


class ProcessHandle(ABC):
    """A started command: ``pid``, ``poll``, ``wait``, ``kill``, streamed lines."""

    def __init__(self, *, host: str, argv: Sequence[str], on_line: LineCallback | None) -> None:
        self.host = host
        self.argv = tuple(argv)
        self.started_at_s = time.monotonic()
        self.log = LineLog(on_line)
        self._pumps: list[threading.Thread] = []

    @property
    @abstractmethod
    def pid(self) -> int | None:
        """The process (and process-group) id on its host, once known."""

    @abstractmethod
    def poll(self) -> int | None:
        """The exit code if the process has ended, else None (SSH: raises HostUnreachable
        if the connection to the host was lost)."""

    @abstractmethod
    def _wait_exit(self, timeout_s: float | None) -> int | None:
        """Block until exit (return the code) or timeout (return None)."""

    @abstractmethod
    def _kill_group(self, grace_s: float) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after ``grace_s``
        (0: SIGKILL at once, no SIGTERM)."""

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for exit; raise CommandTimeout (process left running) if ``timeout_s`` passes."""
        code = self._wait_exit(timeout_s)
        if code is None:
            raise CommandTimeout(
                f"host {self.host}: {show_command(self.argv)} still running after {timeout_s:g} s",
                host=self.host,
                timeout_s=timeout_s or 0.0,
                stdout=self.log.text("stdout"),
                stderr=self.log.text("stderr"),
            )
        self._drain()
        if self.log.callback_error is not None:
            raise self.log.callback_error
        return code

    def kill(self, grace_s: float = DEFAULT_KILL_GRACE_S) -> None:
        """Stop the process and every process in its group (no-op if already gone).
        ``grace_s`` 0: no time to save anything, so no SIGTERM: SIGKILL at once."""
        self._kill_group(grace_s)
        self._drain()

    def lines(self) -> Iterator[tuple[str, str]]:
        """Every ``(stream, line)`` so far, then new ones as they arrive, until output ends."""
        return self.log.follow()

    @property
    def stdout(self) -> str:
        return self.log.text("stdout")

    @property
    def stderr(self) -> str:
        return self.log.text("stderr")

    def result(self, exit_code: int) -> RunResult:
        return RunResult(
            host=self.host,
            argv=self.argv,
            exit_code=exit_code,
            stdout=self.stdout,
            stderr=self.stderr,
            duration_s=time.monotonic() - self.started_at_s,
        )

    def _drain(self) -> None:
        deadline = time.monotonic() + DRAIN_S
        for t in self._pumps:
            t.join(max(0.0, deadline - time.monotonic()))


class Runner(ABC):
    """Runs commands and copies files on one host. Use as a context manager or ``close()``."""

    host_name: str

    def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        on_line: LineCallback | None = None,
        pid_file: str | None = None,
    ) -> ProcessHandle:
        """Start ``argv`` (in its own process group) and return at once; ``pid_file``
        (on the host): its pid is written there before it runs."""
        check_argv(argv, env=env, cwd=cwd)
        command = Command(argv=tuple(argv), env=env, cwd=cwd, pid_file=pid_file)
        return self._start(command, on_line)

    @abstractmethod
    def _start(self, command: Command, on_line: LineCallback | None) -> ProcessHandle:
        """``start`` with ``command`` checked (``quoting.check_argv``)."""

    @abstractmethod
    def put(self, local: str | Path, remote: str) -> None:
        """Copy a local file to the host (parents created, replaced atomically)."""

    @abstractmethod
    def get(self, remote: str, local: str | Path) -> None:
        """Copy a file from the host to a local path (parents created, replaced atomically)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the runner may not be used afterwards."""

    def start_pings(self, every_s: float) -> None:
        """From now on ask the host for a sign of life every ``every_s`` (see
        ``liveness``). Nothing to ask where no connection can go quiet (this machine)."""
        return None

    def liveness(self) -> Liveness | None:
        """How the host answers the pings; None where nobody asks (never pinged, local)."""
        return None

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        on_line: LineCallback | None = None,
    ) -> RunResult:
        """Run ``argv`` to completion; on timeout kill its process group, raise CommandTimeout."""
        proc = self.start(argv, env=env, cwd=cwd, on_line=on_line)
        try:
            code = proc.wait(timeout_s)
        except CommandTimeout:
            proc.kill()
            raise CommandTimeout(
                f"host {self.host_name}: {show_command(argv)} timed out after {timeout_s:g} s "
                "and was killed",
                host=self.host_name,
                timeout_s=timeout_s or 0.0,
                stdout=proc.stdout,
                stderr=proc.stderr,
            ) from None
        except BaseException:
            proc.kill()
            raise
        return proc.result(code)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
