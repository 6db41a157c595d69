"""Where planning time goes: wall seconds per named phase (bookkeeping only).

Users replan on every preemption, so the planner's time is recovery time; the
phases say which part to make faster (``benchmarks/planner_speed``, ``autohet plan
--explain``). Phases nest: ``search`` is a whole search, of which ``enumerate``
(groupings, their bounds and estimates), ``solve`` (SCIP on the groupings chosen)
and ``refine`` (local moves on the best candidates) are parts; ``evaluate`` is the
cost model inside all of them. Totals are per process: a search run in a worker
process (``planner.parallel``) sends its phases back with its result, and they are
added here, so the totals count CPU-side work, not the wall time of the command.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

_totals_s: dict[str, float] = {}
_counts: dict[str, int] = {}


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Adds the wall time of the block to ``name``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _totals_s[name] = _totals_s.get(name, 0.0) + time.perf_counter() - start
        _counts[name] = _counts.get(name, 0) + 1


def snapshot() -> dict[str, tuple[float, int]]:
    """{phase: (seconds, times entered)} so far in this process."""
    return {k: (v, _counts.get(k, 0)) for k, v in _totals_s.items()}


def since(before: Mapping[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
    """What the phases added after ``before`` (a ``snapshot``)."""
    out = {}
    for k, (s, n) in snapshot().items():
        s0, n0 = before.get(k, (0.0, 0))
        if n > n0:
            out[k] = (s - s0, n - n0)
    return out


def add(other: Mapping[str, tuple[float, int]]) -> None:
    """Count another process's phases (a worker's ``since``) here."""
    for k, (s, n) in other.items():
        _totals_s[k] = _totals_s.get(k, 0.0) + s
        _counts[k] = _counts.get(k, 0) + n
