"""Synthetic token data whose batches depend only on (seed, step).

The corpus is a fixed pseudo-random stream of "words" (short token sequences
drawn from a small dictionary), so a language model has something to learn and
the loss falls. Step ``t``'s global batch is ``global_batch_size`` windows of
``seq_len + 1`` tokens at offsets drawn from a generator seeded by (seed, t):
any rank, any plan, any restart computes the same batch for the same step.
Each pipeline then takes its contiguous share of the global batch
(``Topology.sample_range``) and cuts it into micro-batches.

Evaluation batches (``eval_microbatches``) are windows of the same corpus drawn
from a disjoint seed namespace ("eval" instead of "batch"): synthetic data has no
held-out text, but evaluation ``i`` is the same batch in every run, so its loss is
comparable across evaluations. ``autohet_cli.runtime.data_api`` states the
protocol this class and ``autohet_cli.dataset.sampling.TokenDataset`` share.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

WORD_MAX_TOKENS = 8
MIN_CORPUS_TOKENS = 1 << 16


def _seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class SyntheticCorpus:
    def __init__(self, *, vocab_size: int, seq_len: int, seed: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"synthetic data needs a vocabulary of at least 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        gen = torch.Generator().manual_seed(_seed("corpus", seed, vocab_size))
        num_tokens = max(MIN_CORPUS_TOKENS, 4 * (seq_len + 1))
        num_words = min(4 * vocab_size, 4096)
        lengths = torch.randint(2, WORD_MAX_TOKENS + 1, (num_words,), generator=gen)
        spelling = torch.randint(0, vocab_size, (num_words, WORD_MAX_TOKENS), generator=gen)
        # At least two tokens per word: this many words always fill the corpus.
        words = torch.randint(0, num_words, (num_tokens // 2 + 1,), generator=gen)
        keep = torch.arange(WORD_MAX_TOKENS) < lengths[words].unsqueeze(1)
        self.tokens = spelling[words][keep][:num_tokens]

    def global_batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of step ``step``, each [batch_size, seq_len] int64."""
        return self._windows(_seed("batch", self.seed, step), batch_size)

    def _windows(self, seed: int, batch_size: int) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(seed)
        span = self.seq_len + 1
        starts = torch.randint(0, len(self.tokens) - span + 1, (batch_size,), generator=gen)
        windows = self.tokens[starts.unsqueeze(1) + torch.arange(span)]
        return windows[:, :-1], windows[:, 1:]

    def microbatches(
        self, step: int, *, batch_size: int, sample_range: tuple[int, int], micro_batch_size: int
    ) -> list[tuple[Tensor, Tensor]]:
        """A pipeline's share ``sample_range`` of step ``step``, cut into micro-batches."""
        inputs, targets = self.global_batch(step, batch_size)
        start, stop = sample_range
        return [
            (inputs[i : i + micro_batch_size], targets[i : i + micro_batch_size])
            for i in range(start, stop, micro_batch_size)
        ]

    def eval_microbatches(
        self, index: int, *, batch_size: int, sample_range: tuple[int, int], micro_batch_size: int
    ) -> list[tuple[Tensor, Tensor]]:
        """Evaluation batch ``index``'s share ``sample_range``, cut into micro-batches."""
        inputs, targets = self._windows(_seed("eval", self.seed, index), batch_size)
        start, stop = sample_range
        return [
            (inputs[i : i + micro_batch_size], targets[i : i + micro_batch_size])
            for i in range(start, stop, micro_batch_size)
        ]

    def describe(self) -> dict[str, object]:
        """What a log or checkpoint records: synthetic data is fixed by these four numbers."""
        return {
            "kind": "synthetic",
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "num_tokens": len(self.tokens),
        }
