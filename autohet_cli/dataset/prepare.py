"""``autohet data prepare``: text files in, one flat token file out.

The output directory holds ``tokens.bin`` (every document's token ids followed by
the end-of-document id, little-endian uint16, or uint32 for vocabularies over
65,536) and ``meta.json`` (format ``autohet.tokens/v1``, read by
``dataset.formats``). Input files are tokenised in worker processes (``dataset.encode``),
in chunks of about ``chunk_chars`` characters; results are written in submission
order, so the bytes do not depend on the number of workers.

Memory is bounded whatever the inputs: files are streamed (``dataset.readers``) and a
document longer than ``piece_chars`` is tokenized in pieces cut before a space
(``dataset.pieces``; its tokens may differ from the whole document's only at the
cuts, and for GPT-2-style byte-level tokenizers do not). A worker holds about 200
bytes per character of its chunk while tokenizing it.

The work happens in ``DIR.partial/`` (see ``dataset.partial``): each finished input
leaves a part keyed by its content, so a run cut short (Ctrl-C, a lost session)
resumes from the inputs it finished when run again with the same settings. The
result is renamed to ``DIR`` in one step; ``DIR`` is never overwritten.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from autohet_cli.dataset import DataError, WorkerDied
from autohet_cli.dataset.encode import Chunk, ordered_map
from autohet_cli.dataset.partial import COPY_BUFFER_BYTES, PartialDir, PartStats, PartWriter
from autohet_cli.dataset.pieces import PIECE_CHARS
from autohet_cli.dataset.readers import MAX_LINE_CHARS, DocSeparator, expand_inputs, read_pieces
from autohet_cli.regular_file import path_kind

FORMAT = "autohet.tokens/v1"
PARTIAL_FORMAT = "autohet.tokens.partial/v1"
CREATED_BY = "autohet data prepare"
# Tried in this order when --eod-token is not given (GPT-2/NeoX, Llama 1-2/T5, Gemma,
# Llama 3, BERT).
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
# Characters of text per task sent to a worker: big enough that pickling and
# scheduling cost little next to tokenising, small enough to keep every worker busy.
CHUNK_CHARS = 1 << 20

Progress = Callable[[float, str], None]


def sample_dir() -> Path:
    """The shipped sample corpus and tokenizer (``autohet_cli/data/sample``)."""
    return Path(__file__).resolve().parents[1] / "data" / "sample"


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareOptions:
    """What ``autohet data prepare`` was asked to do."""

    inputs: tuple[Path, ...]
    tokenizer: str  # a tokenizer.json, a directory holding one, or "sample"
    out_dir: Path
    text_key: str = "text"
    doc_separator: DocSeparator = DocSeparator.NONE
    eod_token: str | None = None
    num_workers: int = field(default_factory=default_workers)
    chunk_chars: int = CHUNK_CHARS
    piece_chars: int = PIECE_CHARS  # a longer document is tokenized in pieces
    max_line_chars: int = MAX_LINE_CHARS  # the longest .jsonl line read

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise DataError(f"--workers {self.num_workers}: give 1 or more")
        if not self.text_key:
            raise DataError("--text-key is empty: name the field that holds the text")
        for name in ("chunk_chars", "piece_chars", "max_line_chars"):
            if getattr(self, name) < 1:
                raise DataError(f"{name} {getattr(self, name)}: give 1 or more")


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizerInfo:
    path: Path
    sha256: str
    vocab_size: int  # largest id + 1, added tokens included
    eod_id: int
    dtype: str  # "uint16" or "uint32"


@dataclass(frozen=True, slots=True, kw_only=True)
class InputFile:
    path: Path
    num_bytes: int
    sha256: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareResult:
    out_dir: Path
    meta: dict[str, Any]
    num_inputs_reused: int
    num_tokens_tokenized: int  # by this run, not reused from an interrupted one
    elapsed_s: float
    # Finished parts of an interrupted run that failed their check, so their inputs
    # were encoded again: one line each, naming the part, why, and the input.
    redone: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])

    @property
    def num_documents(self) -> int:
        return int(self.meta["num_documents"])

    @property
    def num_input_bytes(self) -> int:
        return sum(int(item["bytes"]) for item in self.meta["inputs"])

    @property
    def tokens_per_s(self) -> float:
        """The speed of this run: tokens it tokenized (reused parts cost nothing)."""
        return self.num_tokens_tokenized / max(self.elapsed_s, 1e-9)


def resolve_tokenizer_path(spec: str) -> Path:
    """``sample``, a ``tokenizer.json``, or a directory holding one (never the hub)."""
    if spec == "sample":
        return sample_dir() / "tokenizer.json"
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(
                f"--tokenizer {spec}: the directory has no tokenizer.json (a HuggingFace "
                "fast tokenizer file); give its path, or `sample` for the shipped one"
            )
    elif not path.is_file():
        what = path_kind(path)
        raise DataError(
            f"--tokenizer {spec}: "
            + (f"is {what}, not a regular file" if what else "no such file")
            + "; give a local tokenizer.json (or a directory holding one), or `sample` "
            "for the shipped one"
        )
    return path


def load_tokenizer(spec: str, eod_token: str | None) -> tuple[Tokenizer, TokenizerInfo]:
    path = resolve_tokenizer_path(spec)
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise DataError(f"--tokenizer {path}: not a tokenizer.json ({exc})") from exc
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    vocab_size = max(vocab.values(), default=-1) + 1
    return tokenizer, TokenizerInfo(
        path=path,
        sha256=file_sha256(path),
        vocab_size=vocab_size,
        eod_id=_eod_id(tokenizer, path, eod_token),
        dtype="uint16" if vocab_size <= 1 << 16 else "uint32",
    )


def _eod_id(tokenizer: Tokenizer, path: Path, eod_token: str | None) -> int:
    if eod_token is not None:
        eod_id = tokenizer.token_to_id(eod_token)
        if eod_id is None:
            raise DataError(f"--eod-token {eod_token!r} is not in the vocabulary of {path}")
        return eod_id
    for candidate in EOD_CANDIDATES:
        eod_id = tokenizer.token_to_id(candidate)
        if eod_id is not None:
            return eod_id
    raise DataError(
        f"{path}: none of {', '.join(EOD_CANDIDATES)} is in the vocabulary; pass "
        "--eod-token with the token that ends a document"
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(COPY_BUFFER_BYTES):
            digest.update(block)
    return digest.hexdigest()


def prepare(options: PrepareOptions, progress: Progress | None = None) -> PrepareResult:
    """Tokenise ``options.inputs`` into ``options.out_dir`` (see the module docstring)."""
    report = progress or (lambda _fraction, _detail: None)
    started = time.monotonic()
    out_dir = options.out_dir
    if out_dir.is_symlink():
        raise DataError(
            f"--out {out_dir} is a symbolic link (to {os.readlink(out_dir)}); prepare never "
            f"writes through a link: pass a path that does not exist yet, or remove the link"
        )
    if out_dir.exists():
        raise DataError(
            f"--out {out_dir} already exists and prepare never overwrites; "
            f"pass another --out or delete {out_dir}"
        )
    paths = expand_inputs(options.inputs)
    tokenizer, info = load_tokenizer(options.tokenizer, options.eod_token)
    inputs = []
    for path in paths:
        report(0.0, f"hashing {path.name}")
        inputs.append(InputFile(path=path, num_bytes=path.stat().st_size, sha256=file_sha256(path)))
    partial = PartialDir.open(partial_dir(out_dir), _settings(options, info))
    unique = {item.sha256: item for item in inputs}
    stats = {
        sha: s
        for sha, item in unique.items()
        if (s := partial.finished(sha, item.num_bytes)) is not None
    }
    redone = tuple(
        f"{partial.parts / (sha + '.bin')}: {why}; re-encoding {unique[sha].path}"
        for sha, why in partial.rejected.items()
    )
    reused = sum(1 for item in inputs if item.sha256 in stats)
    todo = [item for sha, item in unique.items() if sha not in stats]
    workers = _useful_workers(todo, options)
    if workers > 1:
        report(0.0, f"starting {workers} tokenizer processes")
    encoded = ordered_map(
        _chunks(todo, options),
        tokenizer,
        tokenizer_path=info.path,
        eod_id=info.eod_id,
        dtype=info.dtype,
        workers=workers,
    )
    try:
        tokenized = _write_parts(encoded, partial, unique, stats, report)
    except DataError:
        partial.discard_if_unfinished()  # a bad input: fix it and rerun from scratch
        raise
    except WorkerDied as exc:
        raise WorkerDied(
            f"{exc}. {out_dir} was not written; the inputs finished so far are kept in "
            f"{partial.root}: the same command resumes from them"
        ) from None
    stats |= tokenized
    report(1.0, "assembling tokens.bin")
    meta = _meta(inputs, stats, info)
    partial.publish([item.sha256 for item in inputs], meta, out_dir)
    return PrepareResult(
        out_dir=out_dir,
        meta=meta,
        num_inputs_reused=reused,
        num_tokens_tokenized=sum(part.num_tokens for part in tokenized.values()),
        elapsed_s=time.monotonic() - started,
        redone=redone,
    )


def partial_dir(out_dir: Path) -> Path:
    return out_dir.with_name(out_dir.name + ".partial")


def _settings(options: PrepareOptions, info: TokenizerInfo) -> dict[str, Any]:
    """What decides the tokens of an input: a partial dir is reused only under these."""
    return {
        "format": PARTIAL_FORMAT,
        "tokenizer_sha256": info.sha256,
        "eod_id": info.eod_id,
        "dtype": info.dtype,
        "text_key": options.text_key,
        "doc_separator": options.doc_separator.value,
        "piece_chars": options.piece_chars,
    }


def _useful_workers(todo: list[InputFile], options: PrepareOptions) -> int:
    """No more processes than there are chunks of work: starting one costs a second."""
    todo_bytes = sum(item.num_bytes for item in todo)
    return max(1, min(options.num_workers, todo_bytes // options.chunk_chars))


def _write_parts(
    encoded: Generator[tuple[Chunk, bytes], None, None],
    partial: PartialDir,
    unique: dict[str, InputFile],
    done: dict[str, PartStats],
    report: Progress,
) -> dict[str, PartStats]:
    """Append each encoded chunk to its input's part; finish a part at its last chunk.

    Progress is told in bytes of the input files (finished ones counted whole)."""
    total_bytes = max(1, sum(item.num_bytes for item in unique.values()))
    done_bytes = sum(unique[sha].num_bytes for sha in done)
    results: dict[str, PartStats] = {}
    writer: PartWriter | None = None
    with closing(encoded):  # stops the workers at once if anything here fails
        for chunk, data in encoded:
            item = unique[chunk.sha256]
            writer = writer or partial.writer(chunk.sha256)
            writer.write(data, num_documents=chunk.num_documents)
            fraction = (done_bytes + chunk.bytes_read) / total_bytes
            report(fraction, f"{item.path.name}: {writer.num_tokens:,} tokens")
            if chunk.last:
                results[chunk.sha256] = writer.finish(item.path, item.num_bytes)
                done_bytes += item.num_bytes
                writer = None
    return results


def _chunks(todo: list[InputFile], options: PrepareOptions) -> Iterator[Chunk]:
    """Each input's pieces, grouped into tasks of about ``chunk_chars`` characters."""
    for item in todo:
        texts: list[str] = []
        starts: list[bool] = []
        ends: list[bool] = []
        num_chars = 0
        pieces = read_pieces(
            item.path,
            text_key=options.text_key,
            doc_separator=options.doc_separator,
            piece_chars=options.piece_chars,
            max_line_chars=options.max_line_chars,
        )
        for piece in pieces:
            texts.append(piece.text)
            starts.append(piece.starts_document)
            ends.append(piece.ends_document)
            num_chars += len(piece.text)
            if num_chars >= options.chunk_chars:
                yield Chunk(item.path, item.sha256, texts, starts, ends, False, piece.bytes_read)
                texts, starts, ends, num_chars = [], [], [], 0
        yield Chunk(item.path, item.sha256, texts, starts, ends, True, item.num_bytes)


def _meta(
    inputs: list[InputFile], stats: dict[str, PartStats], info: TokenizerInfo
) -> dict[str, Any]:
    rows = [
        {
            "path": str(item.path),
            "bytes": item.num_bytes,
            "sha256": item.sha256,
            "documents": stats[item.sha256].num_documents,
            "tokens": stats[item.sha256].num_tokens,
        }
        for item in inputs
    ]
    return {
        "format": FORMAT,
        "dtype": info.dtype,
        "num_tokens": sum(row["tokens"] for row in rows),
        "vocab_size": info.vocab_size,
        "eod_id": info.eod_id,
        "num_documents": sum(row["documents"] for row in rows),
        "tokenizer": {"path": str(info.path), "sha256": info.sha256},
        "inputs": rows,
        "created_by": CREATED_BY,
    }
