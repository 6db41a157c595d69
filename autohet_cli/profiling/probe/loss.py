"""A copy of the runtime's head loss: logits and fp32 loss in chunks of tokens.

The runtime's head (runtime/models/loss.py, ``_FusedHeadLoss``) never holds a
micro-batch's logits: it forms them chunk by chunk and takes the gradients in
the forward. The probe must time and measure that head, not a plain one, and
it runs alone on hosts that need not have autohet installed, so it carries this
copy; the two are checked equal, chunk and group sizes included, in
tests/unit/test_chunked_loss.py.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_LOGIT_BYTES = 256 * 2**20
GROUP_LOGIT_BYTES = 2**30


class ChunkedLoss(torch.autograd.Function):
    """Summed fp32 cross-entropy of ``hidden @ weight.t()`` over ``targets``, ``step``
    tokens at a time; the gradients are formed in the forward, the weight's once per
    group of chunks (``GROUP_LOGIT_BYTES``), and scaled in the backward."""

    @staticmethod
    def forward(ctx: Any, hidden: Any, weight: Any, targets: Any, step: int) -> Any:
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        n = targets.numel()
        # the weight's gradient once per group of chunks, as the runtime forms it
        fit = GROUP_LOGIT_BYTES // (hidden.element_size() * weight.shape[0])
        group = max(step, min(n, fit - fit % step))
        for g0 in range(0, n, group):
            gs = []
            for start in range(g0, min(n, g0 + group), step):
                h, t = hidden[start : start + step], targets[start : start + step]
                logits = h @ weight.t()
                real = logits.float()
                lse = torch.logsumexp(real, dim=-1)
                total += (lse - real.gather(1, t[:, None]).squeeze(1)).sum()
                grad = real.sub_(lse[:, None]).exp_()
                grad[torch.arange(t.numel(), device=t.device), t] -= 1.0
                g = grad.to(logits.dtype)
                del logits, real, grad
                grad_h[start : start + step] = g @ weight
                gs.append(g)
            g = gs[0] if len(gs) == 1 else torch.cat(gs)
            grad_w += g.t() @ hidden[g0 : g0 + len(g)]
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: Any) -> Any:
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), (grad_w * grad_out).to(grad_h.dtype), None, None
