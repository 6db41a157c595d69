"""Documents out of the input files of ``autohet data prepare``.

Each reader yields ``(text, bytes_read)``: a document and how far into the file on
disk reading has got, so progress can be told in the file's own bytes (for a
``.gz`` that is the compressed position). Readers stream: a multi-gigabyte jsonl
or parquet file is never held in memory whole, only a ``.txt`` read as one document.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

from autohet_cli.dataset import DataError

# File name endings (lower-cased) and the kind of reader each needs.
KINDS = {
    ".txt": "txt",
    ".txt.gz": "txt",
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl",
    ".parquet": "parquet",
}
SUPPORTED = ", ".join(KINDS)
PARQUET_BATCH_ROWS = 1024


class DocSeparator(StrEnum):
    """How a ``.txt`` input is cut into documents."""

    NONE = "none"  # the whole file is one document
    BLANK_LINE = "blank-line"  # paragraphs separated by blank lines are documents


def input_suffix(path: Path) -> str | None:
    """The supported ending of ``path`` (``.jsonl.gz``, ``.txt``...), or None."""
    name = path.name.lower()
    return next((suffix for suffix in KINDS if name.endswith(suffix)), None)


def expand_inputs(paths: Sequence[Path]) -> list[Path]:
    """Files to read, in order: files as given, directories as their supported files
    (recursively, hidden ones skipped, sorted); a file listed twice is read once."""
    if not paths:
        raise DataError("no inputs: give .txt, .jsonl or .parquet files, or directories of them")
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if _is_visible_input(p, path))
            if not found:
                raise DataError(f"{path}: a directory with no input files ({SUPPORTED})")
            out += found
        elif path.is_file():
            if input_suffix(path) is None:
                raise DataError(f"{path}: unsupported input; supported kinds are {SUPPORTED}")
            out.append(path)
        else:
            raise DataError(f"{path}: no such input file or directory")
    unique: dict[Path, Path] = {}
    for path in out:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


def _is_visible_input(path: Path, root: Path) -> bool:
    hidden = any(part.startswith(".") for part in path.relative_to(root).parts)
    return not hidden and path.is_file() and input_suffix(path) is not None


def read_documents(
    path: Path, *, text_key: str, doc_separator: DocSeparator
) -> Iterator[tuple[str, int]]:
    """``(document, bytes of the file read so far)`` for every non-empty document."""
    suffix = input_suffix(path)
    if suffix is None:
        raise DataError(f"{path}: unsupported input; supported kinds are {SUPPORTED}")
    if KINDS[suffix] == "parquet":
        yield from _parquet_documents(path, text_key)
        return
    with path.open("rb") as raw:
        text: IO[str] = (
            io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8")
            if suffix.endswith(".gz")
            else io.TextIOWrapper(raw, encoding="utf-8")
        )
        if KINDS[suffix] == "jsonl":
            documents = _jsonl_documents(path, text, text_key)
        elif doc_separator is DocSeparator.BLANK_LINE:
            documents = _paragraphs(path, text)
        else:
            documents = _whole_file(path, text)
        try:
            for document in documents:
                yield document, raw.tell()
        except (OSError, EOFError) as exc:  # a truncated or corrupt .gz
            raise DataError(f"{path}: cannot be read ({exc})") from exc


def _whole_file(path: Path, text: IO[str]) -> Iterator[str]:
    try:
        document = text.read()
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if document:
        yield document


def _numbered_lines(path: Path, text: IO[str]) -> Iterator[tuple[int, str]]:
    """Lines with their 1-based numbers; a line that is not UTF-8 is an error naming it."""
    number = 0
    lines = iter(text)
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}:{number + 1}: not UTF-8 text ({exc.reason})") from exc
        number += 1
        yield number, line


def _paragraphs(path: Path, text: IO[str]) -> Iterator[str]:
    """Runs of non-blank lines, joined by newlines (the final newline dropped)."""
    paragraph: list[str] = []
    for _, line in _numbered_lines(path, text):
        if line.strip():
            paragraph.append(line.rstrip("\n"))
        elif paragraph:
            yield "\n".join(paragraph)
            paragraph = []
    if paragraph:
        yield "\n".join(paragraph)


def _jsonl_documents(path: Path, text: IO[str], text_key: str) -> Iterator[str]:
    for number, line in _numbered_lines(path, text):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: not a JSON object ({exc.msg})") from exc
        if not isinstance(record, dict) or text_key not in record:
            keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(
                f"{path}:{number}: no {text_key!r} field (found: {keys}); "
                "pass --text-key to name the field that holds the text"
            )
        value = record[text_key]
        if not isinstance(value, str):
            raise DataError(
                f"{path}:{number}: field {text_key!r} is {type(value).__name__}, not a string"
            )
        if value:
            yield value


def _parquet_documents(path: Path, text_key: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DataError(
            f"{path}: parquet input needs pyarrow: pip install 'autohet-cli[parquet]'"
        ) from exc
    try:
        source = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid / OSError kinds
        raise DataError(f"{path}: not a readable parquet file ({exc})") from exc
    names = source.schema_arrow.names
    if text_key not in names:
        raise DataError(
            f"{path}: no {text_key!r} column (found: {', '.join(names)}); "
            "pass --text-key to name the column that holds the text"
        )
    total_rows = max(1, source.metadata.num_rows)
    size = path.stat().st_size
    row = 0
    for batch in source.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_key]):
        for value in batch.column(0).to_pylist():
            row += 1
            if value is None:
                continue  # a null text is an empty document
            if not isinstance(value, str):
                raise DataError(
                    f"{path}: row {row}: column {text_key!r} holds "
                    f"{type(value).__name__}, not strings"
                )
            if value:
                yield value, size * row // total_rows
