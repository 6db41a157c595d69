"""Choosing between the recovery candidates (kept, contingency, solved) and saying
why in one sentence (pure; *Choice* in ``recovery.replan``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autohet_cli.plan import Plan
from autohet_cli.recovery.stability import Stability, stability

CONTINGENCY = "contingency"
SOLVED = "solved"
KEPT = "kept"


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    kind: str  # contingency | solved | kept
    plan: Plan
    iteration_time_s: float
    stability: Stability


def choose(candidates: Sequence[Candidate], tolerance: float) -> Candidate:
    """The most stable candidate within ``tolerance`` of the fastest (ties: faster)."""
    fastest = min(candidates, key=lambda c: c.iteration_time_s)
    limit = fastest.iteration_time_s * (1.0 + tolerance)
    near = [c for c in candidates if c.iteration_time_s <= limit]
    return max(near, key=lambda c: (round(c.stability.fraction, 9), -c.iteration_time_s))


def tradeoff(chosen: Candidate, candidates: Sequence[Candidate], tolerance: float) -> str:
    """One sentence: what the chosen plan keeps in place and what it costs or saves."""
    what = "layer state" if chosen.stability.total_state_bytes > 0 else "layer placements"
    kept = f"kept {chosen.stability.fraction:.0%} of {what} in place"
    others = [c for c in candidates if c is not chosen]
    if not others:
        return f"{chosen.kind} plan: {kept} ({chosen.iteration_time_s:.3f} s/iteration)"
    fastest = min(candidates, key=lambda c: c.iteration_time_s)
    if fastest is not chosen:
        delta = chosen.iteration_time_s / fastest.iteration_time_s - 1.0
        return (
            f"{chosen.kind} plan: {kept} at {delta:+.1%} iteration time "
            f"({chosen.iteration_time_s:.3f} s vs {fastest.iteration_time_s:.3f} s for the "
            f"{fastest.kind} plan, which kept {fastest.stability.fraction:.0%}; "
            f"tolerance {tolerance:.0%})"
        )
    stable = max(others, key=lambda c: c.stability.fraction)
    delta = stable.iteration_time_s / chosen.iteration_time_s - 1.0
    if stable.stability.fraction > chosen.stability.fraction:
        why = (
            f"the {stable.kind} plan would keep {stable.stability.fraction:.0%} in place but "
            f"is {delta:+.1%} slower ({stable.iteration_time_s:.3f} s; tolerance {tolerance:.0%})"
        )
    elif delta < 0.0005:  # "+0.0% slower" reads as a reason; there is none
        why = f"the {stable.kind} plan is as fast and keeps no more in place"
    else:
        why = f"the {stable.kind} plan is {delta:+.1%} slower and keeps no more in place"
    return f"{chosen.kind} plan: {kept} at {chosen.iteration_time_s:.3f} s/iteration; {why}"


def candidate(
    kind: str, old: Plan, plan: Plan, time_s: float, layer_bytes: Sequence[float] | None
) -> Candidate:
    return Candidate(
        kind=kind,
        plan=plan,
        iteration_time_s=time_s,
        stability=stability(old, plan, layer_bytes),
    )
