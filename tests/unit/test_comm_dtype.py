"""One communication-dtype decision, charged by the cost model and run by the runtime.

``autohet_cli.settings`` states it: stage-to-stage activations (and their
gradients) in the compute dtype, data-parallel gradient all-reduce in fp32. These
tests hold the cost model's bytes to the dtypes the runtime uses; the real
two-process gloo exchange through ``P2P`` is ``tests/dist/test_comm_dtype_p2p.py``.
"""

from __future__ import annotations

import pytest
import torch

from autohet_cli.runtime.gradsync import REDUCE_DTYPE
from autohet_cli.runtime.pipeline import comm_dtype
from autohet_cli.settings import COMPUTE_DTYPES, PRECISIONS, TrainingSettings


def _settings(precision: str) -> TrainingSettings:
    return TrainingSettings(
        global_batch_size=8, micro_batch_size=1, seq_len=16, precision=precision
    )


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_cost_model_charges_the_bytes_the_runtime_sends(precision: str) -> None:
    compute = getattr(torch, COMPUTE_DTYPES[precision])  # what a GPU run computes in
    sent = comm_dtype(compute)
    assert torch.empty((), dtype=sent).element_size() == _settings(precision).dtype_bytes
    reduced = torch.empty((), dtype=REDUCE_DTYPE).element_size()
    assert reduced == _settings(precision).grad_bytes_per_param == 4


def test_a_bf16_plan_charges_half_the_send_bytes_and_full_gradient_bytes() -> None:
    bf16, fp32 = _settings("bf16"), _settings("fp32")
    assert bf16.dtype_bytes * 2 == fp32.dtype_bytes
    assert bf16.grad_bytes_per_param == fp32.grad_bytes_per_param
