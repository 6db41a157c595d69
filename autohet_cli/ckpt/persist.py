"""Writing a step's files at the disk's speed: several DCP writer threads per rank,
each file hashed on its way out (no read-back), everything fsynced.

``HashingFileSystem`` is DCP's own ``FileSystem`` with each written stream wrapped
so the sha256 and the byte count are taken from the bytes DCP writes; DCP's
``FileSystemWriter`` keeps doing the planning, the splitting into
``__<rank>_<n>.distcp`` files (one per writer thread), the fsyncs and the
``.metadata`` rename. Reading a 2.4 GB file back to hash it costs 2 s on one core
of this project's CI machine and 12 s for an H100 host's 14.8 GB; hashing the
outgoing bytes in the writer threads costs nothing extra in wall time.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from autohet_cli.ckpt.steptext import after
from autohet_cli.errors import ConfigError

MAX_WRITER_THREADS = 8  # DCP's FileSystemWriter reached an H100 host's disk speed with 8
WRITERS_ENV = "AUTOHET_CHECKPOINT_WRITERS"  # a fixed count (a network file system may want 1)


def writer_threads(
    ranks_on_host: int, cpus: int | None = None, env: Mapping[str, str] | None = None
) -> int:
    """Writer threads (and data files) per rank: ``$AUTOHET_CHECKPOINT_WRITERS``, else
    the host's cores shared by its ranks, 1 to 8."""
    given = (os.environ if env is None else env).get(WRITERS_ENV, "").strip()
    if given:
        if not given.isdigit() or not 1 <= int(given) <= 64:
            raise ConfigError(f"${WRITERS_ENV}={given!r}: expected a number of threads, 1 to 64")
        return int(given)
    return share_cores(ranks_on_host, cpus, cap=MAX_WRITER_THREADS)


def share_cores(ranks_on_host: int, cpus: int | None = None, *, cap: int) -> int:
    """The host's cores shared by its ranks, 1 to ``cap`` (writer and reader threads)."""
    cores = cpus if cpus is not None else (os.cpu_count() or 1)
    return max(1, min(cap, cores // max(1, ranks_on_host)))


@dataclass(frozen=True, slots=True)
class Written:
    """One file as it went out: its sha256 and size."""

    sha256: str
    nbytes: int


class _HashingStream:
    """A write stream that hashes what passes through. A seek away from the end
    (DCP never does one) makes the digest unusable: the file is then hashed from
    disk instead (``HashingFileSystem.written`` leaves it out)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._sha = hashlib.sha256()
        self.nbytes = 0
        self.broken = False

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        view = memoryview(data).cast("B")
        written = len(view) if n is None else n
        self._sha.update(view[:written])
        self.nbytes += written
        return written

    def seek(self, offset: int, whence: int = 0) -> int:
        if not (whence == 0 and offset == self.nbytes) and not (whence == 1 and offset == 0):
            self.broken = True
        return int(self._raw.seek(offset, whence))

    def hexdigest(self) -> str:
        return self._sha.hexdigest()

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self._raw, name)


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording every written file's sha256 by name."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._written: dict[str, Written] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode and "a" not in mode:
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
        if not stream.broken and "a" not in mode:
            with self._lock:
                self._written[Path(path).name] = Written(stream.hexdigest(), stream.nbytes)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:  # DCP writes .metadata.tmp and renames it
            got = self._written.pop(Path(path).name, None)
            if got is not None:
                self._written[Path(new_path).name] = got

    def written(self) -> dict[str, Written]:
        with self._lock:
            return dict(self._written)


def hashing_writer(path: Path, *, thread_count: int) -> tuple[FileSystemWriter, HashingFileSystem]:
    """DCP's writer on ``path`` with ``thread_count`` threads, fsyncing every file, its
    streams hashed. ``overwrite``: the step's temporary directory is emptied first."""
    writer = FileSystemWriter(path, sync_files=True, thread_count=thread_count, overwrite=True)
    fs = HashingFileSystem()
    writer.fs = fs  # the attribute every admitted torch's writer opens its streams through
    return writer, fs


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveRecord:
    """One save, as users see it in metrics.jsonl and the log.

    ``blocked_s``: training stood still (the slowest rank): agreeing on the step,
    waiting for the previous save if it was still in flight, the snapshot into host
    memory (the whole write when the save ran synchronously).
    ``persist_s``: from the save's start until the step was durable and COMPLETE on
    every host. ``nbytes``: every rank's files of the step."""

    step: int
    blocked_s: float
    persist_s: float
    nbytes: int
    synchronous: bool = False
    alloc_s: float = 0.0  # of blocked_s: allocating the snapshot buffers (a run's first save)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "ckpt_blocked_s": round(self.blocked_s, 4),
            "ckpt_persist_s": round(self.persist_s, 4),
            "ckpt_bytes": self.nbytes,
        }

    def describe(self) -> str:
        rate = self.nbytes / self.persist_s / 1e9 if self.persist_s > 0 else 0.0
        how = "synchronous save" if self.synchronous else "training blocked"
        return (
            f"checkpoint step {self.step}: the state {after(self.step)}, "
            f"{self.nbytes / 1e9:.2f} GB durable after "
            f"{self.persist_s:.2f} s ({rate:.2f} GB/s), {how} {self.blocked_s:.2f} s"
        )


_quiet = False  # the hook below is installed once per process


def quiet_writer_thread_errors() -> None:
    """A disk error in one of DCP's extra writer threads (``_write_files_from_queue``)
    reaches the save as a missing result, which the save reports with its cause
    (``ckpt.failures``); Python would also print that thread's traceback into the
    log, where it reads like a crash. Only those threads' OSErrors are kept quiet;
    anything else still prints."""
    global _quiet
    if _quiet:
        return
    _quiet = True
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else ""
        if "_write_files_from_queue" in name and isinstance(args.exc_value, OSError):
            return
        previous(args)

    threading.excepthook = hook
