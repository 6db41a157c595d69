"""Checkpoint bytes verified where they are used: what is hashed is what is then parsed.

DCP's own reader opens ``.metadata`` and the data files by path. A check that hashes a
file and then hands DCP its path checks one file and loads another: whoever can write
the step directory renames a pickle over ``.metadata`` between the two and DCP runs it
(issue 45: ``os.system`` on the first try), or other weights over a data file and they
are exported silently. Here nothing is opened by path after its check:

* ``load_metadata`` reads ``.metadata`` once into memory, checks that buffer's sha256
  against the authenticated manifest and unpickles that same buffer, with
  ``MetadataUnpickler``. ``VerifiedReader`` hands DCP that object (``read_metadata``).
* ``verified_copy`` reads each data file once, hashing every byte and writing the byte
  ranges the caller will load into a file of its own in a private directory; DCP then
  reads that directory, whose files nobody else can change, and only once every file's
  sha256 was the manifest's.

Why a private copy rather than a reader that parses its own in-memory buffers:
DCP's ``read_data`` (stream transforms, ``torch.load`` of each item, resharding into the
targets) stays DCP's own, reached only through the public ``FileSystemReader(path)`` and
its ``read_metadata``, so it works alike in torch 2.8 to 2.13 and needs no copy of torch's
internals; and the copy is verified once for all the loads of an export, where per-load
buffers would re-read and re-hash whole files (optimizer state included) for each output
file. Only the ranges that will be loaded are written (a sparse file, holes elsewhere), so
the copy costs about the exported model's bytes on disk, not the optimizer's.

Files are opened with ``O_NOFOLLOW`` and checked with ``fstat`` on the open descriptor
(``open_own_file``): a symlink, FIFO or device in a step directory is refused by name.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import pickle
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from autohet_cli.ckpt.files import (
    CheckpointError,
    GivenMetadataReader,
    default_read_threads,
    run_in_threads,
)
from autohet_cli.ckpt.format import MANIFEST, METADATA, Manifest, ManifestFile
from autohet_cli.ckpt.ownfiles import OWN_FILES as OWN_FILES
from autohet_cli.ckpt.ownfiles import open_own_file
from autohet_cli.errors import AutohetError
from autohet_cli.privatedir import make_private_dir

_CHUNK = 8 << 20
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# What DCP's .metadata pickles hold, written by torch 2.8 to 2.13 (tensors, DTensor
# shards, optimizer state and the other non-tensor entries alike).
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            (_DCP_METADATA, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # torch.strided and the like, by name
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)
# StorageMeta.checkpoint_id may be the writer's Path; Python 3.13 pickles it from
# pathlib._local. Paths are only values here: nothing is opened through them.
_PATHS = ("PosixPath", "PurePosixPath")


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else.

    The manifest's HMAC already vouches for these bytes, so this is a second wall: a
    stolen job key, or a writer bug, could make a ``.metadata`` that verifies, and a plain
    unpickler would run whatever callable it names. This one resolves only DCP's
    metadata classes, ``torch.Size``, torch's dtypes and layouts, plain containers and
    paths (the set torch 2.8 to 2.13 write, ``_ALLOWED``); constructing any of them runs
    no code of the file's choosing. Anything else is refused by name.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        if module in ("pathlib", "pathlib._local") and name in _PATHS:
            return getattr(pathlib, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def _corrupt(path: Path, digest: str, entry: ManifestFile, error: type[AutohetError]) -> None:
    if digest != entry.sha256:
        raise error(
            f"{path} is corrupt or was changed: its sha256 is {digest}, but {MANIFEST} says "
            f"{entry.sha256}; nothing was read from it. Copy this step's files again from "
            "the host that wrote them (autohet recover does), or export another step"
        )


def load_metadata(
    step_dir: Path, manifest: Manifest, error: type[AutohetError] = CheckpointError
) -> Metadata:
    """DCP's metadata of ``step_dir``: ``.metadata`` read once, its sha256 checked against
    ``manifest`` (already authenticated), then unpickled from those same bytes."""
    entry = manifest.file(METADATA)
    path = step_dir / METADATA
    with os.fdopen(open_own_file(path, error), "rb") as f:
        try:
            data = f.read(entry.num_bytes + 1)  # bounded: the manifest says how long it is
        except OSError as exc:
            raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    _corrupt(path, hashlib.sha256(data).hexdigest(), entry, error)
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # bytes the manifest vouches for: a writer's bug, named
        raise error(
            f"{path}: not loaded: {exc}. Its bytes are those its manifest lists; export it "
            "with the autohet and torch versions that wrote it, or report it"
        ) from None
    if not isinstance(metadata, Metadata):
        raise error(f"{path}: holds a {type(metadata).__name__}, not DCP's metadata")
    return metadata


class VerifiedReader(GivenMetadataReader):
    """DCP's reader on a ``verified_copy``, with the metadata ``load_metadata`` verified:
    ``.metadata`` is never read from disk again."""


def loaded_ranges(
    metadata: Metadata, entries: Collection[str], manifest: Manifest, error: type[AutohetError]
) -> dict[str, list[tuple[int, int]]]:
    """File name -> merged, sorted (start, end) byte ranges that hold ``entries``."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn not in entries:
            continue
        name = info.relative_path
        try:
            manifest.file(name)
        except KeyError:
            raise error(f"DCP's metadata names {name!r}, which {MANIFEST} does not list") from None
        spans.setdefault(name, []).append((int(info.offset), int(info.offset + info.length)))
    merged: dict[str, list[tuple[int, int]]] = {}
    for name, ranges in spans.items():
        out: list[tuple[int, int]] = []
        for a, b in sorted(ranges):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        merged[name] = out
    return merged


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def copy_verified(
    src: Path,
    dest: Path,
    entry: ManifestFile,
    spans: list[tuple[int, int]],
    error: type[AutohetError] = CheckpointError,
) -> None:
    """Read ``src`` once: every byte into the sha256, the bytes in ``spans`` into ``dest``
    (new, 0600) at their offsets. Raises ``error`` unless the sha256 is ``entry``'s."""
    h = hashlib.sha256()
    limit = entry.num_bytes + 1  # a file growing as we read is refused, not read forever
    with os.fdopen(open_own_file(src, error), "rb", buffering=0) as f:
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            pos, i = 0, 0
            buf = bytearray(_CHUNK)
            while pos < limit:
                try:
                    n = f.readinto(memoryview(buf)[: min(_CHUNK, limit - pos)])
                except OSError as exc:
                    raise error(f"{src}: cannot read: {exc.strerror or exc}") from None
                if not n:
                    break
                chunk = memoryview(buf)[:n]
                h.update(chunk)
                end = pos + n
                while i < len(spans) and spans[i][0] < end:
                    a, b = max(spans[i][0], pos), min(spans[i][1], end)
                    if a < b:
                        _pwrite_all(out, chunk[a - pos : b - pos], a)
                    if spans[i][1] > end:
                        break
                    i += 1
                pos = end
            os.ftruncate(out, pos)
        finally:
            os.close(out)
    _corrupt(src, h.hexdigest(), entry, error)


def _private_dir(near: Path, error: type[AutohetError]) -> Path:
    """A new directory only this user can change: beside ``near`` (where the export goes,
    so the copy lands on a disk with room for the model), else in the system's temp
    directory; privatedir's StrictModes rule decides, so nobody can swap it."""
    why: list[str] = []
    for base in (near, Path(tempfile.gettempdir())):
        try:
            d = Path(tempfile.mkdtemp(prefix=".autohet-verified-", dir=base))
        except OSError as exc:
            why.append(f"{base}: {exc.strerror or exc}")
            continue
        unsafe = make_private_dir(d, d)
        if unsafe is None:
            return d
        shutil.rmtree(d, ignore_errors=True)
        why.append(unsafe)
    raise error(
        f"no private directory for the checkpoint's verified copy ({'; '.join(why)}); "
        "export into a directory only you can write, or set TMPDIR to one"
    )


@contextmanager
def verified_copy(
    step_dir: Path,
    manifest: Manifest,
    metadata: Metadata,
    entries: Collection[str],
    *,
    near: Path,
    error: type[AutohetError] = CheckpointError,
    num_threads: int | None = None,
) -> Iterator[Callable[[], VerifiedReader]]:
    """Copy what ``entries`` (DCP keys) need of ``step_dir``'s data files into a private
    directory, every file verified; yields a maker of readers on it; removes it after.

    Files are read in threads (hashlib lets go of the GIL); the first failure in file
    order is raised, naming its file."""
    ranges = loaded_ranges(metadata, entries, manifest, error)
    directory = _private_dir(near, error)
    try:
        names = sorted(ranges)

        def copy(name: str) -> None:
            src, dest = step_dir / name, directory / name
            copy_verified(src, dest, manifest.file(name), ranges[name], error)

        threads = default_read_threads() if num_threads is None else num_threads
        run_in_threads(copy, names, threads)
        yield lambda: VerifiedReader(directory, metadata=metadata)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
