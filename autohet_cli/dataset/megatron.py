"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``), read without Megatron.

Megatron's ``preprocess_data.py`` writes the tokens of every sequence back to back
into ``PREFIX.bin`` and describes them in ``PREFIX.idx``::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code (megatron.core.datasets.indexed_dataset.DType)
    uint64    S, the number of sequences
    uint64    D, the number of document indices (documents + 1)
    int32[S]  sequence lengths in tokens
    int64[S]  sequence byte offsets into PREFIX.bin
    int64[D]  document indices: sequence numbers where documents start, 0 first, S last
    int8[S]   sequence modes (multimodal datasets only)

All little-endian. We parse it ourselves rather than import Megatron: importing
``megatron.core`` takes seconds and pulls in its whole training stack, and the
layout is small. Like Megatron's GPT dataset we treat the ``.bin`` as one stream of
tokens (the concatenation of its sequences), so we only accept indices whose
sequences are contiguous and exactly fill the ``.bin``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autohet_cli.dataset import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes

# megatron.core.datasets.indexed_dataset.DType: code -> numpy dtype name.
DTYPE_CODES = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float64",
    7: "float32",
    8: "uint16",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronFiles:
    """What the index says about the ``.bin``, once checked against it."""

    bin_path: Path
    idx_path: Path
    dtype: str
    num_sequences: int
    num_documents: int


def megatron_paths(path: Path) -> tuple[Path, Path] | None:
    """(bin, idx) when ``path`` names a Megatron dataset (PREFIX, PREFIX.bin or PREFIX.idx).

    A ``.bin`` without its ``.idx`` is not one: nanoGPT's flat ``train.bin`` is that.
    """
    if path.suffix in (".bin", ".idx"):
        prefix = str(path)[: -len(path.suffix)]
    else:
        prefix = str(path)
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    if path.suffix == ".idx":
        return bin_path, idx_path
    if path.suffix == ".bin":
        return (bin_path, idx_path) if idx_path.exists() else None
    if not path.exists() and (bin_path.exists() or idx_path.exists()):
        return bin_path, idx_path
    return None


def read_megatron(bin_path: Path, idx_path: Path) -> MegatronFiles:
    """Parse and check ``idx_path`` against ``bin_path``; DataError names what is wrong."""
    for p in (idx_path, bin_path):
        if not p.is_file():
            raise DataError(
                f"--data {p}: no such file; a Megatron dataset is PREFIX.bin + PREFIX.idx "
                "side by side: pass PREFIX (or either file) with both present"
            )
    size = idx_path.stat().st_size
    if size < _HEADER.size:
        raise DataError(
            f"--data {idx_path}: {size} bytes is shorter than a Megatron index header "
            f"({_HEADER.size} bytes); the file is truncated: rebuild it with preprocess_data.py"
        )
    with idx_path.open("rb") as f:
        magic, version, code, num_seq, num_doc_idx = _HEADER.unpack(f.read(_HEADER.size))
    dtype = _check_header(idx_path, magic, version, code)
    itemsize = np.dtype(dtype).itemsize
    need = _HEADER.size + 12 * num_seq + 8 * num_doc_idx
    if size not in (need, need + num_seq):  # + num_seq: the multimodal modes
        raise DataError(
            f"--data {idx_path}: {size} bytes, but its header announces {num_seq} sequences "
            f"and {num_doc_idx} document indices ({need} bytes); the index is truncated or "
            "corrupt: rebuild it"
        )
    if num_seq == 0:
        raise DataError(f"--data {idx_path}: the dataset holds no sequence; it is empty")
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(raw, dtype="<i4", count=num_seq, offset=_HEADER.size)
    offset = _HEADER.size + 4 * num_seq
    pointers = np.frombuffer(raw, dtype="<i8", count=num_seq, offset=offset)
    docs = np.frombuffer(raw, dtype="<i8", count=num_doc_idx, offset=offset + 8 * num_seq)
    total = _check_contiguous(idx_path, lengths, pointers, itemsize)
    _check_documents(idx_path, docs, num_seq)
    bin_size = bin_path.stat().st_size
    if bin_size != total:
        raise DataError(
            f"--data {bin_path}: {bin_size} bytes, but {idx_path.name} describes {total} "
            f"bytes ({int(lengths.sum(dtype=np.int64))} {dtype} tokens); the two files do not "
            "belong together or one is truncated: rebuild them together"
        )
    return MegatronFiles(
        bin_path=bin_path,
        idx_path=idx_path,
        dtype=dtype,
        num_sequences=num_seq,
        num_documents=num_doc_idx - 1,
    )


def _check_header(idx_path: Path, magic: bytes, version: int, code: int) -> str:
    if magic != INDEX_MAGIC:
        raise DataError(
            f"--data {idx_path}: not a Megatron index (its first bytes are {magic!r}, not "
            f"{INDEX_MAGIC!r}); pass the PREFIX of a dataset written by preprocess_data.py"
        )
    if version != INDEX_VERSION:
        raise DataError(
            f"--data {idx_path}: Megatron index version {version}; only version "
            f"{INDEX_VERSION} is read: rebuild the index with a current Megatron-LM"
        )
    dtype = DTYPE_CODES.get(code)
    if dtype is None:
        raise DataError(
            f"--data {idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)}); "
            "the index is corrupt or from an unsupported Megatron version"
        )
    if np.dtype(dtype).kind == "f":
        raise DataError(
            f"--data {idx_path}: the dataset holds {dtype} values, not token ids; "
            "pass a tokenized dataset"
        )
    return dtype


def _check_contiguous(
    idx_path: Path, lengths: np.ndarray, pointers: np.ndarray, itemsize: int
) -> int:
    """Total bytes of the ``.bin`` once every sequence is known to follow the previous one."""
    if (lengths < 0).any():
        bad = int(np.argmax(lengths < 0))
        raise DataError(
            f"--data {idx_path}: sequence {bad} has length {int(lengths[bad])}; "
            "the index is corrupt: rebuild it"
        )
    expected = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=expected[1:])
    if not np.array_equal(pointers, expected):
        bad = int(np.argmax(pointers != expected))
        raise DataError(
            f"--data {idx_path}: sequence {bad} starts at byte {int(pointers[bad])}, expected "
            f"{int(expected[bad])} right after the previous one; only datasets whose sequences "
            "lie back to back in the .bin (as preprocess_data.py writes them) are read"
        )
    return int(expected[-1] + int(lengths[-1]) * itemsize)


def _check_documents(idx_path: Path, docs: np.ndarray, num_seq: int) -> None:
    ok = len(docs) >= 1 and docs[0] == 0 and docs[-1] == num_seq
    if not ok or (np.diff(docs) < 0).any():
        raise DataError(
            f"--data {idx_path}: the document indices must rise from 0 to the sequence "
            f"count {num_seq}; the index is corrupt: rebuild it"
        )
