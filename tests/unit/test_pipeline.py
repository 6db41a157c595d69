"""The 1F1B closed form against its discrete-event simulator."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autohet_cli.costmodel.pipeline import closed_form_1f1b, simulate_1f1b

PROPERTY = settings(deadline=None, max_examples=200, derandomize=True)
REL = 1e-9

times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)
shares = st.floats(min_value=0.0, max_value=1.0)


@st.composite
def pipelines(
    draw: st.DrawFn, *, sends: bool = True
) -> tuple[list[float], list[float], int, list[float]]:
    num_stages = draw(st.integers(1, 8))
    fwd = draw(st.lists(times, min_size=num_stages, max_size=num_stages))
    bwd = draw(st.lists(times, min_size=num_stages, max_size=num_stages))
    link = st.floats(min_value=0.0, max_value=5.0) if sends else st.just(0.0)
    send = draw(st.lists(link, min_size=num_stages - 1, max_size=num_stages - 1))
    return fwd, bwd, draw(st.integers(1, 20)), send


def closed(fwd: list[float], bwd: list[float], m: int, send: list[float]) -> float:
    stage = [f + b for f, b in zip(fwd, bwd, strict=True)]
    return closed_form_1f1b(stage, m, send, fwd_ms=fwd)


def spec_order(num_stages: int, s: int, m: int) -> list[tuple[str, int]]:
    """Stage s's ops, written straight from the schedule's definition."""
    warmup = min(num_stages - s - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


# --- hand-computed cases ------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 2, 7])
def test_one_stage_runs_back_to_back(m: int) -> None:
    result = simulate_1f1b([1.5], [2.5], m)
    assert result.makespan_ms == pytest.approx(4.0 * m)
    assert result.idle_fraction == (0.0,)
    assert closed_form_1f1b([4.0], m) == pytest.approx(4.0 * m)


def test_two_stages_two_microbatches_by_hand() -> None:
    # stage 0: F0 F1 B0 B1 (one warm-up forward); stage 1: F0 B0 F1 B1.
    result = simulate_1f1b([1.0, 1.0], [2.0, 2.0], 2, record_timeline=True)
    assert result.timeline == (
        (0, "F", 0, 0.0, 1.0),
        (0, "F", 1, 1.0, 2.0),
        (0, "B", 0, 4.0, 6.0),  # waits for B(1, 0)
        (0, "B", 1, 7.0, 9.0),  # waits for B(1, 1)
        (1, "F", 0, 1.0, 2.0),
        (1, "B", 0, 2.0, 4.0),
        (1, "F", 1, 4.0, 5.0),  # F(0, 1) was ready at 2, the stage was busy until 4
        (1, "B", 1, 5.0, 7.0),
    )
    assert result.makespan_ms == 9.0
    assert result.busy_ms == (6.0, 6.0)
    assert result.idle_fraction == pytest.approx((1 / 3, 1 / 3))
    assert closed_form_1f1b([3.0, 3.0], 2) == 9.0  # (2-1)*3 + 6


def test_two_stages_with_a_send_by_hand() -> None:
    # As above with 0.5 ms on the link: F(1,0) 1.5-2.5, B(1,0) 2.5-4.5, F(1,1) 4.5-5.5,
    # B(1,1) 5.5-7.5, B(0,0) 5.0-7.0, B(0,1) 8.0-10.0.
    result = simulate_1f1b([1.0, 1.0], [2.0, 2.0], 2, [0.5], record_timeline=True)
    assert [op[3:] for op in result.timeline if op[0] == 1] == [
        (1.5, 2.5),
        (2.5, 4.5),
        (4.5, 5.5),
        (5.5, 7.5),
    ]
    assert result.makespan_ms == 10.0
    # half a link per stage: (2-1) * ((1 + 0.25) + (2 + 0.25)) + 6 + 2 * 0.5
    assert closed_form_1f1b([3.0, 3.0], 2, [0.5]) == 10.5


def test_one_microbatch_is_a_round_trip() -> None:
    fwd, bwd, send = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [0.25, 0.75]
    assert simulate_1f1b(fwd, bwd, 1, send).makespan_ms == 23.0
    assert closed(fwd, bwd, 1, send) == 23.0


def test_plain_max_of_stage_sums_is_not_a_bound() -> None:
    # A forward-only stage's warm-up then a backward-only stage's drain: (m-1)*max(f+b)
    # + sum(f+b) = 7 is below the schedule; max(f) + max(b) per micro-batch covers it.
    fwd, bwd = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert simulate_1f1b(fwd, bwd, 6).makespan_ms == 11.0
    assert closed(fwd, bwd, 6, []) == 12.0


@pytest.mark.parametrize("num_stages", [2, 4, 7, 64])
def test_worst_overestimate_is_reached(num_stages: int) -> None:
    # One heavy first stage, the others a third of it, m = S, b = 2f: the closed form is
    # (4S-1)/(3S) of the simulator, which tends to 4/3.
    stage = [1.0] + [1 / 3] * (num_stages - 1)
    fwd, bwd = [c / 3 for c in stage], [2 * c / 3 for c in stage]
    sim = simulate_1f1b(fwd, bwd, num_stages).makespan_ms
    bound = closed_form_1f1b(stage, num_stages)
    assert bound / sim == pytest.approx((4 * num_stages - 1) / (3 * num_stages))


@pytest.mark.parametrize(
    ("fwd", "bwd", "m", "send"),
    [([1.0], [1.0, 2.0], 2, []), ([1.0], [1.0], 0, []), ([1.0, 1.0], [1.0, 1.0], 2, [1.0, 1.0])],
)
def test_simulator_rejects_bad_shapes(
    fwd: list[float], bwd: list[float], m: int, send: list[float]
) -> None:
    with pytest.raises(ValueError):
        simulate_1f1b(fwd, bwd, m, send)


def test_closed_form_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="send_ms"):
        closed_form_1f1b([1.0, 1.0], 2, [-1.0])
    with pytest.raises(ValueError, match="stage_ms"):
        closed_form_1f1b([math.nan], 2)
    with pytest.raises(ValueError, match="exceeds"):
        closed_form_1f1b([1.0], 2, fwd_ms=[2.0])


def test_fast_enough_to_rescore_plans() -> None:
    fwd, bwd = [1.0 + (s % 5) / 7 for s in range(64)], [2.0 + (s % 3) / 5 for s in range(64)]
    elapsed = []
    for _ in range(3):
        start = time.perf_counter()
        simulate_1f1b(fwd, bwd, 1024, [0.1] * 63)
        elapsed.append(time.perf_counter() - start)
    assert min(elapsed) < 0.1  # ~15 ms on a laptop core; slack for a loaded 2-core CI box


# --- properties -----------------------------------------------------------------------------


@PROPERTY
@given(f=times, b=times, num_stages=st.integers(1, 8), m=st.integers(1, 40))
def test_exact_for_equal_stages_without_sends(f: float, b: float, num_stages: int, m: int) -> None:
    sim = simulate_1f1b([f] * num_stages, [b] * num_stages, m).makespan_ms
    assert closed_form_1f1b([f + b] * num_stages, m) == pytest.approx(sim, rel=REL, abs=REL)
    assert closed([f] * num_stages, [b] * num_stages, m, []) == pytest.approx(sim, rel=REL, abs=REL)


@PROPERTY
@given(pipelines())
def test_closed_form_never_below_simulator(
    p: tuple[list[float], list[float], int, list[float]],
) -> None:
    fwd, bwd, m, send = p
    sim = simulate_1f1b(fwd, bwd, m, send).makespan_ms
    assert closed(fwd, bwd, m, send) >= sim * (1 - REL)


@PROPERTY
@given(pipelines(), shares)
def test_closed_form_without_split_is_a_bound_for_a_common_share(
    p: tuple[list[float], list[float], int, list[float]], share: float
) -> None:
    stage, m, send = [f + b for f, b in zip(p[0], p[1], strict=True)], p[2], p[3]
    fwd, bwd = [share * c for c in stage], [(1 - share) * c for c in stage]
    assert closed_form_1f1b(stage, m, send) >= simulate_1f1b(fwd, bwd, m, send).makespan_ms * (
        1 - REL
    )


@PROPERTY
@given(st.lists(st.floats(0.01, 10.0), min_size=1, max_size=8), st.integers(0, 12))
def test_overestimate_for_b_twice_f(stage: list[float], extra: int) -> None:
    # The design doc said "up to ~19% high". Measured (hill-climbing, m >= S, no sends,
    # b = 2f on every stage): at most (4S-1)/(3S), i.e. 7/6, 11/9, 5/4, ... -> 4/3, reached
    # by test_worst_overestimate_is_reached. In general 1 + min(a, 1-a) (S-1)/S for a common
    # forward share a.
    num_stages = len(stage)
    m = num_stages + extra
    sim = simulate_1f1b([c / 3 for c in stage], [2 * c / 3 for c in stage], m).makespan_ms
    worst = (4 * num_stages - 1) / (3 * num_stages)
    assert closed_form_1f1b(stage, m) <= worst * sim * (1 + REL)


@PROPERTY
@given(pipelines(sends=False))
def test_overestimate_for_any_split_is_below_twice(
    p: tuple[list[float], list[float], int, list[float]],
) -> None:
    # max(f) + max(b) can be twice max(f + b) when stages split differently; measured < 2x
    # (m >= S, no sends). Sends far above compute are not bounded: ~(m+1)/2 x for m ~ S.
    fwd, bwd, m, send = p
    m = max(m, len(fwd))
    assert closed(fwd, bwd, m, send) <= 2 * simulate_1f1b(fwd, bwd, m, send).makespan_ms * (1 + REL)


@PROPERTY
@given(pipelines(), st.data())
def test_simulator_is_monotone(
    p: tuple[list[float], list[float], int, list[float]], data: st.DataObject
) -> None:
    fwd, bwd, m, send = p
    before = simulate_1f1b(fwd, bwd, m, send).makespan_ms
    which = data.draw(st.sampled_from([v for v in (fwd, bwd, send) if v]))
    which[data.draw(st.integers(0, len(which) - 1))] += data.draw(st.floats(0.0, 5.0))
    assert simulate_1f1b(fwd, bwd, m, send).makespan_ms >= before * (1 - REL)


@PROPERTY
@given(pipelines())
def test_simulator_busy_time_and_symmetry(
    p: tuple[list[float], list[float], int, list[float]],
) -> None:
    fwd, bwd, m, send = p
    result = simulate_1f1b(fwd, bwd, m, send)
    assert result.busy_ms == pytest.approx([m * (f + b) for f, b in zip(fwd, bwd, strict=True)])
    assert all(-REL <= x <= 1.0 for x in result.idle_fraction)
    # Reversing time maps 1F1B onto itself with forwards and backwards swapped.
    swapped = simulate_1f1b(bwd, fwd, m, send).makespan_ms
    assert swapped == pytest.approx(result.makespan_ms, rel=REL, abs=REL)


@PROPERTY
@given(pipelines())
def test_timeline_is_the_earliest_schedule(
    p: tuple[list[float], list[float], int, list[float]],
) -> None:
    # Checks the simulator against the schedule's definition, independently of its loop order.
    fwd, bwd, m, send = p
    num_stages = len(fwd)
    send = send or [0.0] * (num_stages - 1)
    result = simulate_1f1b(fwd, bwd, m, send, record_timeline=True)
    end = {(s, k, i): e for s, k, i, _, e in result.timeline}
    for s in range(num_stages):
        ops = [op for op in result.timeline if op[0] == s]
        assert [(k, i) for _, k, i, _, _ in ops] == spec_order(num_stages, s, m)
        previous = 0.0
        for _, kind, i, start, stop in ops:
            ready = previous
            if kind == "F" and s > 0:
                ready = max(ready, end[(s - 1, "F", i)] + send[s - 1])
            if kind == "B" and s < num_stages - 1:
                ready = max(ready, end[(s + 1, "B", i)] + send[s])
            assert start == pytest.approx(ready, rel=REL, abs=REL)
            assert stop == pytest.approx(start + (fwd[s] if kind == "F" else bwd[s]), rel=REL)
            previous = stop
    assert result.makespan_ms == max(end.values())
