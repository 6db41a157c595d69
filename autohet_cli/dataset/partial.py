"""``DIR.partial/``: where ``autohet data prepare`` works until the result is whole.

Layout, all of it the preparer's own:

- ``settings.json``: what decides an input's tokens (tokenizer sha256, end-of-document
  id, dtype, text key, document separator); a later run reuses this directory only
  under the same settings, and is refused rather than mixed in under others.
- ``parts/<sha256>.bin``: one input's tokens, keyed by the input's content, and
  ``parts/<sha256>.json``, its done marker (written after the part, so a marker
  always has its whole part); ``<sha256>.bin.tmp`` is a part being written.
- ``out/``: ``tokens.bin`` + ``meta.json`` assembled from the parts, then renamed to
  ``DIR`` in one step, after which this directory is deleted.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autohet_cli.dataset import DataError

COPY_BUFFER_BYTES = 1 << 24


@dataclass(frozen=True, slots=True, kw_only=True)
class PartStats:
    num_documents: int
    num_tokens: int


class PartWriter:
    """One input's tokens, appended to ``parts/<sha256>.bin.tmp`` until finished."""

    def __init__(self, parts: Path, sha256: str, itemsize: int) -> None:
        self.final = parts / f"{sha256}.bin"
        self.tmp = parts / f"{sha256}.bin.tmp"
        self.marker = parts / f"{sha256}.json"
        self.sha256 = sha256
        self.itemsize = itemsize
        self.file = self.tmp.open("wb")
        self.num_documents = 0
        self.num_tokens = 0

    def write(self, data: bytes, *, num_documents: int) -> None:
        self.file.write(data)
        self.num_documents += num_documents
        self.num_tokens += len(data) // self.itemsize

    def finish(self, path: Path) -> PartStats:
        """Publish the part, then its done marker (so a marker always has its tokens)."""
        self.file.close()
        os.replace(self.tmp, self.final)
        marker = {
            "path": str(path),
            "sha256": self.sha256,
            "documents": self.num_documents,
            "tokens": self.num_tokens,
        }
        _write_json(self.marker, marker)
        return PartStats(num_documents=self.num_documents, num_tokens=self.num_tokens)


class PartialDir:
    """``DIR.partial``: settings, finished parts, and the assembly of the result."""

    def __init__(self, root: Path, dtype: str) -> None:
        self.root = root
        self.parts = root / "parts"
        self.itemsize = np.dtype(dtype).itemsize

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
        try:
            partial.parts.mkdir(parents=True, exist_ok=True)
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

    def finished(self, sha256: str) -> PartStats | None:
        """The stats of a finished part whose file is whole, else None (redo it)."""
        try:
            marker = json.loads((self.parts / f"{sha256}.json").read_text(encoding="utf-8"))
            stats = PartStats(
                num_documents=int(marker["documents"]), num_tokens=int(marker["tokens"])
            )
            size = (self.parts / f"{sha256}.bin").stat().st_size
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return stats if size == stats.num_tokens * self.itemsize else None

    def writer(self, sha256: str) -> PartWriter:
        return PartWriter(self.parts, sha256, self.itemsize)

    def publish(self, shas: list[str], meta: dict[str, Any], out_dir: Path) -> None:
        """Concatenate the parts in input order, then rename the result to ``out_dir``."""
        staging = self.root / "out"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        with (staging / "tokens.bin").open("wb") as out:
            for sha256 in shas:
                with (self.parts / f"{sha256}.bin").open("rb") as part:
                    shutil.copyfileobj(part, out, COPY_BUFFER_BYTES)
            out.flush()
            os.fsync(out.fileno())
        _write_json(staging / "meta.json", meta)
        if os.path.lexists(out_dir):  # appeared while we worked (rename replaces an empty dir)
            raise DataError(f"--out {out_dir} appeared while preparing; the result is in {staging}")
        os.rename(staging, out_dir)
        shutil.rmtree(self.root)


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
