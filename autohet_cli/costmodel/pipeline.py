"""Time of one synchronous 1F1B pipeline: the planner's closed form and its reference simulator.

Schedule (PipeDream-flush / Megatron non-interleaved): with S stages and m micro-batches,
stage s runs min(S-s-1, m) warm-up forwards, then alternates one forward and one backward
while forwards remain, then the remaining backwards. F(s, i) waits for F(s-1, i) plus the
send on link s-1; B(s, i) waits for B(s+1, i) plus the send on link s; B(S-1, i) follows
F(S-1, i). Sends are pure delays (links never contend). Times are in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autohet_cli.costmodel.budget import check_deadline

Op = tuple[int, str, int, float, float]
"""One executed op: (stage, kind 'F' or 'B', micro-batch, start_ms, end_ms)."""
_POLL_OPS = 8192  # stage-ops between deadline checks: a few ms of work, ~0.1% overhead


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """Outcome of :func:`simulate_1f1b`.

    ``busy_ms[s]`` is m * (f_s + b_s); ``idle_fraction[s]`` is stage s's bubble share of the
    makespan; ``timeline`` (only when asked for) lists every op, per stage in execution order.
    """

    makespan_ms: float
    busy_ms: tuple[float, ...]
    idle_fraction: tuple[float, ...]
    timeline: tuple[Op, ...] = ()


def _times(name: str, values: Sequence[float]) -> list[float]:
    out = [float(x) for x in values]
    if any(not x >= 0.0 for x in out):  # also rejects NaN
        raise ValueError(f"{name} must be >= 0, got {list(values)}")
    return out


def _sends(num_stages: int, num_microbatches: int, send_ms: Sequence[float]) -> list[float]:
    if num_stages < 1:
        raise ValueError("a pipeline needs at least one stage")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if len(send_ms) not in (0, num_stages - 1):
        raise ValueError(
            f"send_ms needs {num_stages - 1} entries (one per link) or none, got {len(send_ms)}"
        )
    return _times("send_ms", send_ms) or [0.0] * (num_stages - 1)


def closed_form_1f1b(
    stage_ms: Sequence[float],
    num_microbatches: int,
    send_ms: Sequence[float] = (),
    *,
    fwd_ms: Sequence[float] | None = None,
) -> float:
    """Upper bound on the 1F1B makespan, ``(m-1) * (F + B) + sum(c) + 2 * sum(send)``.

    Notation: c_s = stage_ms[s] = f_s + b_s; h_s = (send_{s-1} + send_s) / 2 is half of each
    link next to stage s (missing links count 0). With ``fwd_ms`` (so b_s = c_s - f_s):
    F = max_s(f_s + h_s) and B = max_s(b_s + h_s). Without it, every stage is assumed to
    spend the same share of c_s on the forward (the analytic profile's b = 2f); the worst
    share gives F + B = max_s(c_s + h_s) + max_s h_s. For a MILP: T >= (m-1)(F + B) + sums,
    F >= f_s + h_s and B >= b_s + h_s for every stage s. Exact (equal to
    :func:`simulate_1f1b`) when stages are equal and sends are zero.

    Why an upper bound, for any m, S and times. The makespan is the longest path of the
    precedence graph. Number stage s's ops by step k: F(s, k), then B(s, k - (S-1-s)). A
    down edge F(s,k) -> F(s+1,k) keeps k, an up edge B(s+1,.) -> B(s,.) adds one, and the
    path runs from F(0,0) at step 0 to B(0,m-1). Forwards exist only at steps < m, and at
    each such step the path holds one run of forwards unless it entered the step by an up
    edge, so #forwards = (m - U_early) + D, where D = U_early + U_late counts down (= up)
    edges and U_late <= tau, the deepest stage reached. The runs cover stages 0..tau, so
    forwards beyond one per visited stage number at most m - 1 + U_late - tau <= m - 1.
    Charge half of a down edge's send to the forward it leaves and half to the one it
    enters (each is left or entered once): forwards + down sends
    <= sum_s(f_s + h_s) + (m-1) * F. Reversing time maps the schedule onto itself with F
    and B swapped, so backwards + up sends <= sum_s(b_s + h_s) + (m-1) * B; add the two.

    Why not ``(m-1) * max_s(c_s) + sum(c) + 2 * sum(send)``: a forward-heavy stage's
    warm-up followed by a backward-heavy stage's drain makes it too low (S = m = 6,
    f = (0,1,0,0,0,0), b = (1,0,0,0,0,0): simulator 11, that form 7), and a long link is
    crossed back and forth every second micro-batch (S = 2, c = (10, 10), send 5: simulator
    15m + 10, that form 10m + 30, this one 15m + 15). Both forms agree when all stages
    share one forward share and sends are zero. How high it gets (measured, m >= S, no
    sends): (4S-1)/(3S) < 4/3 for b = 2f, reached by c = (1, 1/3, ..., 1/3) and m = S (the
    same shape gives 1 + min(a, 1-a)(S-1)/S for a forward share a); below 2x for any split.
    Sends that dwarf compute can push it to ~(m+1)/2 for m ~ S (no zig-zag happens yet).
    """
    num_stages, m = len(stage_ms), num_microbatches
    sends = _sends(num_stages, m, send_ms)
    stage = _times("stage_ms", stage_ms)
    half = [(a + b) / 2 for a, b in zip([0.0, *sends], [*sends, 0.0], strict=True)]
    if fwd_ms is None:
        per_mb = max(c + h for c, h in zip(stage, half, strict=True)) + max(half)
    else:
        if len(fwd_ms) != num_stages:
            raise ValueError(f"fwd_ms has {len(fwd_ms)} stages but stage_ms has {num_stages}")
        fwd = _times("fwd_ms", fwd_ms)
        bwd = [c - f for c, f in zip(stage, fwd, strict=True)]
        if any(b < 0.0 for b in bwd):
            raise ValueError(f"fwd_ms {list(fwd_ms)} exceeds stage_ms {list(stage_ms)}")
        per_mb = max(f + h for f, h in zip(fwd, half, strict=True))
        per_mb += max(b + h for b, h in zip(bwd, half, strict=True))
    return (m - 1) * per_mb + sum(stage) + 2.0 * sum(sends)


def simulate_1f1b(
    fwd_ms: Sequence[float],
    bwd_ms: Sequence[float],
    num_microbatches: int,
    send_ms: Sequence[float] = (),
    *,
    record_timeline: bool = False,
) -> SimResult:
    """Run the 1F1B schedule (module docstring) with earliest start times; the reference.

    Step k of stage s is F(s, k) (if k < m), then B(s, k - (S-1-s)) (if that is in 0..m-1).
    Steps are processed in order: within a step, forwards top-down (F(s, k) needs F(s-1, k)
    of the same step), then backwards (B(s, j) needs B(s+1, j) from the previous step). That
    is a topological order in which each stage meets its own ops in execution order, so one
    "end of latest op" per stage is all the state needed: O(m * S), no event queue. Long
    runs poll the planner's deadline (budget.py) and raise TimeLimitReached past it.
    """
    num_stages, m = len(fwd_ms), num_microbatches
    if len(bwd_ms) != num_stages:
        raise ValueError(f"fwd_ms has {num_stages} stages but bwd_ms has {len(bwd_ms)}")
    sends = _sends(num_stages, m, send_ms)
    fwd, bwd = _times("fwd_ms", fwd_ms), _times("bwd_ms", bwd_ms)
    last = [0.0] * num_stages  # end of the latest op on each stage
    f_delay = [0.0, *sends]  # F(s-1, i) -> F(s, i)
    b_delay = [*sends, 0.0]  # B(s+1, j) -> B(s, j); B(S-1, j) just follows F(S-1, j)
    b_end = [0.0] * (num_stages + 1)  # end of the latest B per stage; b_end[S] stays 0
    ops: list[Op] | None = [] if record_timeline else None
    poll = max(1, _POLL_OPS // num_stages)
    for step in range(m + num_stages - 1):
        if not step % poll:
            check_deadline()
        if step < m:
            ready = 0.0
            for s in range(num_stages):
                ready += f_delay[s]
                start = last[s] if last[s] > ready else ready
                ready = last[s] = start + fwd[s]
                if ops is not None:
                    ops.append((s, "F", step, start, ready))
        first = num_stages - 1 - step  # the stage whose first backward falls on this step
        for s in range(max(0, first), min(num_stages, first + m)):
            ready = b_end[s + 1] + b_delay[s]
            start = last[s] if last[s] > ready else ready
            b_end[s] = last[s] = start + bwd[s]
            if ops is not None:
                ops.append((s, "B", s - first, start, last[s]))
    makespan = max(last)
    busy = tuple(m * (f + b) for f, b in zip(fwd, bwd, strict=True))
    idle = tuple(1.0 - x / makespan if makespan > 0.0 else 0.0 for x in busy)
    timeline = tuple(sorted(ops, key=lambda op: op[0])) if ops is not None else ()
    return SimResult(makespan_ms=makespan, busy_ms=busy, idle_fraction=idle, timeline=timeline)
