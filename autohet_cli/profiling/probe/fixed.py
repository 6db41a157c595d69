"""Fixed costs: a training iteration over 1, 2 and 4 norm layers.

An iteration costs more than its layers: the loss, the gradient clip, the
optimizer's kernel launches, the loss read back to the host. ``fixedfit`` fits
that cost as the intercept of these timings against the number of layers, so
the layers are the model's cheapest (norms of its width) and the sequence short.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .shards import make_norm
from .timing import Budget, median_ms, repeats
from .update import adam

_ITERATION_LAYERS = (1, 2, 4)  # norm layers per training iteration


def _iteration(
    s: dict[str, Any], k: int, dev: torch.device, dtype: torch.dtype, seq: int
) -> Callable[[], object]:
    """A training iteration over ``k`` norm layers of the model's width, as the runtime
    runs one: gradients reset, forward and a loss, backward, the clip's global norm
    and scaling, an Adam step, the loss read back to the host."""
    layers = nn.Sequential(*[make_norm(str(s["norm"]), int(s["hidden_size"])) for _ in range(k)])
    layers = layers.to(device=dev, dtype=dtype)
    params = list(layers.parameters())
    adam_step = adam(params, dtype)
    x = torch.randn(1, seq, int(s["hidden_size"]), device=dev, dtype=dtype)

    def run() -> float:
        for p in params:
            p.grad = None
        loss = layers(x).float().pow(2).mean()
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()
        coef = (1.0 / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        adam_step()
        return float(loss.item())

    return run


def measure_fixed(
    spec: dict[str, Any], dev: torch.device, dtype: torch.dtype, budget: Budget
) -> dict[str, Any]:
    """A training iteration's medians over 1, 2 and 4 norm layers, for ``fixedfit`` to
    fit its cost beyond its layers. The sizes are timed in turns, round after round,
    so that a busy spell of the host slows each of them alike instead of tilting the
    line. (One op's host time needs no run of its own: ``fixedfit`` reads it from the
    block's times at several micro-batch sizes.)"""
    block = spec["layers"].get("block") or spec["layers"].get("norm")
    if block is None:  # an embedding and a head alone: no norm of the model's width
        return {"iteration_ms": {}}
    seq = min(int(spec["seq_len"]), 128)  # the iteration's fixed part, not its work
    runs = {
        "iteration_ms": {str(k): _iteration(block, k, dev, dtype, seq) for k in _ITERATION_LAYERS}
    }
    times: dict[str, dict[str, list[float]]] = {g: {w: [] for w in r} for g, r in runs.items()}

    def one_round() -> None:
        for group, by_work in runs.items():
            for work, run in by_work.items():
                times[group][work].append(median_ms(run, dev, 0, 1))

    start = time.perf_counter()
    one_round()  # warm-up: first calls allocate and initialise lazily
    once = time.perf_counter() - start
    for group in times.values():
        for found in group.values():
            found.clear()
    for _ in range(max(3, repeats(once, budget.fraction_s(0.03), 15))):
        one_round()
    return {g: {w: statistics.median(t) for w, t in by.items()} for g, by in times.items()}
