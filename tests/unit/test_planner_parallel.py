"""Issue 32's second round of planner speed changes no result: one SCIP instance
reused per process and thread, work a parent no longer wants dropped by its child,
refinement and the recomputation search run beside the main search where a core is
free, and the sharded space's baselines re-scored as the plan was."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.models import get_model
from autohet_cli.planner import decide, milp, parallel
from autohet_cli.planner.api import PlanOutcome, make_plan, training_for
from autohet_cli.planner.groups import Template
from autohet_cli.planner.search import SearchRequest
from tests.bruteforce import tiny_cluster
from tests.planning import GPT13, V100_QUAD, plan_gpt13

SHARES: dict[str, Any] = {  # three templates' bottleneck and fill ms
    "counts": [2, 1, 3],
    "bottleneck_ms": [10.0, 7.0, 13.0],
    "fill_ms": [40.0, 30.0, 55.0],
}


def _shares(m: int = 40) -> tuple[tuple[int, ...], tuple[int, ...], float]:
    got = milp.solve_shares(num_microbatches=m, time_limit_s=5.0, **SHARES)
    assert got is not None
    return got.microbatches, got.extra, got.makespan_ms


def test_a_reused_scip_instance_solves_each_model_afresh() -> None:
    first = _shares()
    other = _shares(25)  # another model in between, on the same instance
    assert other != first
    assert _shares() == first
    # the same instance, emptied, for the next model of this thread
    assert milp._model("a", 1.0, 1e-3) is milp._model("b", 1.0, 1e-3)


def test_each_thread_and_each_forked_process_has_its_own_scip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mine = milp._model("here", 1.0, 1e-3)
    seen: list[Any] = []
    worker = threading.Thread(target=lambda: seen.append((milp._model("t", 1.0, 1e-3), _shares())))
    worker.start()
    worker.join()
    assert seen[0][0] is not mine and seen[0][1] == _shares()
    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    job = parallel.Pending(_shares)  # forked after this process made its instance
    try:
        assert job.forked and job.result(timeout_s=60) == _shares()
    finally:
        job.cancel()


def _nap() -> int:
    time.sleep(0.5)
    return 1


def _touch(path: str) -> int:
    Path(path).write_text("ran")
    return 2


def test_a_dropped_job_is_skipped_by_the_child_and_run_here_if_asked_after_all(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    marker = tmp_path / "ran"
    job = parallel.Pending(_nap, lambda: _touch(str(marker)), lambda: os.getpid())
    try:
        job.drop(1)  # while the child still sleeps in the first
        assert job.result(0, timeout_s=60) == 1
        assert job.result(2, timeout_s=60) != os.getpid()  # the child went on after it
        assert not marker.exists()  # ... having skipped the dropped one
        assert job.result(1) == 2 and marker.exists()  # asked after all: run here
    finally:
        job.cancel()


def test_spare_cores_count_the_children_still_working(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(parallel.PROCESSES_ENV, "1")
    assert not parallel.spare_core() and not parallel.spare_core(crowd=1)
    assert parallel.ahead(lambda: 1) is None  # nothing run, nothing forked
    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    assert parallel.spare_core()
    busy = parallel.Pending(lambda: time.sleep(30))
    try:
        assert not parallel.spare_core()  # this process and its child: both cores
        assert parallel.spare_core(crowd=1)
        inside = parallel.Pending(parallel.spare_core)
        try:  # a planner child forks no more, whatever the cores
            assert inside.result(timeout_s=60) is False
        finally:
            inside.cancel()
    finally:
        busy.cancel()
    assert parallel.spare_core()  # a cancelled child is not working
    done = parallel.Pending(lambda: 5)
    assert done.result(timeout_s=float("inf")) == 5  # no deadline: seconds_left() is inf
    deadline = time.monotonic() + 10
    while done.working and time.monotonic() < deadline:  # it exits after answering
        time.sleep(0.01)
    assert parallel.spare_core()
    done.cancel()


# Memory binds on both. Four V100s: the sharded plan beats the plain one (issue 31's
# case), so the recomputation search started ahead in the plain space is dropped and
# run again in the sharded one. Two V100s: one pipeline, nothing to shard, so ZeRO-1
# keeps the plain space and the search started ahead is the one used.
V100_PAIR = tiny_cluster((("v0", "V100-16", 2, None),), name="v100-pair")


def _plan(cluster: Any, batch: int, **kw: Any) -> PlanOutcome:
    return plan_gpt13(cluster, batch, time_limit_s=30.0, **kw)


def _same(one: PlanOutcome, two: PlanOutcome) -> None:
    assert one.plan.pipelines == two.plan.pipelines
    assert one.plan.training == two.plan.training
    assert one.eval.iteration_ms == two.eval.iteration_ms
    assert one.plan.notes == two.plan.notes
    assert one.baselines.keys() == two.baselines.keys()
    for name, cand in one.baselines.items():
        other = two.baselines[name]
        assert (cand is None) == (other is None), name
        if cand is not None and other is not None:
            assert cand.eval.iteration_ms == other.eval.iteration_ms, name


@pytest.mark.parametrize(("cluster", "ahead_used"), [(V100_QUAD, False), (V100_PAIR, True)])
def test_where_memory_binds_two_processes_plan_what_one_plans(
    monkeypatch: pytest.MonkeyPatch, cluster: Any, ahead_used: bool
) -> None:
    monkeypatch.setenv(parallel.PROCESSES_ENV, "1")
    # ZeRO-1 and recomputation alone (sharded weights: the test below)
    one = _plan(cluster, 16, shard_weights=False)
    started, used = [], []
    real_ahead, real_from = parallel.ahead, decide._recompute_from

    def spy_ahead(fn: Any, **k: Any) -> Any:
        job = real_ahead(fn, **k)
        if getattr(fn, "func", None) is decide._recompute_in:  # not refinement's
            started.append(job is not None)
        return job

    def spy_from(*a: Any) -> Any:
        used.append(True)
        return real_from(*a)

    monkeypatch.setattr(parallel, "ahead", spy_ahead)
    monkeypatch.setattr(decide, "_recompute_from", spy_from)
    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    two = _plan(cluster, 16, shard_weights=False)
    assert started == [True]  # memory binds: the recomputation search went ahead
    assert bool(used) is ahead_used
    assert one.plan.training.zero1 is not ahead_used
    _same(one, two)


def test_with_sharded_weights_decided_two_processes_plan_what_one_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The V100 quad at batch 16 ends in the weight-sharded space (planner.weights)."""
    monkeypatch.setenv(parallel.PROCESSES_ENV, "1")
    one = _plan(V100_QUAD, 16)
    assert any(s.shard == "weights" for p in one.plan.pipelines for s in p.stages)
    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    _same(one, _plan(V100_QUAD, 16))


def test_sharded_baselines_are_the_plain_ones_rescored_when_no_sharded_search_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ZeRO-1 adopted on the plain search's own layouts (memory does not bind): the
    baselines are those of the plain space re-scored sharded, as the plan was, in
    one process and two alike."""
    cluster = tiny_cluster((("c0", "V100-16", 2, None),), name="pair")
    model = get_model("gpt-tiny")
    training = training_for(32, 64, "fp32", "adam")

    def plan(zero1: bool | None) -> PlanOutcome:
        return make_plan(
            name="pair",
            cluster=cluster,
            model=model,
            tables=CostTables(model, None, training),
            global_batch_size=32,
            time_limit_s=20.0,
            zero1=zero1,
        )

    plain = plan(False)
    for processes in ("1", "2"):
        monkeypatch.setenv(parallel.PROCESSES_ENV, processes)
        chosen = plan(None)
        assert chosen.plan.training.zero1, chosen.plan.notes
        sharded = CostTables(model, None, training).with_zero1(True)
        assert plain.baselines.keys() == chosen.baselines.keys() and plain.baselines
        for name, cand in plain.baselines.items():
            assert cand is not None
            again = chosen.baselines[name]
            assert again is not None and again.pipelines == cand.pipelines
            ev = evaluate(cand.pipelines, cluster, sharded, cand.mbs)
            assert again.eval.iteration_ms == pytest.approx(ev.iteration_ms), name
    assert os.environ[parallel.PROCESSES_ENV] == "2"


def _pair_request(**kw: Any) -> SearchRequest:
    """GPT-1.3B on two V100s, batch 16 (``kw``: SearchRequest's options)."""
    training = training_for(16, 1024, "bf16", "adam")
    return SearchRequest(
        cluster=V100_PAIR,
        model=GPT13,
        tables=CostTables(GPT13, None, training),
        global_batch_size=16,
        **kw,
    )


def test_a_recomputation_search_ahead_that_misses_the_deadline_leaves_the_plain_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from autohet_cli.costmodel.budget import deadline_in

    monkeypatch.setenv(parallel.PROCESSES_ENV, "2")
    req = _pair_request(recompute=True)
    plain_result: Any = object()  # what the plain search found
    job: Any = parallel.Pending(lambda: time.sleep(30))
    try:
        start = time.monotonic()
        with deadline_in(0.3):
            got, space = decide._recompute_from(job, plain_result, req)
        assert time.monotonic() - start < 5
    finally:
        job.cancel()
    assert got is plain_result
    assert not space.recompute and not space.recompute_types


def test_a_scip_instance_a_failed_solve_left_unusable_is_replaced() -> None:
    class Broken:
        def freeProb(self) -> None:  # noqa: N802 (pyscipopt's name)
            raise RuntimeError("SCIP error in a bad stage")

    milp._SCIP.held = (os.getpid(), Broken())
    model = milp._model("after", 1.0, 1e-3)
    assert not isinstance(model, Broken)
    assert _shares() == _shares()  # and it solves


@pytest.mark.parametrize(("status", "remembered"), [("infeasible", True), ("time_limit", False)])
def test_a_split_not_found_in_time_is_not_remembered_as_none_fitting(
    monkeypatch: pytest.MonkeyPatch, status: str, remembered: bool
) -> None:
    from autohet_cli.planner import enumeration, solve

    req = _pair_request()
    ctx = enumeration.make_context(req, 1, 1)
    assert ctx is not None
    tpl = Template(classes=(0, 0))
    monkeypatch.setattr(solve, "solve_split", lambda *a, **k: None)
    monkeypatch.setattr(solve, "last_status", lambda: status)
    assert solve.template_split(req, ctx, tpl, 4, 0.0, 10, 1.0) is None
    assert (len(ctx.splits) == 1) is remembered
