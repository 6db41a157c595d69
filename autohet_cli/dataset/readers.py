"""Documents out of the input files of ``autohet data prepare``.

``read_pieces`` yields every document in pieces of bounded length (``dataset.pieces``),
each with how far into the file on disk reading has got, so progress can be told in
the file's own bytes (for a ``.gz`` that is the compressed position).

Readers stream, so memory does not grow with the file: a ``.txt`` file is read a
piece at a time, as one document or as blank-line paragraphs, whatever its lines'
lengths; a ``.jsonl`` document is one line, read whole up to ``MAX_LINE_CHARS`` and
refused beyond; a ``.parquet`` file is read a batch of rows at a time.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

from autohet_cli.dataset import DataError
from autohet_cli.dataset.pieces import PIECE_CHARS, Fragment, Piece, cut_pieces
from autohet_cli.regular_file import path_kind

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
# The longest line read from a .jsonl file (one document): enough for any real
# document, and a bound on the memory a file with no newline can take (a .txt file is
# read in pieces and needs no bound).
MAX_LINE_CHARS = 1 << 28


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
        elif (what := path_kind(path)) is not None:
            raise DataError(
                f"{path}: is {what}, not a regular file; prepare reads each input twice "
                "(to hash it, then to tokenize it), so save the stream to a file and give that"
            )
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
    path: Path,
    *,
    text_key: str,
    doc_separator: DocSeparator,
    piece_chars: int = PIECE_CHARS,
    max_line_chars: int = MAX_LINE_CHARS,
) -> Iterator[tuple[str, int]]:
    """``(document, bytes of the file read so far)`` for every non-empty document.

    Each document is held whole: for bounded memory, tokenize ``read_pieces``."""
    parts: list[str] = []
    pieces = read_pieces(
        path,
        text_key=text_key,
        doc_separator=doc_separator,
        piece_chars=piece_chars,
        max_line_chars=max_line_chars,
    )
    for piece in pieces:
        parts.append(piece.text)
        if piece.ends_document:
            yield "".join(parts), piece.bytes_read
            parts = []


def read_pieces(
    path: Path,
    *,
    text_key: str,
    doc_separator: DocSeparator,
    piece_chars: int = PIECE_CHARS,
    max_line_chars: int = MAX_LINE_CHARS,
) -> Iterator[Piece]:
    """Every non-empty document of ``path``, in pieces of at most ``piece_chars``
    characters (see ``dataset.pieces``)."""
    fragments = _read_fragments(path, text_key, doc_separator, piece_chars, max_line_chars)
    return cut_pieces(fragments, piece_chars)


def _read_fragments(
    path: Path, text_key: str, doc_separator: DocSeparator, block_chars: int, max_line_chars: int
) -> Iterator[Fragment]:
    suffix = input_suffix(path)
    if suffix is None:
        raise DataError(f"{path}: unsupported input; supported kinds are {SUPPORTED}")
    if KINDS[suffix] == "parquet":
        yield from (
            (text, True, bytes_read) for text, bytes_read in _parquet_documents(path, text_key)
        )
        return
    with path.open("rb") as raw:
        text = (
            io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8")
            if suffix.endswith(".gz")
            else io.TextIOWrapper(raw, encoding="utf-8")
        )
        fragments: Iterator[tuple[str, bool]]
        if KINDS[suffix] == "jsonl":
            fragments = _jsonl_documents(path, text, text_key, max_line_chars)
        elif doc_separator is DocSeparator.BLANK_LINE:
            fragments = _paragraphs(path, text, block_chars, max_line_chars)
        else:
            fragments = _whole_file(path, text, block_chars)
        try:
            for fragment, ends in fragments:
                yield fragment, ends, raw.tell()
        except (OSError, EOFError) as exc:  # a truncated or corrupt .gz
            raise DataError(f"{path}: cannot be read ({exc})") from exc


def _whole_file(path: Path, text: io.TextIOWrapper, block_chars: int) -> Iterator[tuple[str, bool]]:
    """The file as one document, read ``block_chars`` characters at a time."""
    num_read = 0
    block = _read_block(path, text, block_chars, num_read)
    while block:
        num_read += len(block)
        following = _read_block(path, text, block_chars, num_read)
        yield block, not following
        block = following


def _read_block(path: Path, text: io.TextIOWrapper, block_chars: int, num_read: int) -> str:
    try:
        return text.read(block_chars)
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: not UTF-8 text ({exc.reason}, after its first {num_read:,} characters)"
        ) from exc


def _readline(path: Path, text: io.TextIOWrapper, limit: int, number: int) -> str:
    """Up to ``limit`` characters of line ``number``; a line that is not UTF-8 is an
    error naming it."""
    try:
        return text.readline(limit)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}:{number}: not UTF-8 text ({exc.reason})") from exc


def _paragraphs(
    path: Path, text: io.TextIOWrapper, block_chars: int, max_line_chars: int
) -> Iterator[tuple[str, bool]]:
    """Runs of non-blank lines, joined by newlines (the final newline dropped), as
    fragments of at most ``block_chars``: a line is never held whole, only the blank
    start of one (up to ``max_line_chars``) until it is known to be blank or not."""
    number, in_paragraph = 0, False
    while True:
        number += 1
        blank, eof = True, False
        held: list[str] = []  # the blank start of the line
        num_held = 0
        while True:
            fragment = _readline(path, text, block_chars, number)
            if not fragment:
                eof = True
                break
            complete = fragment.endswith("\n")
            body = fragment[:-1] if complete else fragment
            if blank and not body.strip():
                held.append(body)
                num_held += len(body)
                if num_held > max_line_chars:
                    raise DataError(
                        f"{path}:{number}: a line starts with more than {max_line_chars:,} "
                        "whitespace characters; remove them"
                    )
            else:
                if blank:
                    if in_paragraph:
                        yield "\n", False
                    yield "".join(held), False
                    blank, in_paragraph = False, True
                yield body, False
            if complete:
                break
        if blank and in_paragraph:
            yield "", True
            in_paragraph = False
        if eof:
            if in_paragraph:
                yield "", True
            return


def _jsonl_documents(
    path: Path, text: io.TextIOWrapper, text_key: str, max_line_chars: int
) -> Iterator[tuple[str, bool]]:
    """One document a line; a line over ``max_line_chars`` is refused, not read whole
    (a file with no newline at all would otherwise be held in memory entire)."""
    number = 0
    while line := _readline(path, text, max_line_chars + 1, number + 1):
        number += 1
        if len(line) > max_line_chars and not line.endswith("\n"):
            raise DataError(
                f"{path}:{number}: a line longer than {max_line_chars:,} characters (a "
                "file without newlines?); split the document into several, or store it "
                "as a .txt file (read in pieces, whatever its length)"
            )
        if not line.strip():
            continue
        value = _jsonl_text(path, number, line, text_key)
        if value:
            yield value, True


def _jsonl_text(path: Path, number: int, line: str, text_key: str) -> str:
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
    return value


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
    for values in _parquet_values(source, path, text_key):
        for value in values:
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


def _parquet_values(source: Any, path: Path, text_key: str) -> Iterator[list[Any]]:
    """The column's values, a batch at a time, row group by row group; a damaged page
    (bad header, compression or encoding, bytes that are not UTF-8) is an error naming
    the file and its row group."""
    first_row = 0
    for group in range(source.num_row_groups):
        num_rows = source.metadata.row_group(group).num_rows
        batches = source.iter_batches(
            batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=[text_key]
        )
        try:
            for batch in batches:
                yield batch.column(0).to_pylist()
        except Exception as exc:  # ArrowInvalid, OSError, UnicodeDecodeError...
            rows = f"rows {first_row + 1}-{first_row + num_rows}"
            reason = " ".join(str(exc).split())  # pyarrow's may span lines
            raise DataError(
                f"{path}: row group {group} ({rows}) is damaged ({type(exc).__name__}: "
                f"{reason}); re-export or download the file again, or leave it out"
            ) from exc
        first_row += num_rows
