"""``DIR.partial/``: where ``autohet data prepare`` works until the result is whole.

Layout, all of it the preparer's own, and only ever reused when it is: the directory
goes through ``privatedir`` like checkpoint and cache directories (ours, 0700, nobody
else able to change it or a directory above it), because a part found here becomes
training data as is. A directory that fails the rule is refused with what to do, as
checkpoints are; nothing in it is deleted, since it is not ours to delete.

- ``settings.json``: what decides an input's tokens (tokenizer sha256, end-of-document
  id, dtype, text key, document separator); a later run reuses this directory only
  under the same settings, and is refused rather than mixed in under others.
- ``parts/<sha256>.bin``: one input's tokens, keyed by the input's content, and
  ``parts/<sha256>.json``, its done marker (written after the part, so a marker
  always has its whole part); ``<sha256>.bin.tmp`` is a part being written. The
  marker records the sha256 of the part's bytes and the input range they came from;
  a part is reused only when its bytes hash the same when read back (a size that
  matches proves nothing: a part of 5,000 copies of one id has the right size), and
  the bytes copied into ``tokens.bin`` are hashed again as they are copied, so what
  is published is what was checked. A part that fails is re-encoded.
- ``out/``: ``tokens.bin`` + ``meta.json`` assembled from the parts, then renamed to
  ``DIR`` in one step, after which this directory is deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from autohet_cli.dataset import DataError
from autohet_cli.privatedir import make_private_dir

COPY_BUFFER_BYTES = 1 << 24


@dataclass(frozen=True, slots=True, kw_only=True)
class PartStats:
    num_documents: int
    num_tokens: int


class PartWriter:
    """One input's tokens, appended to ``parts/<sha256>.bin.tmp`` until finished."""

    def __init__(self, partial: PartialDir, sha256: str) -> None:
        self.partial = partial
        self.final = partial.parts / f"{sha256}.bin"
        self.tmp = partial.parts / f"{sha256}.bin.tmp"
        self.marker = partial.parts / f"{sha256}.json"
        self.sha256 = sha256
        self.itemsize = partial.itemsize
        self.file = self.tmp.open("wb")
        self.digest = hashlib.sha256()
        self.num_documents = 0
        self.num_tokens = 0

    def write(self, data: bytes, *, num_documents: int) -> None:
        self.file.write(data)
        self.digest.update(data)
        self.num_documents += num_documents
        self.num_tokens += len(data) // self.itemsize

    def finish(self, path: Path, num_bytes: int) -> PartStats:
        """Publish the part, then its done marker (so a marker always has its tokens),
        recording the hash of the bytes written and the input range they encode."""
        self.file.close()
        os.replace(self.tmp, self.final)
        marker = {
            "path": str(path),
            "sha256": self.sha256,
            "input": {"sha256": self.sha256, "start": 0, "end": num_bytes},
            "part_sha256": self.digest.hexdigest(),
            "documents": self.num_documents,
            "tokens": self.num_tokens,
        }
        _write_json(self.marker, marker)
        self.partial.digests[self.sha256] = self.digest.hexdigest()
        return PartStats(num_documents=self.num_documents, num_tokens=self.num_tokens)


class PartialDir:
    """``DIR.partial``: settings, finished parts, and the assembly of the result."""

    def __init__(self, root: Path, dtype: str) -> None:
        self.root = root
        self.parts = root / "parts"
        self.itemsize = np.dtype(dtype).itemsize
        self.digests: dict[str, str] = {}  # part sha256 of each part checked or written
        self.rejected: dict[str, str] = {}  # input sha256 -> why its part was not reused

    @classmethod
    def open(cls, root: Path, settings: dict[str, Any]) -> PartialDir:
        """Create it, or resume it under the same settings.

        Parts finished under other settings are never mixed in: that is refused. A
        directory with none finished (a run that failed early) is simply reset."""
        partial = cls(root, settings["dtype"])
        if root.is_symlink() or (root.exists() and not root.is_dir()):
            raise DataError(
                f"{root} is a {'symbolic link' if root.is_symlink() else 'file'}, where "
                "prepare keeps its unfinished work in a directory of its own; move or "
                "delete it, or pass another --out"
            )
        _make_private(root, root, created=not root.exists())
        path = root / "settings.json"
        recorded = _read_settings(path, root)
        if recorded is None and root.exists() and any(root.iterdir()):
            raise DataError(
                f"{root} exists but is not an unfinished `autohet data prepare` run "
                "(it has no settings.json); move or delete it"
            )
        if recorded is not None and recorded != settings:
            changed = [
                f"{key}: was {recorded.get(key)!r}, now {value!r}"
                for key, value in settings.items()
                if recorded.get(key) != value
            ]
            if partial.num_finished():
                raise DataError(
                    f"{root} holds an unfinished run with other settings "
                    f"({'; '.join(changed)}); rerun with the same options to resume it, "
                    f"or delete {root} to start over"
                )
            shutil.rmtree(partial.parts, ignore_errors=True)
        _make_private(partial.parts, root, created=False)
        try:
            _write_json(path, settings)
        except OSError as exc:
            raise DataError(
                f"cannot create {root} ({exc.strerror}); pass an --out in a writable directory"
            ) from exc
        return partial

    def num_finished(self) -> int:
        return sum(1 for _ in self.parts.glob("*.json"))

    def discard_if_unfinished(self) -> None:
        """Remove the directory if no input was finished in it: nothing to resume."""
        if not self.num_finished():
            shutil.rmtree(self.root, ignore_errors=True)

    def finished(self, sha256: str, input_bytes: int) -> PartStats | None:
        """The stats of the finished part of the input with content ``sha256`` (and
        ``input_bytes`` bytes), when its bytes hash as recorded; else None (redo it).
        Why a part with a done marker is not reused goes to ``rejected``."""
        marker_path = self.parts / f"{sha256}.json"
        if not marker_path.exists():
            return None  # never finished: nothing to say
        try:
            marker = json.loads(marker_path.read_text(encoding="utf-8"))
            stats = PartStats(
                num_documents=int(marker["documents"]), num_tokens=int(marker["tokens"])
            )
            recorded = marker.get("part_sha256")
            source = marker.get("input")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.rejected[sha256] = "its done marker is unreadable"
            return None
        wanted = {"sha256": sha256, "start": 0, "end": input_bytes}
        why: str | None
        if not isinstance(recorded, str) or not isinstance(source, dict):
            why = "its done marker records no sha256 of its tokens (not written by this prepare)"
        elif source != wanted:
            why = f"its done marker is for input range {source}, not {wanted}"
        else:
            why = self._check_bytes(sha256, stats.num_tokens * self.itemsize, recorded)
        if why is not None:
            self.rejected[sha256] = why
            return None
        self.digests[sha256] = recorded
        return stats

    def _check_bytes(self, sha256: str, size: int, recorded: str) -> str | None:
        try:
            with _open_part(self.parts / f"{sha256}.bin") as part:
                if os.fstat(part.fileno()).st_size != size:
                    return f"its tokens file is not the {size:,} bytes its marker records"
                digest = hashlib.sha256()
                while block := part.read(COPY_BUFFER_BYTES):
                    digest.update(block)
        except (OSError, DataError) as exc:
            return f"its tokens file cannot be read ({exc})"
        if digest.hexdigest() != recorded:
            return "its bytes do not hash to the sha256 recorded when it was finished"
        return None

    def writer(self, sha256: str) -> PartWriter:
        return PartWriter(self, sha256)

    def publish(self, shas: list[str], meta: dict[str, Any], out_dir: Path) -> None:
        """Concatenate the parts in input order, then rename the result to ``out_dir``."""
        staging = self.root / "out"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        with (staging / "tokens.bin").open("wb") as out:
            for sha256 in shas:
                self._copy_checked(sha256, out, staging, out_dir)
            out.flush()
            os.fsync(out.fileno())
        _write_json(staging / "meta.json", meta)
        if os.path.lexists(out_dir):  # appeared while we worked (rename replaces an empty dir)
            raise DataError(f"--out {out_dir} appeared while preparing; the result is in {staging}")
        os.rename(staging, out_dir)
        shutil.rmtree(self.root)

    def _copy_checked(self, sha256: str, out: BinaryIO, staging: Path, out_dir: Path) -> None:
        """Append a part to ``out``, hashing the very bytes written: a part changed since
        it was checked (or written) is refused, and its marker removed so that the same
        command re-encodes its input."""
        path = self.parts / f"{sha256}.bin"
        digest = hashlib.sha256()
        with _open_part(path) as part:
            while block := part.read(COPY_BUFFER_BYTES):
                digest.update(block)
                out.write(block)
        if digest.hexdigest() != self.digests.get(sha256):
            (self.parts / f"{sha256}.json").unlink(missing_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            raise DataError(
                f"{path} changed while preparing (its bytes no longer hash as checked); "
                f"{out_dir} was not written: run the same command again to re-encode its input"
            )


def _make_private(path: Path, root: Path, *, created: bool) -> None:
    """``path`` made (0700) or checked by the rule checkpoints follow (``privatedir``);
    refused, with what to do, when someone else could change it or a directory above
    it. ``created``: it did not exist before, so an empty one is removed on refusal."""
    try:
        why = make_private_dir(path, root)
    except OSError as exc:
        raise DataError(
            f"cannot create {path} ({exc.strerror or exc}); pass an --out in a writable directory"
        ) from exc
    if why is None and path.is_symlink():  # replaced between our check and mkdir
        why = f"{path} is a symbolic link"
    if why is not None:
        if created:
            with contextlib.suppress(OSError):
                path.rmdir()
        raise DataError(
            f"refusing {root} for unfinished work: {why}. prepare reuses the tokens it "
            "finds there, so anyone else able to change it could plant training data: "
            f"delete {root} if you did not make it, or pass another --out in a directory "
            "only you can write"
        )


def _open_part(path: Path) -> BinaryIO:
    """A part for reading: never through a link, never a FIFO or device, only our own."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    part = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        part.close()
        raise DataError(f"{path} is not a regular file of yours")
    return part


def _read_settings(path: Path, root: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable ({exc}); delete {root} to start over") from exc
    if not isinstance(recorded, dict):
        raise DataError(f"{path}: not a JSON object; delete {root} to start over")
    return recorded


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Atomically: a reader sees the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
