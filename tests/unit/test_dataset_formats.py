"""open_tokens reads each layout as its writer wrote it, and refuses bad files by name.

Megatron datasets are written with Megatron's own IndexedDatasetBuilder and read
back with its IndexedDataset, so our parser is checked against the reference.
"""

from __future__ import annotations

import importlib
import json
import struct
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from autohet_cli.dataset import DataError
from autohet_cli.dataset.formats import AUTOHET_FORMAT, open_tokens
from autohet_cli.errors import ConfigError


def raises_data_error(path: Path, *fragments: str, **kwargs: Any) -> str:
    with pytest.raises(DataError) as info:
        open_tokens(path, **kwargs)
    message = str(info.value)
    for fragment in (path.name, *fragments):
        assert fragment in message, (fragment, message)
    return message


def write_autohet(directory: Path, ids: np.ndarray, **overrides: Any) -> Path:
    directory.mkdir()
    ids.tofile(directory / "tokens.bin")
    meta = {
        "format": AUTOHET_FORMAT,
        "dtype": ids.dtype.name,
        "num_tokens": len(ids),
        "vocab_size": int(ids.max()) + 1,
        "eod_id": 0,
        "num_documents": 3,
        "tokenizer": {"name": "test"},
        "inputs": ["a.txt"],
        "created_by": "a later writer adds keys; v1 readers ignore them",
    }
    meta.update(overrides)
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


# ----------------------------------------------------------------- layouts


def test_flat_uint16_is_the_default(tmp_path: Path) -> None:
    ids = (np.arange(5000) * 7919 % 50257).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    source = open_tokens(tmp_path / "train.bin")
    assert (source.kind, source.dtype, source.num_tokens) == ("flat", "uint16", 5000)
    assert isinstance(source.tokens, np.memmap) and not source.tokens.flags.writeable
    np.testing.assert_array_equal(source.tokens, ids)
    assert source.vocab_size is None and source.num_documents is None


@pytest.mark.parametrize("spelling", ["uint32", "u4", " UINT32 "])
def test_flat_uint32_when_told(tmp_path: Path, spelling: str) -> None:
    ids = np.array([0, 70_000, 151_935, 5], dtype=np.uint32)
    ids.tofile(tmp_path / "big.bin")
    source = open_tokens(tmp_path / "big.bin", dtype=spelling)
    assert source.dtype == "uint32"
    np.testing.assert_array_equal(source.tokens, ids)
    assert open_tokens(tmp_path / "big.bin", dtype="u2").num_tokens == 8  # read as uint16


def test_npy(tmp_path: Path) -> None:
    ids = np.arange(1, 300, dtype=np.int32)
    np.save(tmp_path / "ids.npy", ids)
    source = open_tokens(tmp_path / "ids.npy")
    assert (source.kind, source.dtype) == ("npy", "int32")
    assert isinstance(source.tokens, np.memmap)
    np.testing.assert_array_equal(source.tokens, ids)


def test_autohet_directory(tmp_path: Path) -> None:
    ids = np.array([5, 1, 0, 9, 99_999, 0], dtype=np.uint32)
    source = open_tokens(write_autohet(tmp_path / "prepared", ids, vocab_size=100_000))
    assert (source.kind, source.dtype, source.path) == ("autohet", "uint32", tmp_path / "prepared")
    assert (source.vocab_size, source.eod_id, source.num_documents) == (100_000, 0, 3)
    np.testing.assert_array_equal(source.tokens, ids)


@pytest.fixture(scope="module")
def megatron() -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        return importlib.import_module("megatron.core.datasets.indexed_dataset")


def write_megatron(megatron: ModuleType, prefix: Path, dtype: type, seed: int = 0) -> None:
    """Three documents; the second made of two items, as preprocess_data.py writes sentences."""
    import torch

    rng = np.random.default_rng(seed)
    builder = megatron.IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for length in (17, 5):
        builder.add_item(torch.from_numpy(rng.integers(0, 30_000, length)))
        builder.end_document()
    builder.add_document(rng.integers(0, 30_000, 9), lengths=[4, 5])
    builder.finalize(str(prefix) + ".idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_matches_the_reference_reader(
    tmp_path: Path, megatron: ModuleType, dtype: type
) -> None:
    prefix = tmp_path / "corpus_text_document"
    write_megatron(megatron, prefix, dtype)
    reference = megatron.IndexedDataset(str(prefix))
    expected = np.concatenate([reference[i] for i in range(len(reference))])
    assert len(reference) == 4  # sequences: 17 | 5 | 4 + 5
    for given in (prefix, tmp_path / "corpus_text_document.bin", prefix.with_suffix(".idx")):
        source = open_tokens(given)
        assert (source.kind, source.dtype) == ("megatron", np.dtype(dtype).name)
        assert source.num_documents == len(reference.document_indices) - 1 == 3
        np.testing.assert_array_equal(source.tokens, expected)


# ----------------------------------------------------------------- fingerprint


def test_fingerprint_identifies_the_data_not_its_path(tmp_path: Path) -> None:
    ids = np.arange(2_000_000, dtype=np.uint32) % 1000
    ids.tofile(tmp_path / "a.bin")
    ids.tofile(tmp_path / "b.bin")
    a = open_tokens(tmp_path / "a.bin", dtype="uint32").fingerprint()
    assert a == open_tokens(tmp_path / "b.bin", dtype="uint32").fingerprint()
    assert set(a) == {"kind", "num_tokens", "dtype", "size_bytes", "head_sha256", "tail_sha256"}
    assert a["size_bytes"] == 8_000_000
    json.dumps(a)
    for where in (0, -1):  # a change at either end, length unchanged
        changed = ids.copy()
        changed[where] += 1
        changed.tofile(tmp_path / "c.bin")
        c = open_tokens(tmp_path / "c.bin", dtype="uint32").fingerprint()
        assert c != a and c["num_tokens"] == a["num_tokens"]


# ----------------------------------------------------------------- refusals


def test_every_refusal_is_a_config_error() -> None:
    assert issubclass(DataError, ConfigError)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    raises_data_error(tmp_path / "nope.bin", "no such file")
    (tmp_path / "empty.bin").write_bytes(b"")
    raises_data_error(tmp_path / "empty.bin", "empty")


def test_flat_size_not_a_multiple_of_the_dtype(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(bytes(1001))
    raises_data_error(
        tmp_path / "x.bin", "1001 bytes is not a multiple of 2 (uint16)", "--data-dtype uint32"
    )
    (tmp_path / "y.bin").write_bytes(bytes(1002))
    raises_data_error(tmp_path / "y.bin", "not a multiple of 4 (uint32)", dtype="uint32")


def test_unknown_dtype_and_dtype_contradicting_the_file(tmp_path: Path) -> None:
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "x.bin")
    with pytest.raises(DataError, match="--data-dtype 'float32'"):
        open_tokens(tmp_path / "x.bin", dtype="float32")
    np.save(tmp_path / "ids.npy", np.arange(10, dtype=np.uint16))
    raises_data_error(tmp_path / "ids.npy", "records its ids as uint16", dtype="uint32")


def test_bad_npy_files(tmp_path: Path) -> None:
    np.save(tmp_path / "grid.npy", np.zeros((4, 4), dtype=np.int32))
    raises_data_error(tmp_path / "grid.npy", "2-D", "reshape(-1)")
    np.save(tmp_path / "floats.npy", np.zeros(4, dtype=np.float32))
    raises_data_error(tmp_path / "floats.npy", "float32", "not integer token ids")
    np.save(tmp_path / "none.npy", np.zeros(0, dtype=np.int32))
    raises_data_error(tmp_path / "none.npy", "empty")
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    raises_data_error(tmp_path / "junk.npy", "not a readable .npy")


def test_directory_without_meta(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    raises_data_error(tmp_path / "d", "meta.json", "autohet data prepare")


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"format": "autohet.tokens/v9"}, "'autohet.tokens/v9' is not 'autohet.tokens/v1'"),
        ({"dtype": "int8"}, "field dtype is 'int8'"),
        ({"num_tokens": 7}, "says num_tokens 7"),
        ({"num_tokens": 0}, "holds no token"),
        ({"vocab_size": None}, "field vocab_size is None"),
        ({"eod_id": -1}, "field eod_id is -1"),
        ({"num_documents": "3"}, "field num_documents is '3'"),
    ],
)
def test_bad_meta(tmp_path: Path, overrides: dict[str, Any], fragment: str) -> None:
    directory = write_autohet(tmp_path / "d", np.arange(6, dtype=np.uint16), **overrides)
    message = raises_data_error(directory, fragment)
    assert "prepare" in message


def test_meta_not_json_and_tokens_missing(tmp_path: Path) -> None:
    directory = write_autohet(tmp_path / "d", np.arange(6, dtype=np.uint16))
    (directory / "meta.json").write_text("{oops")
    raises_data_error(directory, "meta.json: not valid JSON")
    other = write_autohet(tmp_path / "e", np.arange(6, dtype=np.uint16))
    (other / "tokens.bin").unlink()
    raises_data_error(other, "tokens.bin: missing")


def test_megatron_without_its_index_or_data(tmp_path: Path) -> None:
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "p.bin")
    raises_data_error(tmp_path / "p", "p.idx: no such file", "PREFIX.bin + PREFIX.idx")
    (tmp_path / "q.idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(25))
    with pytest.raises(DataError, match=r"q\.bin: no such file"):
        open_tokens(tmp_path / "q.idx")


def corrupt(megatron: ModuleType, tmp_path: Path, offset: int, data: bytes) -> Path:
    prefix = tmp_path / "m"
    write_megatron(megatron, prefix, np.uint16)
    raw = bytearray((tmp_path / "m.idx").read_bytes())
    raw[offset : offset + len(data)] = data
    (tmp_path / "m.idx").write_bytes(bytes(raw))
    return prefix


@pytest.mark.parametrize(
    ("offset", "data", "fragment"),
    [
        (0, b"NOTMEGAT\x00", "not a Megatron index"),
        (9, struct.pack("<Q", 2), "index version 2"),
        (17, struct.pack("<B", 7), "float32 values, not token ids"),
        (17, struct.pack("<B", 42), "unknown dtype code 42"),
        (18, struct.pack("<Q", 5), "announces 5 sequences"),
        # sequence 1's pointer (after 4 int32 lengths): 34 + 16 + 8
        (58, struct.pack("<q", 36), "sequence 1 starts at byte 36, expected 34"),
        # the last document index: 34 + 4*4 + 4*8 + 3*8
        (106, struct.pack("<q", 3), "document indices must rise from 0 to"),
    ],
)
def test_corrupt_megatron_index(
    tmp_path: Path, megatron: ModuleType, offset: int, data: bytes, fragment: str
) -> None:
    raises_data_error(corrupt(megatron, tmp_path, offset, data), fragment)


def test_megatron_index_truncated_or_data_mismatched(tmp_path: Path, megatron: ModuleType) -> None:
    prefix = tmp_path / "m"
    write_megatron(megatron, prefix, np.uint16)
    with (tmp_path / "m.bin").open("ab") as f:
        f.write(b"\x00\x00")
    raises_data_error(prefix, "m.bin: 64 bytes, but m.idx describes 62 bytes")
    (tmp_path / "m.idx").write_bytes((tmp_path / "m.idx").read_bytes()[:20])
    raises_data_error(prefix, "shorter than a Megatron index header")
