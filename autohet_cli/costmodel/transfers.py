"""Time to move bytes between GPUs: one transfer, a ring all-reduce, and how many
copies a stage sends its neighbour of another TP degree (pure).

The formulas the cost model, the planner's quick estimates (``planner.estimate``)
and the launch's comparison with a run (``launch.compare``) share.
"""

from __future__ import annotations


def transfer_ms(nbytes: float, gbps: float) -> float:
    """Milliseconds to move ``nbytes`` over a link of ``gbps`` gigabits per second."""
    return nbytes / (gbps * 1e9 / 8) * 1e3


def ring_allreduce_ms(nbytes: float, participants: int, gbps: float) -> float:
    if participants <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (participants - 1) / participants * nbytes / (gbps * 1e9 / 8) * 1e3


def send_copies(a: int, b: int) -> int:
    """Copies one rank sends, one after the other, between neighbours of TP degrees
    ``a`` and ``b``: ceil(b/a) activations forward, ceil(a/b) gradients back."""
    return max(-(-b // a), -(-a // b))
