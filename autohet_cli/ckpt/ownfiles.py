"""A step directory's files opened once, by descriptor: what is hashed is what is read.

A check that hashes a file by path and then hands DCP the path checks one file and
loads another: whoever can rename in the step directory swaps the file between the
two, and DCP unpickles its non-tensor entries (issue 45). Here a file is opened once
(``open_own_file``: the file itself, a regular file, never a symlink, FIFO or device),
hashed through that descriptor, and DCP reads the same descriptor (``DescriptorFiles``,
the ``fs`` of DCP's ``FileSystemReader``): a rename over the path no longer reaches the
load. What could still change the bytes is a write into the same file, so a file
someone else could write is refused (the private-directory rule, per file).

Why descriptors rather than a private copy (as export makes, ``ckpt.verified``): a
resume reads every byte of its rank's files (the optimizer's too), so a copy would
write and read them all again, and double the disk they take; a descriptor costs
nothing beyond the hash the check already made.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem

from autohet_cli.errors import AutohetError
from autohet_cli.privatedir import unsafe_stat_reason

OWN_FILES = (
    "checkpoint files are read only as regular files of the step directory itself: "
    "copy the file there, not a link"
)
_CHUNK = 8 << 20


def open_own_file(path: Path, error: type[AutohetError]) -> int:
    """A read-only descriptor of ``path`` itself, a regular file: a symlink is refused
    (``lstat``, then ``O_NOFOLLOW``), a FIFO or device never opened, and the descriptor
    checked with ``fstat``, so what was swapped in since the ``lstat`` is refused too."""
    try:
        _refuse_other(path, os.lstat(path).st_mode, error)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"{path} is missing; {OWN_FILES}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW: a symlink since the lstat
            raise error(f"{path} is a symbolic link; {OWN_FILES}") from None
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        _refuse_other(path, os.fstat(fd).st_mode, error)
    except BaseException:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return fd


def _refuse_other(path: Path, mode: int, error: type[AutohetError]) -> None:
    if not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
        raise error(f"{path} is {what}; {OWN_FILES}")


def open_unchangeable(path: Path, error: type[AutohetError]) -> int:
    """``open_own_file``, and refused unless only this user (or root) can write the file:
    bytes read after a check through this descriptor are the bytes checked."""
    fd = open_own_file(path, error)
    why = unsafe_stat_reason(path, os.fstat(fd), below_root=True)
    if why is not None:
        os.close(fd)
        raise error(
            f"refusing {path}: {why}; someone else could change it between its check and "
            f"its load. chmod go-w {path} if you trust it"
        )
    return fd


def sha256_fd(fd: int, limit: int) -> tuple[str, int]:
    """The sha256 of the first ``limit`` bytes of ``fd`` read from offset 0 with
    ``pread`` (the descriptor's position is untouched), and how many there were.
    hashlib lets go of the GIL: threads hash in parallel."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    pos = 0
    while pos < limit:
        n = os.preadv(fd, [view[: min(_CHUNK, limit - pos)]], pos)
        if not n:
            break
        h.update(view[:n])
        pos += n
    return h.hexdigest(), pos


class PreadStream(io.RawIOBase):
    """A read-only, seekable stream over a descriptor shared by threads: each stream
    keeps its own position and reads with ``pread``; closing it leaves the descriptor
    open (its owner closes it)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd, self._pos = fd, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = os.preadv(self._fd, [buffer], self._pos)
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos}.get(whence)
        if base is None:
            base = os.fstat(self._fd).st_size
        if base + offset < 0:
            raise OSError(errno.EINVAL, "negative seek position")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


class DescriptorFiles(FileSystem):
    """DCP's file system for reading a step directory through descriptors already
    checked: ``create_stream`` serves the file of that name from its descriptor and
    refuses any other (nothing is opened by path)."""

    def __init__(self, fds: Mapping[str, int], error: type[AutohetError]) -> None:
        super().__init__()
        self._fds, self._error = fds, error

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        fd = self._fds.get(Path(path).name)
        if mode != "rb" or fd is None:
            raise self._error(f"{path}: read before its check (mode {mode!r}); refusing it")
        with io.BufferedReader(PreadStream(fd)) as stream:  # 8 KiB, as open() has
            yield stream
