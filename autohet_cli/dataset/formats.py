"""Open a token file, whatever tool wrote it, as one read-only memory map.

Four layouts are accepted, because each is what people already have on disk:

- an **autohet prepared directory** (``meta.json`` + ``tokens.bin``, written by
  ``autohet data prepare``): the only one that also knows its vocabulary, its
  end-of-document id and its document count;
- a **flat token file** as nanoGPT writes it (``train.bin``: raw uint16 ids, no
  header): its dtype cannot be read from the file, so ``dtype`` says it (uint16
  unless told);
- a **.npy** array (1-D, integer);
- a **Megatron-LM indexed dataset** (``PREFIX.bin`` + ``PREFIX.idx``), read as the
  concatenation of its sequences, as Megatron's GPT dataset reads it.

Nothing is loaded: ``TokenSource.tokens`` is a ``numpy.memmap`` and the page cache
does the rest, so a 100 GB corpus opens instantly. Every refusal is a
``DataError`` naming the file and the fix. Imports numpy only (no torch).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from autohet_cli.dataset import DataError
from autohet_cli.dataset.megatron import megatron_paths, read_megatron

AUTOHET_FORMAT = "autohet.tokens/v1"
META_FILE = "meta.json"
TOKENS_FILE = "tokens.bin"
# The fingerprint hashes this much of each end of the token bytes: enough to tell
# two corpora apart, cheap enough to compute at every start.
FINGERPRINT_SPAN_BYTES = 1 << 20

# --data-dtype spellings -> numpy dtype name. Only the two widths tokenizers use.
_DTYPE_NAMES = {"uint16": "uint16", "u2": "uint16", "uint32": "uint32", "u4": "uint32"}
DEFAULT_FLAT_DTYPE = "uint16"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TokenSource:
    """One stream of token ids on disk; ``tokens`` is a 1-D read-only ``numpy.memmap``."""

    tokens: NDArray[Any]
    kind: str  # "autohet" | "flat" | "npy" | "megatron"
    path: Path  # what was opened: the directory, the file, or the Megatron .bin
    dtype: str  # numpy dtype name of the ids on disk, e.g. "uint16"
    vocab_size: int | None = None  # known for autohet directories only
    eod_id: int | None = None
    num_documents: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def fingerprint(self) -> dict[str, object]:
        """Identity of the data, cheap to compute: refuse to resume on other data.

        Hashes the first and last ``FINGERPRINT_SPAN_BYTES`` of the token bytes
        (not the whole file: that would read the corpus at every start) plus the
        size, which together catch a different, re-tokenized or truncated corpus.
        The path is left out so that moving the data does not count as a change.
        """
        span = max(1, FINGERPRINT_SPAN_BYTES // self.tokens.itemsize)
        return {
            "kind": self.kind,
            "num_tokens": self.num_tokens,
            "dtype": self.dtype,
            "size_bytes": self.num_tokens * self.tokens.itemsize,
            "head_sha256": hashlib.sha256(self.tokens[:span].tobytes()).hexdigest(),
            "tail_sha256": hashlib.sha256(self.tokens[-span:].tobytes()).hexdigest(),
        }


def open_tokens(path: Path, *, dtype: str | None = None) -> TokenSource:
    """Open ``path`` (see the module docstring for what it may be) as a ``TokenSource``.

    ``dtype`` is for flat files, which carry none; for the other layouts, which
    record theirs, a ``dtype`` that disagrees is refused rather than ignored.
    """
    path = Path(path)
    wanted = _dtype_name(dtype) if dtype is not None else None
    if path.is_dir():
        return _checked(_open_autohet(path), wanted)
    pair = megatron_paths(path)
    if pair is not None:
        return _checked(_open_megatron(*pair), wanted)
    if not path.exists():
        raise DataError(f"--data {path}: no such file or directory; check the path")
    if not path.is_file():
        raise DataError(f"--data {path}: not a regular file; pass a token file or directory")
    if path.stat().st_size == 0:
        raise DataError(f"--data {path}: the file is empty; pass a file of token ids")
    if path.suffix == ".npy":
        return _checked(_open_npy(path), wanted)
    return _open_flat(path, wanted or DEFAULT_FLAT_DTYPE)


def _dtype_name(dtype: str) -> str:
    name = _DTYPE_NAMES.get(dtype.strip().lower())
    if name is None:
        raise DataError(
            f"--data-dtype {dtype!r}: expected one of {', '.join(_DTYPE_NAMES)} "
            "(uint16 for vocabularies up to 65,536 tokens, uint32 above)"
        )
    return name


def _checked(source: TokenSource, wanted: str | None) -> TokenSource:
    if wanted is not None and wanted != source.dtype:
        raise DataError(
            f"--data {source.path}: --data-dtype {wanted} given, but the {source.kind} data "
            f"records its ids as {source.dtype}; drop --data-dtype (it is for flat files)"
        )
    return source


def _open_flat(path: Path, dtype: str) -> TokenSource:
    size = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        other = "uint16" if dtype == "uint32" else "uint32"
        raise DataError(
            f"--data {path}: {size} bytes is not a multiple of {itemsize} ({dtype}); "
            f"pass --data-dtype {other} or check the file"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return TokenSource(tokens=tokens, kind="flat", path=path, dtype=dtype)


def _open_npy(path: Path) -> TokenSource:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"--data {path}: not a readable .npy file ({exc}); re-save it") from exc
    if not isinstance(array, np.ndarray):
        raise DataError(f"--data {path}: holds no single array; save one with numpy.save")
    if array.ndim != 1:
        raise DataError(
            f"--data {path}: a {array.ndim}-D array of shape {array.shape}; save a 1-D array "
            "of token ids (e.g. numpy.save(path, ids.reshape(-1)))"
        )
    if array.dtype.kind not in "iu":
        raise DataError(
            f"--data {path}: holds {array.dtype} values, not integer token ids; "
            "save the ids as uint16 or uint32"
        )
    if array.size == 0:
        raise DataError(f"--data {path}: the array is empty; pass a file of token ids")
    return TokenSource(tokens=array, kind="npy", path=path, dtype=array.dtype.name)


def _open_megatron(bin_path: Path, idx_path: Path) -> TokenSource:
    files = read_megatron(bin_path, idx_path)
    tokens = np.memmap(bin_path, dtype=files.dtype, mode="r")
    return TokenSource(
        tokens=tokens,
        kind="megatron",
        path=bin_path,
        dtype=files.dtype,
        num_documents=files.num_documents,
    )


def _open_autohet(directory: Path) -> TokenSource:
    meta_path, tokens_path = directory / META_FILE, directory / TOKENS_FILE
    if not meta_path.is_file():
        raise DataError(
            f"--data {directory}: a directory must hold {META_FILE} and {TOKENS_FILE}, as "
            "`autohet data prepare` writes them; prepare the data or pass a token file"
        )
    meta = _read_meta(meta_path)
    dtype, num_tokens = meta["dtype"], meta["num_tokens"]
    if not tokens_path.is_file():
        raise DataError(f"--data {tokens_path}: missing; prepare the data again")
    size, expected = tokens_path.stat().st_size, num_tokens * np.dtype(dtype).itemsize
    if size != expected:
        raise DataError(
            f"--data {tokens_path}: {size} bytes, but {META_FILE} says num_tokens {num_tokens} "
            f"({dtype}: {expected} bytes); the preparation was interrupted or the files come "
            "from different runs: prepare the data again"
        )
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(num_tokens,))
    return TokenSource(
        tokens=tokens,
        kind="autohet",
        path=directory,
        dtype=dtype,
        vocab_size=meta["vocab_size"],
        eod_id=meta.get("eod_id"),
        num_documents=meta.get("num_documents"),
    )


def _read_meta(meta_path: Path) -> dict[str, Any]:
    """Parse and check ``meta.json``.

    Keys we do not use (``tokenizer``, ``inputs``, later additions) are left alone:
    the ``format`` string is what versions the layout, and a v1 reader must read
    every v1 directory.
    """
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"--data {meta_path}: not valid JSON ({exc}); prepare again") from exc
    if not isinstance(meta, dict):
        raise DataError(f"--data {meta_path}: expected a JSON object; prepare the data again")
    fmt = meta.get("format")
    if fmt != AUTOHET_FORMAT:
        raise DataError(
            f"--data {meta_path}: format {fmt!r} is not {AUTOHET_FORMAT!r}, the one this "
            "autohet reads; prepare the data with this version of autohet"
        )
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise DataError(
            f"--data {meta_path}: field dtype is {meta.get('dtype')!r}; expected uint16 or "
            "uint32: prepare the data again"
        )
    if meta.get("num_tokens") == 0:
        raise DataError(
            f"--data {meta_path}: num_tokens is 0, the data holds no token; prepare it from "
            "inputs that hold text"
        )
    _int_field(meta_path, meta, "num_tokens", minimum=1, required=True)
    _int_field(meta_path, meta, "vocab_size", minimum=1, required=True)
    _int_field(meta_path, meta, "eod_id", minimum=0, required=False)
    _int_field(meta_path, meta, "num_documents", minimum=0, required=False)
    return meta


def _int_field(path: Path, meta: dict[str, Any], key: str, *, minimum: int, required: bool) -> None:
    value = meta.get(key)
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DataError(
            f"--data {path}: field {key} is {value!r}; expected an integer >= {minimum}: "
            "prepare the data again"
        )
