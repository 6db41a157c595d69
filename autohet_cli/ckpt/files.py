"""Checkpoint files on a host's disk: private directories, the job key, listing, verified reads.

Directories are held to ssh's StrictModes rule, because a checkpoint is code as
much as data (DCP unpickles ``.metadata``): the job directory and every directory
above it up to the checkpoint root must belong to this user (or root) and be
writable by nobody else; parents above the root may be writable by others only
with the sticky bit (``/tmp``), which stops others from renaming our entries.
Directories we create are mode 0700, the key 0600.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.futures import Future

from autohet_cli.ckpt.format import (
    COMPLETE,
    KEY_FILE,
    MANIFEST,
    Manifest,
    ManifestAuthError,
    check_key,
    parse_step_dir,
    verified_manifest,
)
from autohet_cli.ckpt.memory import ranks_on_this_host
from autohet_cli.ckpt.ownfiles import DescriptorFiles, open_unchangeable, sha256_fd
from autohet_cli.ckpt.persist import share_cores
from autohet_cli.errors import AutohetError, ConfigError
from autohet_cli.privatedir import make_private_dir
from autohet_cli.yamlio import sha256_file as sha256_file  # the checkpointer's name for it


class CheckpointError(AutohetError):
    """A checkpoint cannot be saved or loaded; the message names the directory or file."""


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


# --------------------------------------------------------------------- private directories


def ensure_private_dir(path: Path, root: Path) -> None:
    """Create ``path`` (0700 for what we create) and check it and its parents.

    ``root`` is where checkpoints start (the checkpoint dir); from there down every
    directory must be ours alone, above it the StrictModes rule with the sticky
    exception applies.
    """
    try:
        why = make_private_dir(path, root)
    except OSError as exc:
        raise CheckpointError(f"cannot create {path}: {exc.strerror or exc}") from None
    if why is not None:
        raise CheckpointError(
            f"refusing checkpoints in {path}: {why}; someone else could plant a "
            "checkpoint that runs code when loaded. Use a directory only you can write "
            "(the default is ~/autohet/checkpoints)"
        )


# --------------------------------------------------------------------- the job key


def read_key(job_dir: Path) -> bytes | None:
    """The job key if this host has it; refuses one others could read or replace.

    The checks are made again on the open descriptor (``O_NOFOLLOW``, ``fstat``) and the
    key read from it: a key renamed into place between a check by path and a read by
    path would be the attacker's, and with it any manifest verifies."""
    path = job_dir / KEY_FILE
    try:
        _check_key_stat(path, path.lstat())  # a device or FIFO is never opened
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:  # ELOOP: swapped for a symlink since the lstat
        raise CheckpointError(f"{path} is not a regular file of yours: refusing it") from None
    with os.fdopen(fd, "rb") as f:
        _check_key_stat(path, os.fstat(fd))
        data = f.read()  # a regular file of ours: its size is what check_key reports
    return check_key(data, str(path))


def _check_key_stat(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise CheckpointError(f"{path} is not a regular file of yours: refusing it")
    if st.st_mode & 0o077:
        raise CheckpointError(
            f"{path} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
            "anyone who reads it can forge checkpoints; chmod 600 it"
        )


def write_key(job_dir: Path, key: bytes) -> bytes:
    """Store ``key`` unless the host has one already (ranks of a host race): returns the
    key now on disk. Written whole to a temp file, then linked into place, so no reader
    ever sees a half-written key."""
    path = job_dir / KEY_FILE
    tmp = job_dir / f".{KEY_FILE}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        got = read_key(job_dir)
        assert got is not None
        return got
    finally:
        tmp.unlink(missing_ok=True)
    return key


# --------------------------------------------------------------------- listing


def incomplete_reason(step_dir: Path, key: bytes | None) -> str | None:
    """Why ``step_dir`` is not a complete checkpoint of this job; None when it is."""
    if not step_dir.is_dir():
        return "no such directory"
    if not (step_dir / COMPLETE).is_file():
        return f"no {COMPLETE} marker: its save did not finish"
    if not (step_dir / MANIFEST).is_file():
        return f"no {MANIFEST}"
    if key is None:
        return (
            f"no job key {step_dir.parent / KEY_FILE} to authenticate it (a step copied "
            f"elsewhere needs its job directory's {KEY_FILE} beside it, mode 0600)"
        )
    try:
        m = verified_manifest((step_dir / MANIFEST).read_text(encoding="utf-8"), key, "")
    except ManifestAuthError:
        return f"{MANIFEST} does not authenticate with this job's key (planted or altered?)"
    except (ConfigError, OSError, ValueError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    if m.step != parse_step_dir(step_dir.name):
        return f"{MANIFEST} says step {m.step}"
    return None


def list_steps(job_dir: Path, key: bytes | None) -> dict[int, str | None]:
    """Step -> None (complete and authentic) or why not, for every ``step-<N>`` dir."""
    if not job_dir.is_dir():
        return {}
    out = {}
    for entry in job_dir.iterdir():
        step = parse_step_dir(entry.name)
        if step is not None and entry.is_dir():
            out[step] = incomplete_reason(entry, key)
    return out


# --------------------------------------------------------------------- verified reads

MAX_READ_THREADS = 8


def default_read_threads(cpus: int | None = None, ranks_on_host: int | None = None) -> int:
    """Threads that check (hash) a rank's files, and read them where the targets are
    on a GPU: the host's cores shared by its ranks (torchrun's ``LOCAL_WORLD_SIZE``),
    1 to ``MAX_READ_THREADS``."""
    ranks = ranks_on_host if ranks_on_host is not None else ranks_on_this_host()
    return share_cores(ranks, cpus, cap=MAX_READ_THREADS)


def read_runs(items: Sequence[Any], storage_data: Any, num_runs: int) -> list[list[Any]]:
    """DCP read items cut into at most ``num_runs`` runs of about equal bytes, in file
    and offset order, so each run reads its stretch of one or more files front to back
    (one big file is read by several runs at once)."""

    def where(item: Any) -> tuple[str, int]:
        info = storage_data[item.storage_index]
        return info.relative_path, info.offset

    ordered = sorted(items, key=where)
    total = sum(storage_data[item.storage_index].length for item in ordered)
    runs: list[list[Any]] = [[]]
    done = 0
    for item in ordered:
        if runs[-1] and len(runs) < num_runs and done >= total * len(runs) / num_runs:
            runs.append([])
        runs[-1].append(item)
        done += storage_data[item.storage_index].length
    return [run for run in runs if run]


def _cuda_device() -> int | None:
    """The current CUDA device if this process has started CUDA, else None."""
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return torch.cuda.current_device() if cuda else None


def run_in_threads(fn: Callable[[Any], Any], args: Sequence[Any], num_threads: int) -> None:
    """``fn(arg)`` for every arg in up to ``num_threads`` threads; raises the first
    failure in ``args``' order (what one thread would have raised), the rest cancelled.

    Worker threads start on CUDA device 0: they are given the caller's device, so
    tensors DCP places on "the current device" land where the caller's would."""
    if len(args) <= 1 or num_threads <= 1:
        for arg in args:
            fn(arg)
        return
    device = _cuda_device()

    def start() -> None:
        if device is not None:
            torch.cuda.set_device(device)

    with ThreadPoolExecutor(min(num_threads, len(args)), "autohet-ckpt-read", start) as pool:
        futures = [pool.submit(fn, arg) for arg in args]
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()


class _OneAtATime:
    """A DCP load planner shared by reading threads: its calls (a lookup, or storing a
    small unpickled object into the state dict) one at a time; the reads, the unpickling
    of tensors and the copies into the targets stay in parallel, outside the lock."""

    def __init__(self, planner: Any) -> None:
        self._planner = planner
        self._lock = threading.Lock()

    def resolve_tensor(self, read_item: Any) -> Any:
        with self._lock:
            return self._planner.resolve_tensor(read_item)

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        with self._lock:
            self._planner.commit_tensor(read_item, tensor)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        with self._lock:
            self._planner.load_bytes(read_item, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class GivenMetadataReader(FileSystemReader):
    """DCP's reader on ``path`` with DCP's metadata handed in (read and checked by the
    caller): ``.metadata`` is never read from disk here."""

    def __init__(self, path: Path, *, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        assert self._metadata.storage_meta is not None
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class VerifyingReader(GivenMetadataReader):
    """DCP reader on this host's step directory: metadata given, files checked before use.

    ``fetch(name, dest)`` brings a file this host lacks from the remote copy (False
    when the copy lacks it too); whatever arrives is checked like the rest.

    ``read_data`` checks the files this rank reads in ``num_threads`` threads, then
    reads them in ``read_threads`` threads (``read_runs``), each through DCP's own
    ``read_data`` on a part of the plan, so resharding, DTensors and the targets'
    devices work as in DCP. Only what this rank reads is checked, and all of it before
    any of it is read: DCP unpickles the non-tensor entries. Each file is opened once
    and hashed through that descriptor, and DCP reads that same descriptor
    (``ckpt.ownfiles``): what was hashed is what is loaded, a rename over the path
    between the two reaches nothing. ``close`` closes the descriptors.

    ``read_threads`` None: ``num_threads`` when this process uses CUDA (a thread's
    copy to the device overlaps another's read), else 1: into CPU targets, parallel
    reads measured slower (each item is unpickled into a fresh buffer and freed again,
    and threads freeing memory pay the kernel's cross-core TLB flushes).
    """

    def __init__(
        self,
        path: Path,
        *,
        metadata: Metadata,
        manifest: Manifest,
        rank: int,
        fetch: Any = None,
        num_threads: int | None = None,
        read_threads: int | None = None,
    ) -> None:
        super().__init__(path, metadata=metadata)
        self._manifest, self._rank, self._fetch = manifest, rank, fetch
        self.num_threads = default_read_threads() if num_threads is None else num_threads
        self.read_threads = read_threads
        self._checked: set[str] = set()
        self.fetched: list[str] = []
        self._fds: dict[str, int] = {}  # name -> the descriptor that was hashed
        self.fs = DescriptorFiles(self._fds, CheckpointError)

    def close(self) -> None:
        """Close the checked files' descriptors (the load is over)."""
        fds = list(self._fds.values())
        self._fds.clear()
        for fd in fds:
            os.close(fd)

    def read_data(self, plan: Any, planner: Any) -> Any:
        needed = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        names = sorted(needed - self._checked)
        fetched = [False] * len(names)

        def check(i: int) -> None:
            fetched[i] = self._check(names[i])

        run_in_threads(check, range(len(names)), self.num_threads)
        self.fetched += [name for name, got in zip(names, fetched, strict=True) if got]
        self._checked.update(names)

        read_threads = self._read_threads()
        runs = read_runs(plan.items, self.storage_data, read_threads)
        if len(runs) <= 1:
            return super().read_data(plan, planner)
        read_part: Callable[[Any, Any], Any] = super().read_data
        shared = _OneAtATime(planner)

        def read(items: list[Any]) -> None:
            read_part(dataclasses.replace(plan, items=items), shared).wait()

        run_in_threads(read, runs, read_threads)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_threads(self) -> int:
        if self.read_threads is not None:
            return self.read_threads
        return self.num_threads if _cuda_device() is not None else 1

    def _check(self, name: str) -> bool:
        """Raises unless ``name`` is here (fetched if need be: returns True) and intact."""
        directory = Path(self.path)
        try:
            entry = self._manifest.file(name)
        except KeyError:
            raise CheckpointError(
                f"{directory}: DCP's metadata names {name}, which {MANIFEST} does not list"
            ) from None
        path = directory / name
        fetched = not path.is_file() and self._fetch is not None and bool(self._fetch(name, path))
        if not os.path.lexists(path):
            raise CheckpointError(
                f"{path} is missing: rank {self._rank} reads it, and host {entry.host} wrote it; "
                f"copy it into {directory} first (autohet recover does)"
            )
        fd = open_unchangeable(path, CheckpointError)
        try:
            digest, size = sha256_fd(fd, entry.num_bytes + 1)  # bounded: the manifest's size
        except OSError as exc:
            os.close(fd)
            raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
        if digest != entry.sha256:
            os.close(fd)
            raise CheckpointError(
                f"{path} is corrupt: its sha256 is {digest}, but {MANIFEST} says {entry.sha256}"
                + (f" ({size} bytes, {entry.num_bytes} listed)" if size != entry.num_bytes else "")
            )
        old = self._fds.pop(name, None)
        self._fds[name] = fd  # DCP reads this descriptor, never the path
        if old is not None:
            os.close(old)
        return fetched
