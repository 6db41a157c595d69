"""Run commands on this machine (cluster hosts with address ``localhost``/``local``).

Each command gets its own session and process group (``start_new_session``), so a
kill or timeout reaches every process it spawned. The environment is this
process's environment with ``env`` added; ``~`` in paths means our home directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from autohet_cli.errors import TransportError
from autohet_cli.transport.base import Command, ProcessHandle, Runner
from autohet_cli.transport.lines import LineCallback


class LocalProcess(ProcessHandle):
    def __init__(self, host: str, command: Command, *, on_line: LineCallback | None) -> None:
        argv = command.argv
        super().__init__(host=host, argv=argv, on_line=on_line)
        full_env = {**os.environ, **(command.env or {})}
        workdir = os.path.expanduser(command.cwd) if command.cwd is not None else None
        try:
            self._proc = subprocess.Popen(
                list(argv),
                env=full_env,
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            where = f" in {workdir}" if workdir else ""
            raise TransportError(
                f"host {host}: cannot start {argv[0]!r}{where}: {exc.strerror or exc}",
                host=host,
            ) from exc
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._pumps = [
            self.log.pump("stdout", self._proc.stdout, name=f"{host}-stdout"),
            self.log.pump("stderr", self._proc.stderr, name=f"{host}-stderr"),
        ]

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> int | None:
        return self._proc.poll()

    def _wait_exit(self, timeout_s: float | None) -> int | None:
        try:
            return self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def _kill_group(self, grace_s: float) -> None:
        # The group id is our child's pid; it stays reserved while any member lives.
        pgid = self._proc.pid
        if grace_s > 0:
            _signal_group(pgid, signal.SIGTERM)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(pgid, signal.SIGKILL)  # stragglers that ignored SIGTERM
        self._proc.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


class LocalRunner(Runner):
    """Subprocesses on this machine; ``put``/``get`` are file copies."""

    def __init__(self, host_name: str = "localhost") -> None:
        self.host_name = host_name

    def _start(self, command: Command, on_line: LineCallback | None) -> LocalProcess:
        proc = LocalProcess(self.host_name, command, on_line=on_line)
        if command.pid_file is not None:
            try:
                Path(command.pid_file).expanduser().write_text(f"{proc.pid}\n")
            except OSError as exc:
                proc.kill(0.0)
                raise TransportError(
                    f"host {self.host_name}: cannot write the pid file {command.pid_file}: "
                    f"{exc.strerror or exc}",
                    host=self.host_name,
                ) from exc
        return proc

    def put(self, local: str | Path, remote: str) -> None:
        self._copy(Path(local).expanduser(), Path(remote).expanduser())

    def get(self, remote: str, local: str | Path) -> None:
        self._copy(Path(remote).expanduser(), Path(local).expanduser())

    def close(self) -> None:
        pass

    def _copy(self, src: Path, dst: Path) -> None:
        if not src.is_file():
            raise TransportError(f"host {self.host_name}: {not_a_file(src)}", host=self.host_name)
        try:
            copy_atomic(src, dst)
        except OSError as exc:
            raise TransportError(
                f"host {self.host_name}: cannot copy {src} to {dst}: {exc.strerror or exc}",
                host=self.host_name,
            ) from exc


def not_a_file(path: Path) -> str:
    """Why ``path`` cannot be copied (only regular files are; not directories)."""
    if path.is_dir():
        return f"{path} is a directory; only files can be copied"
    return f"{path}: no such file"


def copy_atomic(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` through a temp file beside ``dst`` and a rename."""
    with atomic_target(dst) as tmp:
        shutil.copy2(src, tmp)


@contextmanager
def atomic_target(dst: Path) -> Iterator[Path]:
    """A temp path beside ``dst`` to write; renamed onto ``dst`` only if the block succeeds."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
