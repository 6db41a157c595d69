"""Guards of the step loop: token ids inside the vocabulary, and a loss that stays finite.

Token ids are checked where they are used, on every rank, every batch. The token
file's check at start-up (``dataset.vocab``) samples files over 1e8 tokens, and a
custom ``--data-fn`` is never checked there; an id at or above the vocabulary is
then silent under tensor parallelism (the vocab-parallel embedding masks ids
outside each shard, so the row reads as zeros and the loss looks plausible) and a
bare ``IndexError`` or a device-side assert without it. A min and a max per
micro-batch are a few microseconds against a step; they are taken on the host
when the batch is there (the data pipeline's tensors), so no GPU sync is added.

A non-finite global gradient norm skips the optimizer step (the weights stay as
they were, so checkpoints stay usable). A step whose loss or gradient norm is not
finite counts; after ``max_nonfinite_steps`` of them in a row the run stops with
an error: a diverged run that "finishes" with exit 0 wastes the whole allocation.
(The loss is known only after the update; with the built-in loss a non-finite
loss comes with non-finite gradients, so its step was skipped too.) Under fp16 the
loss scaler skips overflowing steps itself; a scale halved below
``MIN_LOSS_SCALE`` means the gradients overflow whatever the scale, and stops the
run the same way. Every rank sees the same loss (all-reduced), the same global
norm and the same scale, so every rank stops at the same step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from autohet_cli.errors import AutohetError
from autohet_cli.models import IGNORE_INDEX as IGNORE_INDEX  # a label that adds no loss

MIN_LOSS_SCALE = 2.0**-8  # fp16: below it, every step overflows; training has diverged


class BatchError(AutohetError):
    """A batch the model cannot train on (an id outside the vocabulary)."""


class DivergedError(AutohetError):
    """The loss stayed non-finite for too many steps in a row."""


def check_token_ids(
    microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    vocab_size: int,
    *,
    step: int,
    what: str = "step",
) -> None:
    """Raise ``BatchError`` when an input id is outside ``[0, vocab_size)`` or a label
    outside it other than ``IGNORE_INDEX``. Host tensors (the data pipeline's) cost
    no device sync; a ``--data-fn`` that yields device tensors costs one per step."""
    if not microbatches:
        return
    lows, highs = [], []
    for inputs, labels in microbatches:
        inputs, labels = _as_ids(inputs), _as_ids(labels)
        for t in (inputs, labels):
            if t.numel() == 0:
                continue
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise BatchError(
                    f"{what} {step}: a micro-batch holds {t.dtype} token ids; the model "
                    "takes integer ids (check --data-dtype or the --data-fn's tensors)"
                )
        lo_in, hi_in = torch.aminmax(inputs) if inputs.numel() else (None, None)
        if labels.numel():
            # -100 adds no loss; keep it out of the minimum by mapping it to 0.
            valid = torch.where(labels == IGNORE_INDEX, torch.zeros_like(labels), labels)
            lo_lab, hi_lab = torch.aminmax(valid)
        else:
            lo_lab, hi_lab = None, None
        lows += [x for x in (lo_in, lo_lab) if x is not None]
        highs += [x for x in (hi_in, hi_lab) if x is not None]
    if not lows:
        return
    lo, hi = (int(v) for v in torch.stack([torch.stack(lows).min(), torch.stack(highs).max()]))
    if hi >= vocab_size or lo < 0:
        bad, where = _first_bad(microbatches, vocab_size)
        raise BatchError(
            f"{what} {step}: {where} holds token id {bad}, outside the model's vocabulary "
            f"(ids 0..{vocab_size - 1}): the data was tokenized with another tokenizer, or "
            "read with the wrong --data-dtype; prepare it with the model's tokenizer "
            "(autohet data prepare)"
        )


def _as_ids(t: torch.Tensor) -> torch.Tensor:
    """uint16/uint32 (a token file's own dtypes) as int64: comparisons and aminmax
    have no kernels for them."""
    return t.to(torch.int64) if t.dtype in (torch.uint16, torch.uint32) else t


def _first_bad(
    microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]], vocab_size: int
) -> tuple[int, str]:
    """The first offending id and where it is (only on the error path)."""
    for index, (raw_inputs, raw_labels) in enumerate(microbatches):
        inputs, labels = _as_ids(raw_inputs), _as_ids(raw_labels)
        for name, t, allowed in (("inputs", inputs, None), ("labels", labels, IGNORE_INDEX)):
            bad = (t < 0) | (t >= vocab_size)
            if allowed is not None:
                bad &= t != allowed
            if bool(bad.any()):
                value = int(t[bad].flatten()[0])
                return value, f"micro-batch {index}'s {name}"
    return -1, "a micro-batch"  # unreachable when the range check failed


class NonFiniteGuard:
    """Counts steps in a row whose loss or gradient norm is not finite."""

    def __init__(self, max_steps: int) -> None:
        if max_steps < 1:
            raise ValueError(f"--max-nonfinite-steps must be >= 1, got {max_steps}")
        self.max_steps = max_steps
        self.in_a_row = 0
        self.first_bad_step: int | None = None

    @staticmethod
    def bad(value: float | None) -> bool:
        return value is not None and not math.isfinite(value)

    def check_scale(self, *, step: int, scale: float) -> None:
        """fp16: raise once the loss scaler halved its scale below ``MIN_LOSS_SCALE``."""
        if scale < MIN_LOSS_SCALE:
            raise DivergedError(
                f"step {step}: the fp16 loss scale fell to {scale:g}: the gradients overflow "
                "at any scale, so training stops. Lower the learning rate, train in bf16 "
                "(--precision bf16 at plan time) or check the data, then resume from the "
                "last checkpoint"
            )

    def after_step(self, *, step: int, loss: float, grad_norm: float | None) -> bool:
        """Record ``step``; True when it was non-finite. Raises ``DivergedError`` once
        ``max_steps`` steps in a row were."""
        if not (self.bad(loss) or self.bad(grad_norm)):
            self.in_a_row, self.first_bad_step = 0, None
            return False
        self.in_a_row += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
        if self.in_a_row >= self.max_steps:
            what = f"loss {loss}" if self.bad(loss) else f"gradient norm {grad_norm}"
            raise DivergedError(
                f"step {step}: {what}; {self.in_a_row} step(s) in a row since step "
                f"{self.first_bad_step} were not finite (--max-nonfinite-steps "
                f"{self.max_steps}), so training stops. Their optimizer steps were skipped: "
                f"the weights are those before step {self.first_bad_step}. Lower the "
                "learning rate or raise --warmup-steps, check the --init-from weights and "
                "the data, then resume from the last checkpoint"
            )
        return True
