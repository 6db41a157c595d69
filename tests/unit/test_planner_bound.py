"""Issue 32, item 3: a search told what it must beat (``SearchRequest.must_beat_ms``)
never solves a grouping whose lower bound says it cannot, and the ZeRO-1 decision
that passes it decides as it did without it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import NoBetterPlan
from autohet_cli.planner import decide, solve
from autohet_cli.planner.api import PlanOutcome, training_for
from autohet_cli.planner.search import SearchRequest, search
from tests.bruteforce import tiny_cluster
from tests.planning import GPT13, V100_QUAD, plan_gpt13

# memory binds (GPT-1.3B at batch 16 on 16 GB cards), three hosts of two types
MIXED = tiny_cluster(
    (("v0", "V100-16", 4, None), ("v1", "V100-16", 4, None), ("r0", "RTX-3090", 4, None)),
    name="bound-mix",
)


def _request(**kw: Any) -> SearchRequest:
    training = training_for(32, 1024, "bf16", "adam")
    return SearchRequest(
        cluster=kw.pop("cluster", MIXED),
        model=GPT13,
        tables=CostTables(GPT13, None, training),
        global_batch_size=32,
        time_limit_s=20.0,
        **kw,
    )


def _solved(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The groupings handed to SCIP from now on."""
    seen: list[Any] = []
    real = solve._solve_grouping

    def spy(req: SearchRequest, ctx: Any, g: Any, *a: Any) -> Any:
        seen.append(g)
        return real(req, ctx, g, *a)

    monkeypatch.setattr(solve, "_solve_grouping", spy)
    return seen


def test_a_target_under_every_bound_solves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _solved(monkeypatch)
    with pytest.raises(NoBetterPlan, match=r"beats 0\.0 ms per iteration: \d+ groupings bounded"):
        search(_request(must_beat_ms=1e-6))
    assert seen == []


def test_no_grouping_at_or_over_the_target_is_solved_and_the_best_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _solved(monkeypatch)
    free = search(_request())
    unbounded = list(seen)
    assert len(unbounded) > 2
    # just over the best: the best is still found, and nothing bounded over it solved
    target = free.best.score * (1 + 1e-6)
    seen.clear()
    bounded = search(_request(must_beat_ms=target))
    assert bounded.best.score == pytest.approx(free.best.score)
    assert seen and all(g.lower_bound_ms < target for g in seen)
    assert bounded.explored <= free.explored
    # a target the bounds cut into: never a grouping bounded over it solved, and every
    # one the search without a target solved that could get under it solved too
    # (estimates and solve caps follow the incumbent, not the target: review); the
    # solves the bound saved may go to groupings further down the queue
    cut = sorted(g.lower_bound_ms for g in unbounded)[len(unbounded) // 2]
    seen.clear()
    try:
        search(_request(must_beat_ms=cut))
    except NoBetterPlan:
        pass
    assert all(g.lower_bound_ms < cut for g in seen)
    assert {g for g in unbounded if g.lower_bound_ms < cut} <= set(seen)


def test_the_cost_objective_is_not_bounded_by_ms() -> None:
    # a lower bound in ms says nothing of dollars per token: the target is ignored
    priced = replace(
        MIXED, hosts=tuple(replace(h, price_per_hour=2.0 + i) for i, h in enumerate(MIXED.hosts))
    )
    free = search(_request(objective="cost", cluster=priced))
    bounded = search(_request(objective="cost", cluster=priced, must_beat_ms=1e-6))
    assert bounded.best.score == pytest.approx(free.best.score)


def _opt30b() -> PlanOutcome:
    from benchmarks import opt30b

    # OPT-30B on 32 A100-40 + 32 V100-16: binds, ZeRO-1 loses (sharded weights, which
    # follow, are searched within a time budget: test_planner_weights's)
    return opt30b.plan(shard_weights=False)


@pytest.mark.parametrize("case", ["v100-quad", "opt30b"])
def test_the_zero1_decision_is_the_same_with_the_bound(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    def planned() -> PlanOutcome:
        return plan_gpt13(V100_QUAD, 16, with_baselines=False) if case == "v100-quad" else _opt30b()

    monkeypatch.setenv("AUTOHET_PLANNER_PROCESSES", "1")  # one process: spies see all
    asked: list[float | None] = []
    real = decide.search

    def spy(req: SearchRequest, progress: Any = None) -> Any:
        if req.tables.training.zero1:
            asked.append(req.must_beat_ms)
        return real(req, progress)

    monkeypatch.setattr(decide, "search", spy)
    bounded = planned()
    assert asked and asked[0] is not None  # memory binds: the sharded space is searched

    def unbounded(req: SearchRequest, progress: Any = None) -> Any:
        return real(replace(req, must_beat_ms=None), progress)

    monkeypatch.setattr(decide, "search", unbounded)
    free = planned()
    assert bounded.plan.training == free.plan.training
    assert bounded.plan.pipelines == free.plan.pipelines
    assert bounded.eval.iteration_ms == pytest.approx(free.eval.iteration_ms)
    assert [n for n in bounded.plan.notes if "ZeRO-1" in n] == [
        n for n in free.plan.notes if "ZeRO-1" in n
    ]
