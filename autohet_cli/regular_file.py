"""Read input files that must be regular files, never waiting on what is not one (pure).

A path a user names (``--init-from``'s config.json, safetensors files and index)
may be a named pipe, a device or a symlink loop. ``open()`` on a FIFO waits for a
writer forever and ``/dev/zero`` never ends, so a launch hung for 500 s before
any timeout ran. Here the path is opened with ``O_NONBLOCK`` (a FIFO opens at
once), checked with ``fstat`` on the open descriptor (no race between the check
and the read), and refused unless it is a regular file; reads are bounded.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from autohet_cli.errors import AutohetError, ConfigError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def path_kind(path: str | Path) -> str | None:
    """What is at ``path`` ("a regular file", "a named pipe (FIFO)", ...), links
    followed; None when nothing is (a dangling link included). For messages: a FIFO
    fails ``is_file()`` as a missing file does, and "no such file" sends the user
    looking for a typo in a path that is right."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return "a regular file" if stat.S_ISREG(mode) else _kind(mode)


def open_regular(path: str | Path, error: type[AutohetError] = ConfigError) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (symlinks to
    one are followed); otherwise ``error`` naming the path and what it is."""
    p = Path(path)
    try:
        _refuse_special(p, os.stat(p).st_mode, error)  # a device is never even opened
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"{p}: cannot read: no such file") from None
    except OSError as exc:  # ELOOP (a symlink loop), EACCES, ...
        raise error(f"{p}: cannot read: {exc.strerror or exc}") from None
    try:
        _refuse_special(p, os.fstat(fd).st_mode, error)  # swapped since the stat
    except BaseException:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return fd


def _refuse_special(p: Path, mode: int, error: type[AutohetError]) -> None:
    if not stat.S_ISREG(mode):
        raise error(f"{p}: is {_kind(mode)}, not a regular file")


def read_regular(
    path: str | Path, max_bytes: int, error: type[AutohetError] = ConfigError
) -> bytes:
    """The bytes of the regular file ``path``, refused if larger than ``max_bytes``."""
    fd = open_regular(path, error)
    with os.fdopen(fd, "rb") as fh:
        try:
            data = fh.read(max_bytes + 1)
        except OSError as exc:
            raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise error(
            f"{path}: larger than such a file ever is ({max_bytes} bytes); is it the right file?"
        )
    return data
