"""Worker processes forked from one interpreter that imported torch and the runtime once.

Why: the exactness and checkpoint tests start ~100 workers (``python -m
autohet_cli.runtime.train`` with torchrun's variables), and each fresh interpreter
spent 1.7 s of a 2-core machine importing torch, DTensor and DCP before its first
step: more than the three steps it trains. Here one server process (per test
process) imports them and forks a worker per request; each worker is still its own
process with its own gloo process group, environment, working directory, stdout and
stderr files, and runs the module as ``python -m`` does (``runpy``, ``__main__``).
The server never runs a torch op, so no thread pool is forked.

What this does not prove, torchrun and fresh interpreters, the tests that start
workers the way a launch does prove: tests/dist/test_preempt.py, test_health.py,
test_compile_exact.py and every launch in tests/e2e.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# The server: read one JSON request a line, fork, answer the child's pid. Children are
# reaped by the kernel (SIGCHLD ignored); each writes its exit code to a file before
# it ends, after what a normal interpreter exit runs (non-daemon threads, atexit).
_SERVER = r"""
import atexit, json, os, runpy, signal, sys, threading, traceback
import autohet_cli.runtime.train  # noqa: F401  (torch, DTensor, DCP: imported once)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid:
        print(json.dumps({"pid": pid}), flush=True)
        continue
    code = 1
    real_exit = os._exit

    def _exit(status, _path=req["status"]):  # the worker's own os._exit: its code too
        with open(_path, "w") as f:
            f.write(str(status))
        real_exit(status)

    os._exit = _exit
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            os.dup2(os.open(path, flags, 0o644), fd)
        sys.stdin = open(os.devnull)
        sys.stdout.reconfigure(line_buffering=True)  # as python -u: a killed worker's lines stay
        sys.argv = [req["module"], *req["args"]]
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        threading._shutdown()  # what an interpreter's exit runs: join the worker threads
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
"""


@dataclass(frozen=True, slots=True)
class Forked:
    """One forked worker: its pid and the files it writes."""

    pid: int
    stdout: Path
    stderr: Path
    status: Path

    def wait(self, timeout_s: float) -> int:
        """Its exit code (as subprocess gives it: -N for a signal); killed after
        ``timeout_s``, then AssertionError."""
        deadline = time.monotonic() + timeout_s
        while True:
            # The code is written last, just before os._exit: read it and do not look at
            # the pid again (reaped by the kernel at once, it may be reused).
            if code := self.code():
                return int(code)
            if not _alive(self.pid):
                return int(self.code() or -signal.SIGKILL)  # no code: killed
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"worker {self.pid} still running after {timeout_s} s")
            time.sleep(0.02)

    def code(self) -> str:
        try:
            return self.status.read_text().strip()
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """SIGKILL, unless it ended already (its pid may belong to another process)."""
        if self.code():
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def output(self) -> tuple[str, str]:
        return self.stdout.read_text(errors="replace"), self.stderr.read_text(errors="replace")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


class Zygote:
    """The server process, started on first use and kept for this test process."""

    _lock = threading.Lock()
    _proc: subprocess.Popen[str] | None = None

    @classmethod
    def _server(cls, env: Mapping[str, str], cwd: Path) -> subprocess.Popen[str]:
        if cls._proc is None or cls._proc.poll() is not None:
            cls._proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER],
                cwd=cwd,
                env=dict(env),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        return cls._proc

    @classmethod
    def spawn(
        cls,
        module: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        logs: Path,
        name: str,
    ) -> Forked:
        """``python -m module args`` as a fork of the server, in ``env`` and ``cwd``;
        stdout, stderr and exit code in ``logs/name.*``."""
        logs.mkdir(parents=True, exist_ok=True)
        forked = Forked(
            pid=0,
            stdout=logs / f"{name}.out",
            stderr=logs / f"{name}.err",
            status=logs / f"{name}.status",
        )
        request = {
            "module": module,
            "args": list(args),
            "env": dict(env),
            "cwd": str(cwd),
            "stdout": str(forked.stdout),
            "stderr": str(forked.stderr),
            "status": str(forked.status),
        }
        with cls._lock:
            server = cls._server(env, cwd)
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            answer = server.stdout.readline()
        assert answer, "the zygote server died"
        pid = int(json.loads(answer)["pid"])
        return Forked(pid=pid, stdout=forked.stdout, stderr=forked.stderr, status=forked.status)


def run_workers(
    argv: Sequence[str],
    count: int,
    *,
    env: Mapping[str, str],
    cwd: Path,
    timeout_s: float,
    logs: Path | None = None,
    rank_env: Sequence[Mapping[str, str]] | None = None,
    rank_argv: Sequence[Sequence[str]] | None = None,
) -> list[tuple[int, str, str]]:
    """``count`` ranks of ``argv`` (``-m module args...``) as torchrun would start them
    on one host (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT; ``rank_env`` adds or
    replaces per-rank variables, ``rank_argv`` per-rank arguments, as a launcher gives
    each host its own); (exit code, stdout, stderr) per rank. One worker
    alone gets no torchrun variables, as a plain ``python -m`` run. Output files go to
    ``logs`` (kept) or a temporary folder (removed)."""
    assert argv[0] == "-m", argv
    if logs is None:
        with tempfile.TemporaryDirectory(prefix="autohet-zygote-") as tmp:
            return run_workers(
                argv, count, env=env, cwd=cwd, timeout_s=timeout_s, logs=Path(tmp),
                rank_env=rank_env, rank_argv=rank_argv,
            )  # fmt: skip
    port = _free_port()
    forked = []
    try:
        for rank in range(count):
            extra: dict[str, str] = {}
            if count > 1:
                extra = {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(count),
                    "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
            if rank_env is not None:
                extra.update(rank_env[rank])
            args = argv if rank_argv is None else rank_argv[rank]
            assert args[0] == "-m", args
            forked.append(
                Zygote.spawn(
                    args[1],
                    args[2:],
                    env={**env, **extra},
                    cwd=cwd,
                    logs=logs,
                    name=f"rank{rank}",
                )
            )
        codes = [f.wait(timeout_s) for f in forked]
    finally:
        for f in forked:
            f.kill()
    return [(code, *f.output()) for code, f in zip(codes, forked, strict=True)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
