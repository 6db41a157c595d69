"""The LM head and its cross-entropy in chunks of tokens: never a whole micro-batch's logits.

Why hand-written: a 128k vocabulary makes one micro-batch's fp32 logits the
largest tensor of the step (LLaMA-3 1.2B at 8 x 2048 tokens: 7.8 GiB, then as
much again for their gradient, beside the 16-bit logits), which torch's
``cross_entropy`` needs whole. torch has no fused linear + cross-entropy (Liger
Kernel's is Triton-only, GPU-only and takes no DTensor), so ``head_loss`` runs
the head and the loss over chunks of at most ``CHUNK_LOGIT_BYTES`` of fp32
logits, in one of two ways:

- **Gradients in the forward** (``_FusedHeadLoss``; plain tensors, fp32 or bf16):
  each chunk's logits give their loss and, while they are at hand, the gradients
  of the head's input and weight (softmax minus the one-hot target, through the
  same 16-bit matmuls autograd would run); backward only scales what forward
  kept: the input's gradient (one hidden state per token) and one fp32 weight
  gradient. The same three matmuls as unfused, nothing run twice. Two things keep
  its memory traffic below its matmuls' time (on a 128k vocabulary it was not:
  the head took 9% more of an H200's step than HF's compiled model): the weight
  gradient is formed once per group of chunks (``layerspec.loss_group_tokens``,
  their logits' gradient within 1 GiB) rather than per chunk, and where the
  runtime compiles its blocks it compiles each chunk's cross-entropy too
  (``compile_loss``: one reduction and one pointwise pass over the 16-bit logits).
- **Recomputed chunks** (``torch.utils.checkpoint`` per chunk): for a TP head
  (DTensor logits sharded over the vocabulary, the loss under ``loss_parallel``)
  and for fp16, whose gradients must be formed after the loss scale multiplies
  them or they underflow. Costs one more head forward per step.

The value is ``lm_loss``'s: the sum over samples of each sample's mean token
cross-entropy, padded vocabulary rows excluded, ``IGNORE_INDEX`` targets adding
nothing. The cost model counts what each way keeps (``models.LayerSpec.loss_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from autohet_cli.layerspec import IGNORE_INDEX, loss_chunk_tokens, loss_group_tokens

__all__ = ["LmLoss", "compile_loss", "head_loss", "lm_loss"]

Project = Callable[[Tensor], Tensor]


def lm_loss(logits: Tensor, targets: Tensor, vocab_size: int | None = None) -> Tensor:
    """Sum over the micro-batch's samples of each sample's mean token cross-entropy.

    Logits of padded vocabulary rows (``vocab_size`` and up) are masked to -inf.
    """
    return _sum_loss(logits.flatten(0, 1), targets.flatten(), vocab_size) / targets.shape[-1]


@dataclass(frozen=True, slots=True)
class LmLoss:
    """``lm_loss`` over a vocabulary, as a value: the built-in ``loss_fn``, and what the
    built-in head's ``loss`` equals, so the runtime can tell a user's own ``loss_fn``
    (which the head's chunked loss must not replace) from it."""

    vocab_size: int

    def __call__(self, logits: Tensor, targets: Tensor) -> Tensor:
        return lm_loss(logits, targets, self.vocab_size)


def head_loss(
    hidden: Tensor, weight: Tensor, targets: Tensor, vocab_size: int, project: Project
) -> Tensor:
    """``lm_loss(project(hidden), targets, vocab_size)`` without whole logits.

    ``hidden`` (batch, seq, h) enters ``project``, the head's bias-free matmul
    whose weight is ``weight`` (padded vocabulary rows, h); ``targets`` (batch, seq).
    """
    from torch.distributed.tensor import DTensor

    seq = targets.shape[-1]
    flat_h, flat_t = hidden.flatten(0, 1), targets.flatten()
    rows = weight.to_local().shape[0] if isinstance(weight, DTensor) else weight.shape[0]
    step = loss_chunk_tokens(flat_t.numel(), rows)
    if not _fused_ok(flat_h, weight):
        total: Tensor | None = None
        # split, not sliced: split's backward joins the chunks' gradients once, where
        # each slice's would be a whole zero-padded gradient, added up chunk by chunk
        for h, t in zip(torch.split(flat_h, step), torch.split(flat_t, step), strict=True):
            if torch.is_grad_enabled():
                part = checkpoint(_chunk_loss, project, h, t, vocab_size, use_reentrant=False)
            else:
                part = _chunk_loss(project, h, t, vocab_size)
            total = part if total is None else total + part
        assert total is not None
        return total / seq
    # Under no_grad (evaluation) the Function still sees needs_input_grad: say it.
    grads = torch.is_grad_enabled()
    out: Tensor = _FusedHeadLoss.apply(flat_h, weight, flat_t, vocab_size, step, grads)  # type: ignore[no-untyped-call]
    return out / seq


def _fused_ok(hidden: Tensor, weight: Tensor) -> bool:
    """Gradients may be formed in the forward: plain tensors, no fp16 (see module doc)."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor) or isinstance(hidden, DTensor):
        return False
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16:
        return False
    return torch.float16 not in (hidden.dtype, weight.dtype)


def _chunk_loss(project: Project, h: Tensor, t: Tensor, vocab_size: int) -> Tensor:
    return _sum_loss(project(h), t, vocab_size)


def _sum_loss(flat: Tensor, targets: Tensor, vocab_size: int | None) -> Tensor:
    flat = flat.float()
    if vocab_size is not None and flat.shape[-1] > vocab_size:
        flat = flat + _padding_mask(flat, vocab_size)
    return F.cross_entropy(flat, targets, reduction="sum", ignore_index=IGNORE_INDEX)


def _padding_mask(logits: Tensor, vocab_size: int) -> Tensor:
    """0 for real classes, -inf for padding; a replicated DTensor when logits are sharded."""
    mask = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
    mask[vocab_size:] = float("-inf")
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(logits, DTensor):
        # Every TP rank builds the same mask: no communication, sliced to the shard.
        return DTensor.from_local(mask, logits.device_mesh, [Replicate()], run_check=False)
    return mask


def _add_weight_grad(grad_w: Tensor | None, g: Tensor, h: Tensor) -> Tensor:
    """``grad_w + g.T @ h`` in fp32, the matmul in ``g``'s dtype (autograd's)."""
    if grad_w is None:
        return (g.t() @ h).float()
    if g.dtype == torch.float32:
        return grad_w.addmm_(g.t(), h)
    return grad_w.add_(g.t() @ h)


def _summed_ce(
    logits: Tensor, t: Tensor, vocab_size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A chunk's summed cross-entropy (fp32), with what its gradient is made from: the
    real classes' fp32 logits (the logits themselves when they are fp32), their
    logsumexp, which targets count and the targets with ignored ones at class 0."""
    real = logits[:, :vocab_size].float()
    lse = torch.logsumexp(real, dim=-1)
    keep = t != IGNORE_INDEX
    safe = torch.where(keep, t, 0)
    picked = real.gather(1, safe[:, None]).squeeze(1)
    return torch.where(keep, lse - picked, 0.0).sum(), real, lse, keep, safe


def _ce_in_place(
    logits: Tensor, t: Tensor, vocab_size: int, want_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """A chunk's summed cross-entropy (fp32) and the gradient of that sum with respect
    to its logits (softmax - one-hot, in the logits' dtype; zero on padding rows and
    ignored tokens). Eager: in place over one fp32 copy, the fewest passes eager ops
    allow."""
    loss, real, lse, keep, safe = _summed_ce(logits, t, vocab_size)
    if not want_grad:
        return loss, None
    # an ignored token's row is exp(-inf) = 0 (no extra pass over the chunk)
    grad = real.sub_(torch.where(keep, lse, torch.inf)[:, None]).exp_()
    grad[torch.arange(t.numel(), device=t.device), safe] -= keep.to(grad.dtype)
    if vocab_size == logits.shape[1]:  # no padding rows (fp32: no copy at all)
        return loss, grad.to(logits.dtype)
    g = torch.empty_like(logits)
    g[:, :vocab_size] = grad
    g[:, vocab_size:] = 0
    return loss, g


def _ce_fused(
    logits: Tensor, t: Tensor, vocab_size: int, want_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """``_ce_in_place``'s values, written for ``torch.compile``: without in-place ops
    inductor fuses the chunk into a row reduction and one pointwise pass, reading the
    16-bit logits twice and writing the gradient once, where eager makes five passes
    over an fp32 copy (on a 128k vocabulary the head's memory traffic, not its matmuls,
    set its time)."""
    loss, real, lse, keep, safe = _summed_ce(logits, t, vocab_size)
    if not want_grad:
        return loss, None
    cols = torch.arange(vocab_size, device=logits.device)
    hot = (cols[None, :] == safe[:, None]) & keep[:, None]
    grad = torch.exp(real - torch.where(keep, lse, torch.inf)[:, None]) - hot.float()
    if vocab_size < logits.shape[1]:
        grad = F.pad(grad, (0, logits.shape[1] - vocab_size))
    return loss, grad.to(logits.dtype)


_CE_COMPILED: Any = None  # _ce_fused under torch.compile, once the runtime compiles


def compile_loss() -> None:
    """Run the fused head loss's per-chunk cross-entropy compiled on CUDA devices (the
    runtime calls this where it compiles its blocks; ``--compile off`` leaves it eager)."""
    global _CE_COMPILED
    if _CE_COMPILED is None:
        _CE_COMPILED = torch.compile(_ce_fused, dynamic=False)


class _FusedHeadLoss(torch.autograd.Function):
    """Summed token cross-entropy of ``hidden @ weight.T``, gradients formed chunk by chunk.

    The matmuls run in autocast's dtype when autocast is on, as the unfused head
    would (the weight cast once per call rather than through autocast's cache,
    which holds its copy for the whole step); the loss is taken in fp32 from the
    16-bit logits, as ``lm_loss`` does; the logits' gradient is rounded to the
    logits' dtype before the two gradient matmuls, as autograd's cast would. The
    weight's gradient is summed over chunks in fp32.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        vocab_size: int,
        step: int,
        grads: bool,
    ) -> Tensor:
        want_h, want_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        device = hidden.device.type
        dtype = (
            torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        )
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w: Tensor | None = None  # fp32, summed over groups (made by the first)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        tokens = targets.numel()
        group = loss_group_tokens(tokens, weight.shape[0], torch.finfo(dtype).bits // 8)
        group = max(step, group - group % step)  # whole chunks, at least one
        ce = _CE_COMPILED if _CE_COMPILED is not None else _ce_in_place
        with torch.autocast(device, enabled=False):
            w = weight.to(dtype)
            gbuf: Tensor | None = None  # a group's logits' gradient, for one weight matmul
            for g0 in range(0, tokens, group):
                g1 = min(tokens, g0 + group)
                hg = hidden[g0:g1].to(dtype)
                for start in range(g0, g1, step):
                    h = hg[start - g0 : start - g0 + step]
                    t = targets[start : start + step]
                    loss, g = ce(h @ w.t(), t, vocab_size, want_h or want_w)
                    total += loss
                    if g is None:
                        continue
                    if grad_h is not None:  # straight into its rows where the dtypes allow
                        rows = grad_h[start : start + step]
                        if rows.dtype == g.dtype:
                            torch.mm(g, w, out=rows)
                        else:
                            rows.copy_(g @ w)
                    if want_w and g1 - g0 > step:
                        if gbuf is None:
                            gbuf = torch.empty((group, g.shape[1]), dtype=g.dtype, device=g.device)
                        gbuf[start - g0 : start - g0 + len(g)].copy_(g)
                    elif want_w:
                        grad_w = _add_weight_grad(grad_w, g, h)
                if want_w and g1 - g0 > step:
                    assert gbuf is not None
                    grad_w = _add_weight_grad(grad_w, gbuf[: g1 - g0], hg)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        # Scaled in place: the buffers are this Function's own, and the runtime runs
        # each micro-batch's backward once (no retain_graph), so no copy is needed.
        if getattr(ctx, "spent", False):
            raise RuntimeError("the chunked loss's backward runs once (no retain_graph)")
        ctx.spent = True
        grad_h, grad_w = ctx.saved_tensors
        gh = None if grad_h is None else grad_h.mul_(grad_out.to(grad_h.dtype))
        gw = None if grad_w is None else grad_w.mul_(grad_out).to(ctx.weight_dtype)
        return gh, gw, None, None, None, None
