"""Timing primitives: the wall-clock budget and the median of repeated runs.

Every measurement of the probe is a median over repeats, synchronised with the
device so that a GPU's queued work is counted; the number of repeats comes from
one run's time and the share of the budget the measurement gets, never below
one, so that the probe ends within its time budget on any host.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


class Budget:
    """Wall-clock budget, shared out over the measurements still to do in proportion
    to their estimated cost (seconds per iteration), so each gets similar repeats."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.perf_counter() + seconds
        self.cost_left = 0.0
        self.exceeded = False

    def left_s(self) -> float:
        left = self.deadline - time.perf_counter()
        if left <= 0:
            self.exceeded = True
        return max(0.0, left)

    def fraction_s(self, fraction: float) -> float:
        return self.left_s() * fraction

    def share_s(self, cost: float) -> float:
        return self.left_s() * cost / max(self.cost_left, cost, 1e-9)

    def done(self, cost: float) -> None:
        self.cost_left = max(0.0, self.cost_left - cost)


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_ms(fn: Callable[[], object], dev: torch.device, warmup: int, repeat: int) -> float:
    """Median milliseconds of ``fn`` over ``repeat`` runs (at least one) after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeat)):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def repeats(once_s: float, share_s: float, wanted: int) -> int:
    """How many runs of ``once_s`` seconds fit in ``share_s``: at most ``wanted``, at least 1."""
    return max(1, min(wanted, int(share_s / max(once_s, 1e-6))))
