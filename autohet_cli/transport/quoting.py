"""The remote command line for an argv list: every element quoted, nothing interpreted.

sshd hands the command string to the user's login shell (``$SHELL -c``), so argv,
environment values and the working directory are each passed through
``shlex.quote``; the only unquoted text is our own fixed syntax. A leading ``~/``
of the working directory stays unquoted so the remote shell expands it to the
home directory (``Host.workdir`` defaults to ``~/autohet``); the rest is quoted.

Shape (POSIX sh, bash, dash, zsh)::

    [echo __autohet_pid__ $$ &&] [printf '%s\n' $$ > PIDFILE &&] [cd -- DIR &&]
        exec env -- [K=V ...] ARGV...

``exec`` keeps the shell's pid for the command; sshd made that shell a session
leader, so the pid is also the process group to signal on kill.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

PID_MARKER = "__autohet_pid__"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def quote_path(path: str) -> str:
    """Quote a remote path, leaving a leading ``~`` or ``~/`` for the shell to expand."""
    if path == "~":
        return "~"
    if path.startswith("~/"):
        rest = path[2:]
        return "~/" + shlex.quote(rest) if rest else "~/"
    return shlex.quote(path)


def remote_command(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    announce_pid: bool = False,
    pid_file: str | None = None,
) -> str:
    """The shell command that runs exactly ``argv`` with ``env`` added, in ``cwd``
    (``pid_file``: its pid written there first; nothing runs if that fails)."""
    check_argv(argv, env=env, cwd=cwd)
    parts = []
    if announce_pid:
        parts.append(f"echo {PID_MARKER} $$")
    if pid_file is not None:
        _no_nul(pid_file, "pid file")
        parts.append(f"printf '%s\\n' $$ > {quote_path(pid_file)}")
    if cwd is not None:
        parts.append(f"cd -- {quote_path(cwd)}")
    words = ["exec", "env", "--"]
    words += [shlex.quote(f"{k}={v}") for k, v in (env or {}).items()]
    words += [shlex.quote(a) for a in argv]
    parts.append(" ".join(words))
    return " && ".join(parts)


def check_argv(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None
) -> None:
    """Reject what no command line can carry (programming errors, hence ValueError)."""
    if isinstance(argv, str):
        raise ValueError(f"argv must be a list of strings, not the string {argv!r}")
    if not argv:
        raise ValueError("argv is empty")
    if "=" in argv[0]:
        raise ValueError(f"program name {argv[0]!r} contains '='; env would read it as a variable")
    for k, v in (env or {}).items():
        if not _ENV_NAME.match(k):
            raise ValueError(f"environment variable name {k!r} is not a valid identifier")
        _no_nul(v, f"value of {k}")
    for a in argv:
        _no_nul(a, "argv")
    if cwd is not None:
        if not cwd:
            raise ValueError("cwd is empty")
        _no_nul(cwd, "cwd")


def _no_nul(value: str, what: str) -> None:
    if "\0" in value:
        raise ValueError(f"{what} contains a NUL byte: {value!r}")


def parse_pid_line(line: str) -> int | None:
    """The pid from our announce line, or None if ``line`` is ordinary output."""
    head, _, tail = line.partition(" ")
    if head == PID_MARKER and tail.isascii() and tail.isdigit() and int(tail) > 1:
        return int(tail)  # never 0 or 1: `kill -- -0`/`-1` would hit far more than the command
    return None


def sftp_path(path: str) -> str:
    """SFTP paths are relative to the login directory: ``~/x`` becomes ``x``."""
    if path == "~":
        return "."
    if path.startswith("~/"):
        return path[2:] or "."
    return path
