"""The head's loss in chunks of tokens: lm_loss's value and gradients, never whole logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autohet_cli import layerspec
from autohet_cli.models import IGNORE_INDEX, get_model
from autohet_cli.runtime.models import build
from autohet_cli.runtime.models.loss import head_loss, lm_loss
from tests.hf_reference import model_request


class LargestTensor(TorchDispatchMode):
    """The most elements any op allocated while active (views of its inputs not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        held = {a.untyped_storage().data_ptr() for a in inputs if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held:
                self.numel = max(self.numel, t.numel())
        return out


def _case(
    vocab: int, rows: int, seed: int = 0
) -> tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(rows, 32, generator=g) * 0.2)
    hidden = torch.randn(3, 20, 32, generator=g).requires_grad_()
    targets = torch.randint(0, vocab, (3, 20), generator=g)
    targets[0, :4] = IGNORE_INDEX  # e.g. a document boundary: adds nothing
    return weight, hidden, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [7, 60, 1000])
@pytest.mark.parametrize("vocab", [500, 512])  # 12 padded rows (no probability, no gradient)
@pytest.mark.parametrize("group_chunks", [1, 4])  # chunks per weight-gradient matmul
def test_chunked_loss_equals_lm_loss_value_and_gradients(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    chunk_tokens: int,
    vocab: int,
    group_chunks: int,
) -> None:
    rows = 512
    weight, hidden, targets = _case(vocab, rows)
    project = lambda h: F.linear(h, weight)  # noqa: E731
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    with autocast:
        ref = lm_loss(project(hidden), targets, vocab)
    ref.backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    monkeypatch.setattr(layerspec, "CHUNK_LOGIT_BYTES", chunk_tokens * rows * 4)
    size = 4 if dtype == torch.float32 else 2
    monkeypatch.setattr(layerspec, "GROUP_LOGIT_BYTES", group_chunks * chunk_tokens * rows * size)
    with autocast:
        out = head_loss(hidden, weight, targets, vocab, project)
    (out * 3.0).backward()  # a scale on the loss (1 / global batch, loss scaling) reaches both
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(hidden.grad, 3.0 * ref_h, rtol=tol, atol=tol * ref_h.abs().max())
    assert torch.allclose(weight.grad, 3.0 * ref_w, rtol=tol, atol=tol * ref_w.abs().max())
    assert vocab == rows or weight.grad[vocab:].abs().max() == 0  # padding rows learn nothing
    assert weight.grad.dtype == weight.dtype and hidden.grad.dtype == hidden.dtype


def test_the_recomputed_way_equals_lm_loss_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP heads and fp16 recompute each chunk in backward (checkpoint) instead."""
    from autohet_cli.runtime.models import loss

    monkeypatch.setattr(loss, "_fused_ok", lambda hidden, weight: False)
    monkeypatch.setattr(layerspec, "CHUNK_LOGIT_BYTES", 9 * 512 * 4)
    weight, hidden, targets = _case(500, 512, seed=1)
    project = lambda h: F.linear(h, weight)  # noqa: E731
    ref = lm_loss(project(hidden), targets, 500)
    ref.backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    out = head_loss(hidden, weight, targets, 500, project)
    out.backward()
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(hidden.grad, ref_h, atol=1e-6)
    assert torch.allclose(weight.grad, ref_w, atol=1e-6)


def test_no_whole_logits_are_ever_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward of the built-in head on a micro-batch whose logits are 16x
    a chunk: no op makes a tensor as large as the micro-batch's logits."""
    spec = get_model("llama-tiny")
    mbs, seq = 4, 64
    head = build(model_request(spec, seq_len=seq, micro_batch_size=mbs)).layers[-1]
    rows = spec.padded_vocab_size
    monkeypatch.setattr(layerspec, "CHUNK_LOGIT_BYTES", mbs * seq * rows * 4 // 16)
    # groups of chunks share one weight-gradient matmul: a quarter of the micro-batch
    # in bf16 (4 chunks), an eighth in fp32 (2 chunks)
    monkeypatch.setattr(layerspec, "GROUP_LOGIT_BYTES", mbs * seq * rows * 2 // 4)
    x = torch.randn(mbs, seq, spec.hidden_size, requires_grad=True)
    targets = torch.randint(0, spec.vocab_size, (mbs, seq))
    with torch.no_grad():
        whole = lm_loss(head(x), targets, spec.vocab_size)
    largest = LargestTensor()
    for dtype in (torch.bfloat16, torch.float32):
        with largest, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = head.loss(x, targets)
            loss.backward()
        assert loss.item() == pytest.approx(whole.item(), rel=2e-2)
    # a group's logits' gradient, or the weight's size (its cast, its fp32 gradient):
    # all under the micro-batch's logits
    bound = max(mbs * seq * rows // 4, rows * spec.hidden_size)
    assert bound < mbs * seq * rows
    assert largest.numel <= bound


@pytest.mark.parametrize("group_chunks", [1, 2, 100])
def test_the_probes_copy_takes_the_runtimes_loss(
    monkeypatch: pytest.MonkeyPatch, group_chunks: int
) -> None:
    """The probe runs alone on hosts, so it carries a copy of the head's chunked loss:
    the same value and gradients as the runtime's (mean over tokens there), groups of
    chunks included, and the same chunk and group sizes."""
    from autohet_cli.profiling.probe import loss as probe

    assert probe.CHUNK_LOGIT_BYTES == layerspec.CHUNK_LOGIT_BYTES
    assert probe.GROUP_LOGIT_BYTES == layerspec.GROUP_LOGIT_BYTES
    monkeypatch.setattr(probe, "GROUP_LOGIT_BYTES", group_chunks * 11 * 512 * 4)

    weight, hidden, targets = _case(512, 512, seed=2)  # no padding, no ignored targets
    targets[0, :4] = 3
    flat_h = hidden.detach().flatten(0, 1).requires_grad_()
    out = probe.ChunkedLoss.apply(flat_h, weight, targets.flatten(), 11)
    out.backward()
    probe_h, probe_w = flat_h.grad.clone(), weight.grad.clone()
    weight.grad = None
    ref = head_loss(hidden, weight, targets, 512, lambda h: F.linear(h, weight)) * 20
    ref.backward()
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(probe_h, hidden.grad.flatten(0, 1), atol=1e-6)
    assert torch.allclose(probe_w, weight.grad, atol=1e-6)


def test_evaluation_forms_no_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under no_grad (validation) the loss alone: no fp32 weight gradient is made."""
    monkeypatch.setattr(layerspec, "CHUNK_LOGIT_BYTES", 7 * 512 * 4)
    weight, hidden, targets = _case(500, 512, seed=3)
    largest = LargestTensor()
    with torch.no_grad():
        ref = lm_loss(F.linear(hidden, weight), targets, 500)
        with largest:
            out = head_loss(hidden, weight, targets, 500, lambda h: F.linear(h, weight))
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)
    assert largest.numel <= 7 * 512 < weight.numel()


class CountSized(TorchDispatchMode):
    """How many new tensors of ``numel`` elements ops made while active."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.target, self.count = numel, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        held = {a.untyped_storage().data_ptr() for a in inputs if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (
                isinstance(t, torch.Tensor)
                and t.numel() == self.target
                and t.untyped_storage().data_ptr() not in held
            ):
                self.count += 1
        return out


def test_recomputed_chunks_join_their_input_gradients_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliced chunks would each give a whole zero-padded input gradient, summed chunk
    by chunk (3 hidden-sized tensors alive, a pass per chunk); split ones join once."""
    from autohet_cli.runtime.models import loss

    monkeypatch.setattr(loss, "_fused_ok", lambda hidden, weight: False)
    monkeypatch.setattr(layerspec, "CHUNK_LOGIT_BYTES", 6 * 512 * 4)  # 10 chunks of 6
    weight, hidden, targets = _case(500, 512, seed=4)
    out = head_loss(hidden, weight, targets, 500, lambda h: F.linear(h, weight))
    counter = CountSized(hidden.numel())
    with counter:
        out.backward()
    assert counter.count <= 2, counter.count


@pytest.mark.parametrize("vocab", [500, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_form_for_torch_compile_equals_the_in_place_one(
    vocab: int, dtype: torch.dtype
) -> None:
    """``_ce_fused`` (what the runtime compiles on GPUs) and ``_ce_in_place`` (eager):
    the same loss and logits' gradient, ignored targets and padding rows included."""
    from autohet_cli.runtime.models import loss as L

    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(37, 512, generator=g) * 3).to(dtype)
    t = torch.randint(0, vocab, (37,), generator=g)
    t[:5] = IGNORE_INDEX
    for want in (True, False):
        # the in-place form works over the logits themselves when they are fp32
        a_loss, a_grad = L._ce_in_place(logits.clone(), t, vocab, want)
        b_loss, b_grad = L._ce_fused(logits.clone(), t, vocab, want)
        assert b_loss.item() == pytest.approx(a_loss.item(), rel=1e-6)
        if not want:
            assert a_grad is None and b_grad is None
            continue
        assert a_grad is not None and b_grad is not None
        assert a_grad.dtype == b_grad.dtype == dtype
        assert torch.allclose(
            a_grad.float(), b_grad.float(), atol=1e-6 if dtype == torch.float32 else 1e-2
        )
        assert b_grad[:5].abs().max() == 0  # ignored tokens
        assert vocab == 512 or b_grad[:, vocab:].abs().max() == 0  # padding rows


@pytest.mark.slow("inductor compiles the chunked cross-entropy's forward and backward (C++)")
def test_the_compiled_loss_equals_eager_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile_loss()`` (the runtime calls it where it compiles its blocks): the head's
    loss and gradients through the compiled per-chunk cross-entropy, several groups."""
    from autohet_cli.runtime.models import loss as L

    pytest.importorskip("torch._inductor")
    rows = vocab = 512
    weight, hidden, targets = _case(vocab, rows)
    project = lambda h: F.linear(h, weight)  # noqa: E731
    monkeypatch.setattr(layerspec, "CHUNK_LOGIT_BYTES", 16 * rows * 4)
    monkeypatch.setattr(layerspec, "GROUP_LOGIT_BYTES", 32 * rows * 4)
    eager = head_loss(hidden, weight, targets, vocab, project)
    eager.backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    monkeypatch.setattr(L, "_CE_COMPILED", None)
    L.compile_loss()
    assert L._CE_COMPILED is not None
    try:
        out = head_loss(hidden, weight, targets, vocab, project)
        out.backward()
    except Exception as exc:  # no C++ compiler for inductor's CPU code
        if "compiler" in str(exc).lower():
            pytest.skip(f"inductor cannot compile here: {exc}")
        raise
    assert out.item() == pytest.approx(eager.item(), rel=1e-5)
    assert torch.allclose(hidden.grad, ref_h, rtol=1e-4, atol=1e-6)
    assert torch.allclose(weight.grad, ref_w, rtol=1e-4, atol=1e-6)
