"""Microbenchmarks of the device's rates: GEMM TFLOP/s, copy bandwidth, GPU-to-GPU copy.

autohet's analytic model needs them where a layer was not timed (and to estimate
the Adam step where it did not run), and the probe itself needs them first: they
set how long each layer is expected to take, which is how the time budget is
shared out over the layers (``kinds``). Each is a median with a small share of
the budget.
"""

from __future__ import annotations

from typing import Any

import torch

from .timing import Budget, median_ms, repeats


def measure_matmul(dev: torch.device, dtype: torch.dtype, budget: Budget) -> dict[str, Any]:
    """Square-GEMM TFLOP/s at the training dtype (n 4096 on a GPU, 1024 or 512 on a CPU)."""
    n = 4096 if dev.type == "cuda" else 1024
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    once = median_ms(lambda: a @ b, dev, 1, 1) / 1e3
    if dev.type == "cpu" and once > 0.5:  # a slow CPU: a smaller GEMM suffices
        n = 512
        a, b = a[:n, :n].contiguous(), b[:n, :n].contiguous()
        once /= 8
    repeat = max(3, repeats(once, budget.fraction_s(0.03), 20 if dev.type == "cuda" else 5))
    ms = median_ms(lambda: a @ b, dev, 1, repeat)
    return {"n": n, "repeat": repeat, "ms": ms, "tflops": 2 * n**3 / (ms / 1e3) / 1e12}


def measure_bandwidth(dev: torch.device, budget: Budget) -> dict[str, Any]:
    """Copy bandwidth GB/s within the device, counting the read and the write."""
    nbytes = (256 if dev.type == "cuda" else 64) << 20
    src = torch.ones(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    once = median_ms(lambda: dst.copy_(src), dev, 1, 1) / 1e3
    repeat = max(3, repeats(once, budget.fraction_s(0.02), 10))
    ms = median_ms(lambda: dst.copy_(src), dev, 1, repeat)
    # A copy reads and writes every byte.
    return {"nbytes": nbytes, "repeat": repeat, "ms": ms, "gbytes_s": 2 * nbytes / (ms / 1e3) / 1e9}


def measure_peer_copy() -> float | None:
    """GB/s of a cuda:0 -> cuda:1 copy, or None with fewer than two GPUs."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    nbytes = 64 << 20
    src = torch.ones(nbytes // 4, device="cuda:0")
    dst = torch.empty(nbytes // 4, device="cuda:1")

    def copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize(1)

    ms = median_ms(copy, torch.device("cuda", 0), 2, 10)
    return nbytes / (ms / 1e3) / 1e9
