"""The sha256 of a step directory's files, remembered so recover need not re-read them.

Recover asks every survivor which files of a step it holds and their sha256
(``recovery.executor.hashes_present``). Reading them all again costs a second per
1.5 GB on every host (a host holds its own shards and a partner's), while the
writer hashed each file on its way out (``ckpt.finish``) and a replica receiver
hashed each copy as it landed (``peer.replicate``). Both record it here:
``<step dir>/.autohet-sums``, one line per file, ``sha256 size mtime_ns name``.

An entry counts only while the file's size and mtime (nanoseconds) are those
recorded: a file rewritten, truncated or replaced since is hashed again. What an
entry cannot see is a change that keeps both (a flipped bit on the disk, or
someone restoring the mtime on purpose); the loader verifies every file it reads
against the authenticated manifest anyway, so such a file stops the resume with
its name instead of training on it.

Standard library only: recover runs this module's source on the hosts.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

SUMS = ".autohet-sums"
_SKIP = (SUMS,)


def _read(step_dir: str) -> dict[str, tuple[str, int, int]]:
    out: dict[str, tuple[str, int, int]] = {}
    try:
        with open(os.path.join(step_dir, SUMS), encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split(" ", 3)
                if len(parts) == 4 and len(parts[0]) == 64:
                    out[parts[3]] = (parts[0], int(parts[1]), int(parts[2]))
    except (OSError, ValueError):
        return {}
    return out


def record(step_dir: str, digests: Mapping[str, str]) -> None:
    """Remember ``digests`` (name -> sha256) of files in ``step_dir`` as they are
    now. Best effort: a failure only means the next recover reads them again."""
    try:
        lock = os.open(step_dir, os.O_RDONLY | os.O_DIRECTORY)  # flock on the directory
    except OSError:
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        known = _read(step_dir)
        for name, sha in digests.items():
            try:
                st = os.stat(os.path.join(step_dir, name))
            except OSError:
                continue
            known[name] = (sha, st.st_size, st.st_mtime_ns)
        tmp = os.path.join(step_dir, f".{SUMS}.{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            for name in sorted(known):
                sha, size, mtime = known[name]
                f.write(f"{sha} {size} {mtime} {name}\n")
        os.replace(tmp, os.path.join(step_dir, SUMS))
    except OSError:
        pass
    finally:
        os.close(lock)


def _sha256(path: str) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    except OSError:
        return None  # unreadable: as if absent (recover then takes another copy)
    return h.hexdigest()


def present(step_dir: str, names: Iterable[str] | None = None) -> dict[str, str]:
    """Every regular file of ``step_dir`` (or ``names``) -> its sha256: from the
    record where size and mtime still match, else read (several files at once)."""
    try:
        listed = names if names is not None else os.listdir(step_dir)
    except OSError:
        return {}
    known = _read(step_dir)
    out: dict[str, str] = {}
    todo: list[str] = []
    for name in listed:
        if (
            name in _SKIP
            or name.endswith((".lock", ".autohet-part"))
            or name.startswith(f".{SUMS}")
        ):
            continue
        path = os.path.join(step_dir, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not os.path.isfile(path):
            continue
        hit = known.get(name)
        if hit is not None and hit[1:] == (st.st_size, st.st_mtime_ns):
            out[name] = hit[0]
        else:
            todo.append(name)
    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(lambda n: _sha256(os.path.join(step_dir, n)), todo))
    fresh = {n: d for n, d in zip(todo, digests, strict=True) if d is not None}
    out.update(fresh)
    if fresh:
        record(step_dir, fresh)
    return out


if __name__ == "__main__":  # recover: ``python -c <source> DIR`` prints "sha256  name" lines
    for _name, _sha in sorted(present(sys.argv[1]).items()):
        print(f"{_sha}  {_name}")
