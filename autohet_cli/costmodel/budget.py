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


# With less than this left, the whole-call bound is not kept: a first plan needs a
# moment, and a plan late is better than none (review: mix-64 with 1 s in all found
# none in 3 runs of 6). The search then gets LATE_SEARCH_S and its usual overrun.
MIN_WHOLE_CALL_S = 2.0
LATE_SEARCH_S = 1.0


def whole_call(left_s: float) -> tuple[float, float]:
    """(the search's limit, the call's deadline) for a call that must end within
    ``left_s`` (issue 32: ``--time-limit`` bounds the command): the search gets the
    limit less the clean-up that follows it (refinement, the ZeRO-1 and
    recomputation decisions, the baselines), which ``overrun_s`` otherwise adds."""
    if left_s < MIN_WHOLE_CALL_S:
        return LATE_SEARCH_S, LATE_SEARCH_S + overrun_s(LATE_SEARCH_S)
    return left_s - min(overrun_s(left_s), 0.25 * left_s), left_s


def seconds_left() -> float:
    """Until the innermost deadline (inf without one): what a solver call may take."""
    return _DEADLINE.get() - time.monotonic()


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
