"""Layer timing: forward and backward of one shard at one micro-batch size.

What autohet plans with: per layer, the milliseconds of a forward and a backward
(compute only here; ``kinds`` adds the TP all-reduces), plain and under
activation recomputation, since a recompute stage runs each layer under a
checkpoint whose own work changes both. The bytes kept for backward and the
bytes sent on are measured in the same first run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .memory import saved_bytes
from .timing import repeats, sync


def time_layer(
    kind: str,
    module: nn.Module,
    s: dict[str, Any],
    mbs: int,
    seq: int,
    dev: torch.device,
    dtype: torch.dtype,
    warmup: int,
    repeat: int,
    share_s: float,
) -> dict[str, Any]:
    """Forward/backward ms of one micro-batch through ``module`` (compute only),
    plain and under activation recomputation as the runtime runs a recompute stage
    (a non-reentrant ``torch.utils.checkpoint`` per layer): checkpoint's per-call
    work runs on the CPU, so on a fast GPU its forward is not the plain one and its
    backward not the plain backward plus a forward. The plain timing gets 60% of
    the share, the recomputation the rest."""
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = getattr(module, "rows", 1)
    targets = torch.randint(0, rows, (mbs, seq), device=dev, generator=gen)
    if kind == "embedding":
        x = torch.randint(0, rows, (mbs, seq), device=dev, generator=gen)
    else:
        h = int(s["hidden_size"])
        x = torch.randn(mbs, seq, h, device=dev, dtype=dtype, generator=gen).requires_grad_()

    def forward() -> torch.Tensor:
        return torch.as_tensor(module(x, targets) if kind == "head" else module(x))

    def rc_forward() -> torch.Tensor:
        if kind == "head":  # the runtime's head keeps no logits: it is never recomputed
            return forward()
        return torch.as_tensor(checkpoint(module, x, use_reentrant=False))

    grad: list[torch.Tensor] = []

    def backward(out: torch.Tensor) -> None:
        if kind == "head":
            out.backward()  # type: ignore[no-untyped-call]
        else:
            if not grad:
                grad.append(torch.randn_like(out) * 1e-2)
            out.backward(grad[0])  # type: ignore[no-untyped-call]
        if x.requires_grad:
            x.grad = None

    def iteration(fwd_fn: Callable[[], torch.Tensor] = forward) -> tuple[float, float]:
        sync(dev)
        t0 = time.perf_counter()
        out = fwd_fn()
        sync(dev)
        t1 = time.perf_counter()
        backward(out)
        sync(dev)
        return t1 - t0, time.perf_counter() - t1

    def medians(
        fwd_fn: Callable[[], torch.Tensor], until_s: float, once: float | None = None
    ) -> tuple[float, float, int]:
        """Median forward and backward ms until ``until_s``; ``once``: the seconds of
        a first iteration already run (else one is run here: slower than steady state)."""
        if once is None:
            once = sum(iteration(fwd_fn))
        for _ in range(warmup):  # as many as the share allows beside one timed iteration
            if once * 2 > until_s - time.perf_counter():
                break
            once = sum(iteration(fwd_fn))
        times = [
            iteration(fwd_fn) for _ in range(repeats(once, until_s - time.perf_counter(), repeat))
        ]
        return (
            statistics.median(t[0] for t in times) * 1e3,
            statistics.median(t[1] for t in times) * 1e3,
            len(times),
        )

    start = time.perf_counter()
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    out, act_bytes = saved_bytes(module, forward)
    alloc_delta = torch.cuda.memory_allocated(dev) - before if dev.type == "cuda" else None
    output_bytes = 0 if kind == "head" else out.numel() * out.element_size()
    backward(out)
    del out
    sync(dev)
    once = time.perf_counter() - start  # the hooked first run: the plain timing's warm-up
    fwd, bwd, reps = medians(forward, start + 0.6 * share_s, once)
    rc_fwd, rc_bwd, _ = medians(rc_forward, start + share_s)
    module.zero_grad(set_to_none=True)
    return {
        "compute_fwd_ms": fwd,
        "compute_bwd_ms": bwd,
        "compute_recompute_fwd_ms": rc_fwd,
        "compute_recompute_bwd_ms": rc_bwd,
        "repeat": reps,
        "num_params": sum(p.numel() for p in module.parameters()),
        "act_bytes": act_bytes,
        "output_bytes": output_bytes,
        "cuda_alloc_delta_bytes": alloc_delta,
    }


def first_backward(dev: torch.device) -> None:
    """The first backward of a process imports sympy (seconds on a small host): do it
    before any layer is timed, so that no estimate of a layer's time includes it."""
    x = torch.ones(2, device=dev, requires_grad=True)
    (x * 2).sum().backward()  # type: ignore[no-untyped-call]
