"""The planner's deadline, which the cost model's long loops poll (pure but for the clock).

The 1F1B simulator is O(micro-batches x stages): at the largest global batch
accepted (limits.MAX_GLOBAL_BATCH) one simulation of a deep pipeline takes
seconds, and the search, the baselines and the contingency plans evaluate
hundreds of candidates. ``--time-limit`` promises an answer near that time, so
the planner opens a deadline around its work and the simulator checks it. A
context variable rather than a parameter: ``evaluate`` memoises pipeline times
on their arguments, and a deadline among them would defeat the memo.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from autohet_cli.errors import TimeLimitReached

_DEADLINE: ContextVar[float] = ContextVar("autohet_deadline", default=math.inf)


def overrun_s(time_limit_s: float) -> float:
    """How long past its time limit a planner call may run: the clean-up that
    turns the best candidate into a plan (refinement, baselines) needs a moment."""
    return max(2.0, 0.1 * time_limit_s)


@contextmanager
def deadline_in(seconds: float) -> Iterator[float]:
    """Run the block under a deadline ``seconds`` from now, never later than the
    deadline of an enclosing block; yields the deadline (``time.monotonic()``)."""
    deadline = min(_DEADLINE.get(), time.monotonic() + seconds)
    token = _DEADLINE.set(deadline)
    try:
        yield deadline
    finally:
        _DEADLINE.reset(token)


def check_deadline() -> None:
    """Raise TimeLimitReached once the innermost deadline has passed."""
    if time.monotonic() > _DEADLINE.get():
        raise TimeLimitReached("the time limit passed")
