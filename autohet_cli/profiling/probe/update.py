"""The optimizer step: Adam on a shard's fp32 master weights, timed.

A training step ends with the optimizer's update of every stage's parameters, a
memory-bound cost that grows with the shard and not with the micro-batch, so it
is timed once per (TP degree, layer kind). Where it cannot run (out of memory),
autohet estimates it from the copy bandwidth and says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .timing import median_ms, repeats, sync


def adam(params: list[nn.Parameter], dtype: torch.dtype) -> Callable[[], None]:
    """An Adam step over fp32 master copies of ``params`` (plus the copy back to 16 bits),
    written with the ``torch._foreach_*`` kernels ``torch.optim.Adam(foreach=True)`` runs,
    because importing torch.optim loads torch._dynamo (seconds on a small host). Its
    gradients are constants: the step's time does not depend on their values."""
    with torch.no_grad():
        master = [p.detach().float().clone() for p in params]
        grads = [torch.full_like(m, 1e-3) for m in master]
        exp_avg = [torch.zeros_like(m) for m in master]
        exp_sq = [torch.zeros_like(m) for m in master]
    lr, beta1, beta2, eps = 1e-4, 0.9, 0.999, 1e-8

    @torch.no_grad()
    def step() -> None:
        torch._foreach_mul_(exp_avg, beta1)
        torch._foreach_add_(exp_avg, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_sq, beta2)
        torch._foreach_addcmul_(exp_sq, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(exp_sq)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(master, exp_avg, denom, value=-lr)
        if dtype != torch.float32:
            for p, m in zip(params, master):  # noqa: B905 - Python 3.8 has no strict=
                p.copy_(m)

    return step


def measure_update(
    module: nn.Module, dev: torch.device, dtype: torch.dtype, share_s: float, repeat: int
) -> dict[str, Any]:
    """One Adam step over the shard's fp32 master weights (``adam``)."""
    step = adam(list(module.parameters()), dtype)
    once = 0.0
    for _ in range(3):  # the first steps allocate the state and initialise lazily
        start = time.perf_counter()
        step()
        sync(dev)
        once = time.perf_counter() - start
    reps = repeats(once, share_s - once, repeat)
    return {"ms": median_ms(step, dev, 0, reps), "repeat": reps}
