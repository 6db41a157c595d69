"""The step loop's guards (``runtime.batchcheck``) on their own."""

from __future__ import annotations

import math

import pytest
import torch

from autohet_cli.runtime.batchcheck import (
    BatchError,
    DivergedError,
    NonFiniteGuard,
    check_token_ids,
)


def _mb(inputs: list[int], labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([inputs]), torch.tensor([labels])


def test_ids_inside_the_vocabulary_and_ignored_labels_pass() -> None:
    check_token_ids([_mb([0, 5, 9], [5, 9, -100])], 10, step=3)
    check_token_ids([], 10, step=0)


@pytest.mark.parametrize(
    ("inputs", "labels", "bad", "where"),
    [
        ([0, 10, 1], [1, 2, 3], 10, "inputs"),
        ([0, 1, 2], [1, 2, 60000], 60000, "labels"),
        ([0, -1, 2], [1, 2, 3], -1, "inputs"),
        ([0, 1, 2], [1, -5, 3], -5, "labels"),  # only -100 is an ignored label
    ],
)
def test_an_id_outside_is_named_with_its_step_and_place(
    inputs: list[int], labels: list[int], bad: int, where: str
) -> None:
    ok = _mb([1, 2, 3], [2, 3, 4])
    with pytest.raises(BatchError) as got:
        check_token_ids([ok, _mb(inputs, labels)], 10, step=7)
    text = str(got.value)
    assert text.startswith("step 7: micro-batch 1's " + where)
    assert f"token id {bad}," in text and "ids 0..9" in text


def test_float_ids_are_refused() -> None:
    with pytest.raises(BatchError, match="float32 token ids"):
        check_token_ids([(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.long))], 10, step=0)


def test_the_guard_counts_non_finite_steps_in_a_row_only() -> None:
    guard = NonFiniteGuard(3)
    assert guard.after_step(step=0, loss=math.nan, grad_norm=1.0)
    assert guard.after_step(step=1, loss=1.0, grad_norm=math.inf)
    assert not guard.after_step(step=2, loss=1.0, grad_norm=1.0)  # the count starts over
    guard.after_step(step=3, loss=math.inf, grad_norm=None)
    guard.after_step(step=4, loss=math.nan, grad_norm=math.nan)
    with pytest.raises(DivergedError, match=r"since step 3 were not finite") as got:
        guard.after_step(step=5, loss=math.nan, grad_norm=math.nan)
    assert "weights are those before step 3" in str(got.value)


def test_the_guard_needs_a_positive_limit() -> None:
    with pytest.raises(ValueError, match="max-nonfinite-steps"):
        NonFiniteGuard(0)


def test_an_fp16_scale_halved_to_nothing_stops_the_run() -> None:
    guard = NonFiniteGuard(3)
    guard.check_scale(step=1, scale=1.0)
    with pytest.raises(DivergedError, match=r"step 9: the fp16 loss scale fell to 0\.00"):
        guard.check_scale(step=9, scale=2.0**-9)


def test_a_token_files_unsigned_ids_are_checked() -> None:
    ids = torch.tensor([[1, 2, 300]]).to(torch.uint16)
    with pytest.raises(BatchError, match="token id 300"):
        check_token_ids([(ids, ids)], 256, step=0)
