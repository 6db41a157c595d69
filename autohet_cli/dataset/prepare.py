"""``autohet data prepare``: text files in, one flat token file out.

The output directory holds ``tokens.bin`` (every document's token ids followed by
the end-of-document id, little-endian uint16, or uint32 for vocabularies over
65,536) and ``meta.json`` (format ``autohet.tokens/v1``, read by
``dataset.formats``). Input files are tokenised in worker processes, in chunks of
documents; results are written in submission order, so the bytes do not depend on
the number of workers.

The work happens in ``DIR.partial/`` (see ``dataset.partial``): each finished input
leaves a part keyed by its content, so a run cut short (Ctrl-C, a lost session)
resumes from the inputs it finished when run again with the same settings. The
result is renamed to ``DIR`` in one step; ``DIR`` is never overwritten.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from autohet_cli.dataset import DataError
from autohet_cli.dataset.partial import COPY_BUFFER_BYTES, PartialDir, PartStats, PartWriter
from autohet_cli.dataset.readers import DocSeparator, expand_inputs, read_documents

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

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise DataError(f"--workers {self.num_workers}: give 1 or more")
        if not self.text_key:
            raise DataError("--text-key is empty: name the field that holds the text")
        if self.chunk_chars < 1:
            raise DataError(f"chunk_chars {self.chunk_chars}: give 1 or more")


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
        raise DataError(
            f"--tokenizer {spec}: no such file; give a local tokenizer.json (or a "
            "directory holding one), or `sample` for the shipped one"
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
    stats = {sha: s for sha in unique if (s := partial.finished(sha)) is not None}
    reused = sum(1 for item in inputs if item.sha256 in stats)
    todo = [item for sha, item in unique.items() if sha not in stats]
    workers = _useful_workers(todo, options)
    if workers > 1:
        report(0.0, f"starting {workers} tokenizer processes")
    encoded = _ordered_map(_chunks(todo, options), tokenizer, info, workers)
    try:
        tokenized = _write_parts(encoded, partial, unique, stats, report)
    except DataError:
        partial.discard_if_unfinished()  # a bad input: fix it and rerun from scratch
        raise
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
    }


@dataclass(frozen=True, slots=True)
class _Chunk:
    sha256: str
    texts: list[str]
    last: bool  # the input's final chunk (possibly empty)
    bytes_read: int  # of the input file, when this chunk was cut


def _useful_workers(todo: list[InputFile], options: PrepareOptions) -> int:
    """No more processes than there are chunks of work: starting one costs a second."""
    todo_bytes = sum(item.num_bytes for item in todo)
    return max(1, min(options.num_workers, todo_bytes // options.chunk_chars))


def _write_parts(
    encoded: Generator[tuple[_Chunk, bytes], None, None],
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
            writer.write(data, num_documents=len(chunk.texts))
            fraction = (done_bytes + chunk.bytes_read) / total_bytes
            report(fraction, f"{item.path.name}: {writer.num_tokens:,} tokens")
            if chunk.last:
                results[chunk.sha256] = writer.finish(item.path)
                done_bytes += item.num_bytes
                writer = None
    return results


def _chunks(todo: list[InputFile], options: PrepareOptions) -> Iterator[_Chunk]:
    for item in todo:
        texts: list[str] = []
        num_chars = 0
        documents = read_documents(
            item.path, text_key=options.text_key, doc_separator=options.doc_separator
        )
        for text, bytes_read in documents:
            texts.append(text)
            num_chars += len(text)
            if num_chars >= options.chunk_chars:
                yield _Chunk(item.sha256, texts, False, bytes_read)
                texts, num_chars = [], 0
        yield _Chunk(item.sha256, texts, True, item.num_bytes)


class _Encoder:
    """Texts to the bytes of their ids, each document followed by the end-of-document id
    (unless the tokenizer's own template already ended it with that id)."""

    def __init__(self, tokenizer: Tokenizer, eod_id: int, dtype: str) -> None:
        # "<|endoftext|>" written in a document is text, not a control token (nanoGPT's
        # encode_ordinary): only our own end-of-document id separates documents.
        if hasattr(tokenizer, "encode_special_tokens"):
            tokenizer.encode_special_tokens = True
        self.tokenizer = tokenizer
        self.eod_id = eod_id
        self.dtype = np.dtype("<u2" if dtype == "uint16" else "<u4")

    def __call__(self, texts: list[str]) -> bytes:
        ids: list[int] = []
        for encoding in self.tokenizer.encode_batch(texts) if texts else []:
            ids += encoding.ids
            if not encoding.ids or encoding.ids[-1] != self.eod_id:
                ids.append(self.eod_id)
        return np.asarray(ids, dtype=self.dtype).tobytes()


_WORKER_ENCODER: _Encoder | None = None


def _init_worker(tokenizer_path: str, eod_id: int, dtype: str) -> None:
    global _WORKER_ENCODER
    # Ctrl-C is the parent's to handle (it cancels the rest); a worker finishes its chunk.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The processes are the parallelism: one thread each, not one per core each.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_ENCODER = _Encoder(Tokenizer.from_file(tokenizer_path), eod_id, dtype)


def _encode_in_worker(texts: list[str]) -> bytes:
    assert _WORKER_ENCODER is not None, "worker used before _init_worker"
    return _WORKER_ENCODER(texts)


def _ordered_map(
    chunks: Iterable[_Chunk], tokenizer: Tokenizer, info: TokenizerInfo, workers: int
) -> Generator[tuple[_Chunk, bytes], None, None]:
    """Each chunk with its encoded bytes, in the chunks' order, whatever finishes first.

    With one worker the tokenizer runs here (it may still use threads of its own);
    otherwise at most two chunks per worker are in flight, which bounds memory."""
    if workers == 1:
        encoder = _Encoder(tokenizer, info.eod_id, info.dtype)
        yield from ((chunk, encoder(chunk.texts)) for chunk in chunks)
        return
    pool = ProcessPoolExecutor(
        max_workers=workers,
        # spawn, not fork: the progress bar runs a thread, and forking a threaded
        # process can deadlock the child.
        mp_context=get_context("spawn"),
        initializer=_init_worker,
        initargs=(str(info.path), info.eod_id, info.dtype),
    )
    pending: deque[tuple[_Chunk, Future[bytes]]] = deque()
    try:
        for chunk in chunks:
            pending.append((chunk, pool.submit(_encode_in_worker, chunk.texts)))
            if len(pending) >= 2 * workers:
                head, future = pending.popleft()
                yield head, future.result()
        while pending:
            head, future = pending.popleft()
            yield head, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


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
