"""Pieces of documents to token bytes, in this process or in a pool of workers.

A ``Chunk`` is a task: about ``chunk_chars`` characters of pieces of one input
(``dataset.pieces``), with which of them start and end a document. A document that
fits one piece is encoded as before (with the tokenizer's template, e.g. Llama's
``<s>``); the pieces of a longer one are encoded without it and the template's ids
are put back once, before its first piece and after its last, so a cut document gets
them once, as a whole one does. Every document is followed by the end-of-document id
(unless the template already ended it with that id).

A worker that dies (the kernel's out-of-memory killer, a ``kill -9``, a crash) breaks
the pool: that is a ``WorkerDied`` naming the cause and the inputs in flight, not a
``BrokenProcessPool`` traceback.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from collections.abc import Generator, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.process import BaseProcess
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from autohet_cli.dataset import WorkerDied

# Texts whose encoding shows the template's ids around a text (the first that
# encodes to some non-template token is used).
_TEMPLATE_PROBES = ("a", "hello world", "0", ".", "The")


@dataclass(frozen=True, slots=True)
class Chunk:
    path: Path  # the input, named when its worker dies
    sha256: str
    texts: list[str]
    starts: list[bool]  # texts[i] is the first piece of a document
    ends: list[bool]  # texts[i] is the last piece of a document
    last: bool  # the input's final chunk (possibly empty)
    bytes_read: int  # of the input file, when this chunk was cut

    @property
    def num_documents(self) -> int:
        return sum(self.ends)


def template_ids(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a single text."""
    for probe in _TEMPLATE_PROBES:
        encoding = tokenizer.encode(probe)
        mask = encoding.special_tokens_mask
        if 0 in mask:
            first, stop = mask.index(0), len(mask) - mask[::-1].index(0)
            return encoding.ids[:first], encoding.ids[stop:]
    return tokenizer.encode("").ids, []


class Encoder:
    """Pieces to the bytes of their ids (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, eod_id: int, dtype: str) -> None:
        # "<|endoftext|>" written in a document is text, not a control token (nanoGPT's
        # encode_ordinary): only our own end-of-document id separates documents.
        if hasattr(tokenizer, "encode_special_tokens"):
            tokenizer.encode_special_tokens = True
        self.tokenizer = tokenizer
        self.eod_id = eod_id
        self.dtype = np.dtype("<u2" if dtype == "uint16" else "<u4")
        self.prefix, self.suffix = template_ids(tokenizer)

    def __call__(self, texts: list[str], starts: list[bool], ends: list[bool]) -> bytes:
        whole = [i for i in range(len(texts)) if starts[i] and ends[i]]
        cut = [i for i in range(len(texts)) if not (starts[i] and ends[i])]
        encoded: list[list[int]] = [[] for _ in texts]
        for i, ids in zip(whole, self._encode([texts[i] for i in whole], True), strict=True):
            encoded[i] = ids
        for i, ids in zip(cut, self._encode([texts[i] for i in cut], False), strict=True):
            encoded[i] = [*(self.prefix if starts[i] else ()), *ids]
            encoded[i] += self.suffix if ends[i] else ()
        out: list[int] = []
        for i, ids in enumerate(encoded):
            out += ids
            if ends[i] and (not ids or ids[-1] != self.eod_id):
                out.append(self.eod_id)
        return np.asarray(out, dtype=self.dtype).tobytes()

    def _encode(self, texts: list[str], template: bool) -> list[list[int]]:
        if not texts:
            return []
        batch = self.tokenizer.encode_batch(texts, add_special_tokens=template)
        return [encoding.ids for encoding in batch]


_WORKER_ENCODER: Encoder | None = None


def _init_worker(tokenizer_path: str, eod_id: int, dtype: str) -> None:
    global _WORKER_ENCODER
    # Ctrl-C is the parent's to handle (it cancels the rest); a worker finishes its chunk.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The processes are the parallelism: one thread each, not one per core each.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_ENCODER = Encoder(Tokenizer.from_file(tokenizer_path), eod_id, dtype)


def _encode_in_worker(texts: list[str], starts: list[bool], ends: list[bool]) -> bytes:
    assert _WORKER_ENCODER is not None, "worker used before _init_worker"
    return _WORKER_ENCODER(texts, starts, ends)


def ordered_map(
    chunks: Iterable[Chunk],
    tokenizer: Tokenizer,
    *,
    tokenizer_path: Path,
    eod_id: int,
    dtype: str,
    workers: int,
) -> Generator[tuple[Chunk, bytes], None, None]:
    """Each chunk with its encoded bytes, in the chunks' order, whatever finishes first.

    With one worker the tokenizer runs here (it may still use threads of its own);
    otherwise at most two chunks per worker are in flight, which bounds memory."""
    if workers == 1:
        encoder = Encoder(tokenizer, eod_id, dtype)
        yield from ((chunk, encoder(chunk.texts, chunk.starts, chunk.ends)) for chunk in chunks)
        return
    pool = ProcessPoolExecutor(
        max_workers=workers,
        # spawn, not fork: the progress bar runs a thread, and forking a threaded
        # process can deadlock the child.
        mp_context=get_context("spawn"),
        initializer=_init_worker,
        initargs=(str(tokenizer_path), eod_id, dtype),
    )
    processes: dict[int, BaseProcess] = {}  # every worker started, to tell how one died
    pending: deque[tuple[Chunk, Future[bytes]]] = deque()
    try:
        for chunk in chunks:
            try:
                future = pool.submit(_encode_in_worker, chunk.texts, chunk.starts, chunk.ends)
            except BrokenProcessPool:
                raise _worker_died(processes, [c for c, _ in pending] + [chunk]) from None
            _remember(processes, pool)
            pending.append((chunk, future))
            if len(pending) >= 2 * workers:
                yield _next_result(pending, processes)
                _remember(processes, pool)  # the pool starts workers as it needs them
        while pending:
            yield _next_result(pending, processes)
            _remember(processes, pool)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _next_result(
    pending: deque[tuple[Chunk, Future[bytes]]], processes: dict[int, BaseProcess]
) -> tuple[Chunk, bytes]:
    head, future = pending[0]
    try:
        data = future.result()
    except BrokenProcessPool:
        raise _worker_died(processes, [c for c, _ in pending]) from None
    pending.popleft()
    return head, data


def _worker_died(processes: dict[int, BaseProcess], in_flight: list[Chunk]) -> WorkerDied:
    names = list(dict.fromkeys(str(chunk.path) for chunk in in_flight))
    where = f" while tokenizing {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
    return WorkerDied(
        f"a tokenizer worker process died ({_death_cause(processes)})"
        f"{where if names else ''}; run again with fewer --workers (each holds its own "
        "tokenizer and text in memory), or split the largest documents into smaller ones"
    )


def _remember(processes: dict[int, BaseProcess], pool: ProcessPoolExecutor) -> None:
    processes.update(getattr(pool, "_processes", None) or {})


def _death_cause(processes: dict[int, BaseProcess]) -> str:
    """How a worker ended, from the exit codes: a signal from outside first (the pool
    itself sends SIGTERM to the others once one has died). A dead worker's status can
    lag the pool's notice of it: each is given a moment to be reaped."""
    deadline = time.monotonic() + 2.0
    for p in processes.values():
        if p.exitcode is None:
            p.join(max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in processes.values() if p.exitcode not in (None, 0)]
    codes.sort(key=lambda code: code == -signal.SIGTERM)
    if not codes or codes[0] is None:
        return "it exited without a status"
    code = codes[0]
    if code > 0:
        return f"it exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGKILL:
        return (
            f"killed by {name}, as the kernel's out-of-memory killer does: probably out of memory"
        )
    return f"killed by {name}"
