"""Training and validation batches over a token file, deterministic in (seed, step).

Sample ``i`` is the window ``tokens[i * seq_len : i * seq_len + seq_len + 1]``
(windows overlap by one token, so every token but the last is a target exactly
once); inputs are its first ``seq_len`` tokens, targets its last ``seq_len``.
Windows run across document boundaries, as in nanoGPT and Megatron's GPT dataset.

The last ``ceil(val_fraction * num_samples)`` samples are held out for validation
(at least one when ``val_fraction > 0`` and there are two samples or more); the
rest are the training set. The end of the file rather than a random subset, so
that no training window overlaps a validation window except at the one boundary.

Step ``t``'s global batch is global samples ``g = t * batch_size + j``; sample
``g`` is training sample ``perm_e(g % num_train)`` with ``e = g // num_train`` its
epoch and ``perm_e`` a Feistel permutation keyed by (seed, e). So every epoch
visits every training sample once, in a new order, and a row's sample depends only
on (seed, step, row) and the data: a pipeline computes just its rows
``sample_range`` and any plan, rank count or restart sees the same batch.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from autohet_cli.dataset import DataError
from autohet_cli.dataset.formats import TokenSource
from autohet_cli.dataset.permutation import FeistelPermutation
from autohet_cli.dataset.vocab import check_token_ids

DEFAULT_VAL_FRACTION = 0.005

Microbatches = list[tuple[Tensor, Tensor]]


def num_val_samples_for(num_samples: int, val_fraction: float) -> int:
    """How many of ``num_samples`` the validation split takes (see the module docstring).

    ``Fraction(repr(f))`` is the decimal the user typed, so 0.1 of 30 is 3, not
    ``ceil(3.0000000000000004) == 4``.
    """
    if val_fraction == 0 or num_samples < 2:
        return 0
    return max(1, math.ceil(Fraction(repr(val_fraction)) * num_samples))


class TokenDataset:
    """The runtime's batches (``microbatches``, ``eval_microbatches``) over a ``TokenSource``."""

    # Step s's row r is sample s * batch_size + r of the shuffled stream: a resume under
    # another global batch continues at the next unseen sample (ckpt.lineage).
    samples_indexed = True

    def __init__(
        self,
        source: TokenSource,
        *,
        seq_len: int,
        seed: int,
        val_fraction: float = DEFAULT_VAL_FRACTION,
        vocab_size: int | None = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        if not 0 <= val_fraction < 1:
            raise DataError(
                f"--val-fraction {val_fraction}: must be in [0, 1) (e.g. 0.005 holds out "
                "0.5% of the samples; 0 holds out none)"
            )
        self.source, self.seq_len, self.seed = source, seq_len, seed
        self.val_fraction = val_fraction
        num_samples = (source.num_tokens - 1) // seq_len
        if num_samples < 1:
            raise DataError(
                f"--data {source.path}: {source.num_tokens} tokens is too few for one sample "
                f"of seq_len {seq_len} (it needs {seq_len + 1}); use more data or a shorter "
                "sequence"
            )
        self.num_val_samples = num_val_samples_for(num_samples, val_fraction)
        self.num_train_samples = num_samples - self.num_val_samples
        if self.num_train_samples < 1:
            raise DataError(
                f"--data {source.path}: --val-fraction {val_fraction} holds out all "
                f"{num_samples} samples; lower --val-fraction or use more data"
            )
        if vocab_size is not None:
            check_token_ids(source, vocab_size)

    # ----------------------------------------------------------------- training

    def microbatches(
        self, step: int, *, batch_size: int, sample_range: tuple[int, int], micro_batch_size: int
    ) -> Microbatches:
        """A pipeline's share ``sample_range`` of step ``step``, cut into micro-batches.

        Only the rows ``[start, stop)`` are read. The last micro-batch is shorter if
        ``stop - start`` is not a multiple of ``micro_batch_size`` (plans never ask that).
        """
        start, stop = _check_range(sample_range, batch_size, micro_batch_size)
        inputs, targets = self._windows(self._train_samples(step, batch_size, start, stop))
        return _cut(inputs, targets, micro_batch_size)

    def global_batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of step ``step``, each [batch_size, seq_len] int64."""
        return self._windows(self._train_samples(step, batch_size, 0, batch_size))

    def train_sample_indices(self, step: int, batch_size: int) -> NDArray[np.int64]:
        """Which samples (indices into the file's windows) step ``step`` trains on, in row order."""
        return self._train_samples(step, batch_size, 0, batch_size)

    def epoch_of(self, step: int, batch_size: int) -> float:
        """Epochs done before step ``step`` runs: samples consumed / training samples."""
        return step * batch_size / self.num_train_samples

    # ----------------------------------------------------------------- validation

    def eval_microbatches(
        self, index: int, *, batch_size: int, sample_range: tuple[int, int], micro_batch_size: int
    ) -> Microbatches:
        """Validation batch ``index``: validation samples ``index * batch_size + j`` in order.

        Not shuffled and wrapping modulo the split, so evaluation ``index`` sees the
        same samples every run and losses are comparable across evaluations.
        """
        if self.num_val_samples == 0:
            raise DataError(
                f"--data {self.source.path}: no validation samples (--val-fraction "
                f"{self.val_fraction}); raise --val-fraction (e.g. 0.005) to evaluate"
            )
        start, stop = _check_range(sample_range, batch_size, micro_batch_size)
        rows = np.arange(start, stop, dtype=np.int64) + index * batch_size
        samples = self.num_train_samples + rows % self.num_val_samples
        return _cut(*self._windows(samples), micro_batch_size)

    # ----------------------------------------------------------------- records

    def describe(self) -> dict[str, object]:
        """What a log or checkpoint records to recognise this data and its order."""
        return {
            "kind": self.source.kind,
            "path": str(self.source.path),
            "fingerprint": self.source.fingerprint(),
            "seq_len": self.seq_len,
            "seed": self.seed,
            "val_fraction": self.val_fraction,
            "num_train_samples": self.num_train_samples,
            "num_val_samples": self.num_val_samples,
        }

    # ----------------------------------------------------------------- internals

    def _train_samples(
        self, step: int, batch_size: int, start: int, stop: int
    ) -> NDArray[np.int64]:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rows = np.arange(start, stop, dtype=np.int64) + step * batch_size
        epochs, positions = np.divmod(rows, self.num_train_samples)
        samples = np.empty_like(rows)
        for epoch in np.unique(epochs).tolist():
            chosen = epochs == epoch
            order = FeistelPermutation.keyed(self.num_train_samples, "train", self.seed, epoch)
            samples[chosen] = order(positions[chosen])
        return samples

    def _windows(self, samples: NDArray[np.int64]) -> tuple[Tensor, Tensor]:
        span, tokens = self.seq_len + 1, self.source.tokens
        rows = np.empty((len(samples), span), dtype=np.int64)
        for r, sample in enumerate(samples.tolist()):
            rows[r] = tokens[sample * self.seq_len : sample * self.seq_len + span]
        windows = torch.from_numpy(rows)
        return windows[:, :-1], windows[:, 1:]


def _check_range(
    sample_range: tuple[int, int], batch_size: int, micro_batch_size: int
) -> tuple[int, int]:
    start, stop = sample_range
    if not 0 <= start <= stop <= batch_size or micro_batch_size < 1:
        raise ValueError(
            f"sample_range {sample_range} must lie in [0, {batch_size}] and "
            f"micro_batch_size ({micro_batch_size}) be at least 1"
        )
    return start, stop


def _cut(inputs: Tensor, targets: Tensor, micro_batch_size: int) -> Microbatches:
    return [
        (inputs[i : i + micro_batch_size], targets[i : i + micro_batch_size])
        for i in range(0, len(inputs), micro_batch_size)
    ]
