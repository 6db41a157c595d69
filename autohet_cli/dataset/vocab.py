"""Check that a token file fits the model's vocabulary before training on it.

An id at or above the vocabulary size crashes the embedding lookup on the GPU
(a device-side assert, far from the cause) or, worse, on some kernels reads
garbage silently. Data tokenized with another tokenizer is the usual cause, and
it is cheap to see before the first step: the max over the memory map.

Up to ``FULL_SCAN_MAX_TOKENS`` tokens we scan everything (a fraction of a second
per 1e8 uint16 tokens). Above that we scan ``SAMPLE_CHUNKS`` chunks spread evenly
over the file, the first and last included: a foreign tokenizer's ids show up
everywhere, so a sample finds them without reading a terabyte at every start.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autohet_cli.dataset import DataError
from autohet_cli.dataset.formats import TokenSource

FULL_SCAN_MAX_TOKENS = 100_000_000
SCAN_CHUNK_TOKENS = 1 << 24
SAMPLE_CHUNKS = 64
SAMPLE_CHUNK_TOKENS = 1 << 18


@dataclass(frozen=True, slots=True, kw_only=True)
class IdRange:
    """Smallest and largest id seen; ``complete`` is False when only a sample was read."""

    min_id: int
    max_id: int
    complete: bool


def id_range(source: TokenSource) -> IdRange:
    """The range of ids in ``source`` (all of it, or a deterministic sample if huge)."""
    tokens, n = source.tokens, source.num_tokens
    if n <= FULL_SCAN_MAX_TOKENS:
        starts = list(range(0, n, SCAN_CHUNK_TOKENS))
        length, complete = SCAN_CHUNK_TOKENS, True
    else:
        last = n - SAMPLE_CHUNK_TOKENS
        starts = sorted({int(s) for s in np.linspace(0, last, SAMPLE_CHUNKS)})
        length, complete = SAMPLE_CHUNK_TOKENS, False
    lo, hi = None, None
    for start in starts:
        chunk = tokens[start : start + length]
        c_lo, c_hi = int(chunk.min()), int(chunk.max())
        lo = c_lo if lo is None else min(lo, c_lo)
        hi = c_hi if hi is None else max(hi, c_hi)
    assert lo is not None and hi is not None  # a TokenSource is never empty
    return IdRange(min_id=lo, max_id=hi, complete=complete)


def check_token_ids(source: TokenSource, vocab_size: int) -> None:
    """Raise a DataError if ``source`` holds an id outside ``[0, vocab_size)``."""
    found = id_range(source)
    name = source.path.name if source.kind != "autohet" else "tokens.bin"
    how = "" if found.complete else f" (in {SAMPLE_CHUNKS} chunks sampled over the file)"
    if found.max_id >= vocab_size:
        raise DataError(
            f"--data {source.path}: the model's vocabulary is {vocab_size} but {name} holds id "
            f"{found.max_id}{how}: prepare the data with the model's tokenizer"
        )
    if found.min_id < 0:
        raise DataError(
            f"--data {source.path}: {name} holds the negative id {found.min_id}{how}; "
            "token ids are never negative: check the file and its dtype"
        )
