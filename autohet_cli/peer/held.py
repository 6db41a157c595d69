"""Whether a replica receiver holds the very bytes a push names: their sha256, not their size.

Issue 45: the receiver answered HAVE when a file of the pushed size was in place, so
a stale file of that size (a step a resume set aside, say) counted as the copy, the
manifest listed it, and once the origin host was lost recover found no good copy.
HAVE now means the bytes there hash to the sha256 the sender's authenticated header
names; anything else is received and replaces the file (``peer.landing``).

Hashing a shard again at every push costs a second per 1-2 GB, so a digest is kept
in this process (never on disk, where a record could be edited along with the file),
keyed by what a different file cannot share: device and inode, size, and mtime and
ctime in nanoseconds. The ctime is the kernel's (no call sets it back, unlike the
mtime that ``ckpt.sums``'s record trusts), and an entry counts only when the file
last changed RACY_NS before it was read: file systems keep coarse times, and a
change within the same tick as the reading would otherwise pass for the old bytes.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

RACY_NS = 2_000_000_000  # coarser than any file system's times (FAT's 2 s included)
_CHUNK = 8 << 20
_MAX_ENTRIES = 65536  # past this the cache starts over (one entry per file landed)
_now_ns = time.time_ns  # the wall clock, as file times are (tests move it)

_Ident = tuple[int, int, int, int, int]


def _ident(st: os.stat_result) -> _Ident:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True, slots=True)
class _Seen:
    ident: _Ident
    sha256: str
    read_at_ns: int  # wall clock when the reading began

    def still(self, st: os.stat_result) -> bool:
        changed = max(st.st_mtime_ns, st.st_ctime_ns)
        return self.ident == _ident(st) and changed < self.read_at_ns - RACY_NS


class HeldFiles:
    """sha256 of files in place, hashed from their bytes, remembered while they
    provably stay the same (see the module doc). Safe from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, _Seen] = {}

    def holds(self, path: Path, nbytes: int, sha256: str) -> bool:
        """Whether ``path`` is a regular file of ``nbytes`` bytes hashing to ``sha256``."""
        try:
            st = os.lstat(path)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
            return False
        key = str(path)
        with self._lock:
            seen = self._seen.get(key)
        if seen is not None and seen.still(st):
            return seen.sha256 == sha256
        got = self._hash(path, st)
        if got is None:
            return False
        with self._lock:
            if len(self._seen) >= _MAX_ENTRIES:
                self._seen.clear()
            self._seen[key] = got
        return got.sha256 == sha256

    @staticmethod
    def _hash(path: Path, st: os.stat_result) -> _Seen | None:
        """The file's digest, if it stayed the file ``st`` describes while it was read."""
        read_at = _now_ns()
        digest = hashlib.sha256()
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        try:
            if _ident(os.fstat(fd)) != _ident(st):
                return None  # replaced between the look and the open
            with os.fdopen(os.dup(fd), "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
            if _ident(os.fstat(fd)) != _ident(st):
                return None  # written while it was read
        except OSError:
            return None
        finally:
            os.close(fd)
        return _Seen(_ident(st), digest.hexdigest(), read_at)
