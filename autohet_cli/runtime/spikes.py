"""A gradient-norm spike, remarked on once in the step lines (pure).

A newcomer watching ``grad_norm 0.41 ... grad_norm 9.87 ... grad_norm 0.44`` cannot
tell a harmless one-off from a run about to diverge, and the demo's spike went by
without a word (issue 31). The norm is compared with the median of the recent steps
(robust to the spike itself); a norm several times that median gets one line saying
what it was, what clipping did to it, and what to watch next.
"""

from __future__ import annotations

from collections import deque
from statistics import median

WINDOW_STEPS = 20  # the recent steps the median is taken over
MIN_HISTORY = 5  # no verdict before this many steps: early norms move a lot
SPIKE_FACTOR = 4.0  # this many times the median is a spike


class SpikeWatch:
    """Feed every step's gradient norm (before clipping); get a remark on a spike."""

    def __init__(self, *, grad_clip: float | None = None) -> None:
        self.grad_clip = grad_clip if grad_clip and grad_clip > 0 else None
        self.recent: deque[float] = deque(maxlen=WINDOW_STEPS)

    def observe(self, step: int, grad_norm: float | None) -> str | None:
        if grad_norm is None or grad_norm != grad_norm or grad_norm in (float("inf"),):
            return None  # non-finite norms are the NonFiniteGuard's (batchcheck)
        remark = None
        if len(self.recent) >= MIN_HISTORY:
            typical = median(self.recent)
            if typical > 0 and grad_norm >= SPIKE_FACTOR * typical:
                clipped = (
                    f"clipped to {self.grad_clip:g} (--grad-clip), so the update stayed bounded"
                    if self.grad_clip is not None and grad_norm > self.grad_clip
                    else "not clipped (--grad-clip bounds such updates)"
                )
                remark = (
                    f"step {step}: gradient norm spike: {grad_norm:.3f} is "
                    f"{grad_norm / typical:.1f}x the median of the last {len(self.recent)} "
                    f"steps ({typical:.3f}); {clipped}. A one-off spike is common, early "
                    "in training above all; if the loss does not come back down within "
                    "a few steps, lower --lr or raise --warmup-steps."
                )
        self.recent.append(grad_norm)
        return remark
