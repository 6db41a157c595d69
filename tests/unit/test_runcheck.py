"""``profile run``'s runtime phase: what it records and keeps when runs succeed, fail
or cannot start (the launch itself is replaced here; test_cli_profile_run runs it)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from autohet_cli.cluster import Cluster
from autohet_cli.errors import AutohetError
from autohet_cli.launch.compare import collective_sync_ms, compare, shard_links
from autohet_cli.launch.preflight import PreflightError
from autohet_cli.models import get_model
from autohet_cli.plan import Plan
from autohet_cli.profiling import runcheck
from autohet_cli.profiling.calibrate import calibrate
from autohet_cli.profiling.runcheck import RunCheckOptions, check_host
from autohet_cli.profiling.runshapes import predicted, shape_plan, shapes_for
from autohet_cli.profiling.schema import EntryKey, LayerTiming, Overhead, Profile, ProfileEntry
from tests.planting import cpu_host
from tests.unit.test_prediction_check import _report

TINY = get_model("gpt-tiny")
HOST = cpu_host("h", num_gpus=2, gpu_mem_bytes=8 << 30, intra_node_gbps=100.0)
CLUSTER = Cluster(name="c", hosts=(HOST,), inter_node_gbps=10.0)


def _probe(mbss: tuple[int, ...] = (2,)) -> Profile:
    entries = {}
    for tp, mbs in ((t, m) for t in (1, 2) for m in mbss):
        key = EntryKey(
            model=TINY.name, gpu_type="cpu", tensor_parallel=tp, micro_batch_size=mbs, seq_len=64
        )
        layer = LayerTiming(
            fwd_ms=1.0 / tp, bwd_ms=2.0 / tp, update_ms=0.1, num_params=1000,
            act_bytes=1e5, output_bytes=1e4,
        )  # fmt: skip
        entries[key] = ProfileEntry(
            key=key, source="measured", dtype="fp32", layers=(layer,) * TINY.num_layers
        )
    return Profile(entries=entries)


def _check(plan: Plan, factor: float, extra_ms: float) -> dict[str, Any]:
    """What a run of ``plan`` reports: stages ``factor`` x slower, ``extra_ms`` fixed."""
    report = _report(plan, factor, mem_bytes=1 << 20, step_extra_ms=extra_ms)
    check = compare(plan, report, None, shard_links(plan, CLUSTER))
    return {**check, "run_id": f"r-{plan.name}"}


def _run_host(
    monkeypatch: pytest.MonkeyPatch, fake: Any
) -> tuple[Profile, list[dict[str, object]]]:
    monkeypatch.setattr(runcheck, "_run", fake)
    return check_host(
        HOST, CLUSTER, TINY, _probe(), seq_len=64, tps=[1, 2], mbs_candidates=[2],
        options=RunCheckOptions(), say=lambda _m: None,
    )  # fmt: skip


def test_every_shape_runs_and_refits_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    prof, records = _run_host(monkeypatch, lambda plan, *a, **k: _check(plan, 2.0, 7.0))
    assert [(r["shape"], r["status"]) for r in records] == [
        ("data-parallel-2", "ran"),
        ("tp-2", "ran"),
        ("two-stages", "ran"),
        ("sharded-weights-2", "ran"),
    ]
    assert prof.meta["runtime_runs"] == {"h": records}
    assert len(prof.meta["calibrated_from"]) == 4
    # the sharded run refit its collectives' factor (2x slower stages here, over layer
    # times the runs before it already refit to 2x: a factor above 1 as well)
    assert prof.overheads["cpu"].shard_x > 1.0
    assert {e.source for e in prof.entries.values()} == {"calibrated"}
    assert prof.overheads["cpu"].step_ms > 0


def test_a_failed_run_is_recorded_and_the_others_still_refit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fake(plan: Plan, *a: Any, **k: Any) -> dict[str, Any]:
        if plan.tensor_parallel == 2:
            raise AutohetError("the runcheck-tp-2 run failed: rank 1 crashed")
        if len(plan.pipelines) == 1:
            return {"step": {}}  # a report from another version: no stages
        return _check(plan, 2.0, 7.0)

    prof, records = _run_host(monkeypatch, fake)
    assert [(r["shape"], r["status"]) for r in records] == [
        ("data-parallel-2", "ran"),
        ("tp-2", "failed"),
        ("two-stages", "failed"),
        ("sharded-weights-2", "ran"),
        ("tp-2", "carried"),
    ]
    assert "rank 1 crashed" in str(records[1]["why"])
    # the data-parallel run's refit is kept, and the sharded run's factor beside it
    assert len(prof.meta["calibrated_from"]) == 2
    # TP 2 ran nothing of its own: it is no faster than the probe by more than TP 1
    # turned out to be (2x here), so the planner does not favour it for its failure
    probe = _probe()
    for key, entry in prof.entries.items():
        base = probe.entries[key]
        assert entry.source == "calibrated", key
        for lt, b in zip(entry.layers, base.layers, strict=True):
            assert lt.fwd_ms == pytest.approx(2 * b.fwd_ms), key


def test_out_of_memory_retries_at_the_next_smaller_micro_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe can under-predict what a step holds; a run that runs out of memory is
    recorded and it and the later shapes run one measured size smaller, so that their
    refit (the memory overhead) keeps plans off the size that did not fit."""
    sizes = []

    def fake(plan: Plan, *a: Any, **k: Any) -> dict[str, Any]:
        sizes.append(plan.training.micro_batch_size)
        if plan.training.micro_batch_size == 4:
            raise AutohetError("rank 0 on h: OutOfMemoryError: CUDA out of memory. Tried ...")
        return _check(plan, 1.0, 1.0)

    monkeypatch.setattr(runcheck, "_run", fake)
    prof, records = check_host(
        HOST, CLUSTER, TINY, _probe((1, 2, 4)), seq_len=64, tps=[1, 2], mbs_candidates=[1, 2, 4],
        options=RunCheckOptions(), say=lambda _m: None,
    )  # fmt: skip
    assert sizes == [4, 2, 2, 2, 2]
    assert [(r["shape"], r["status"], r["micro_batch_size"]) for r in records] == [
        ("data-parallel-2", "failed", 4),
        ("data-parallel-2", "ran", 2),
        ("tp-2", "ran", 2),
        ("two-stages", "ran", 2),
        ("sharded-weights-2", "ran", 2),
    ]
    assert len(prof.meta["calibrated_from"]) == 4


def test_a_worker_killed_by_a_signal_is_not_taken_for_out_of_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Triage guesses "(out of memory?)" for any killed worker; only torch's own
    out-of-memory error retries at a smaller micro-batch."""
    sizes = []

    def fake(plan: Plan, *a: Any, **k: Any) -> dict[str, Any]:
        sizes.append(plan.training.micro_batch_size)
        raise AutohetError("rank 0 on h: killed by signal 11 (out of memory?)")

    monkeypatch.setattr(runcheck, "_run", fake)
    check_host(
        HOST, CLUSTER, TINY, _probe((1, 2, 4)), seq_len=64, tps=[1, 2], mbs_candidates=[1, 2, 4],
        options=RunCheckOptions(), say=lambda _m: None,
    )  # fmt: skip
    assert sizes == [4, 4, 4, 4]  # each shape once, at the size chosen


def test_a_host_without_autohet_keeps_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(plan: Plan, *a: Any, **k: Any) -> dict[str, Any]:
        raise PreflightError("h: autohet is not importable by python3")

    prof, records = _run_host(monkeypatch, fake)
    assert [(r["shape"], r["status"]) for r in records] == [("data-parallel-2", "skipped")]
    assert "not importable" in str(records[0]["why"])
    assert {e.source for e in prof.entries.values()} == {"measured"}
    assert not prof.overheads and prof.meta["runtime_runs"] == {"h": records}


def test_nothing_fits_the_budget_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runcheck, "_run", lambda *a, **k: pytest.fail("nothing should run"))
    prof, records = check_host(
        HOST, CLUSTER, TINY, _probe(), seq_len=64, tps=[1, 2], mbs_candidates=[2],
        options=RunCheckOptions(budget_s=1e-6), say=lambda _m: None,
    )  # fmt: skip
    assert [r["status"] for r in records] == ["skipped"]
    assert "budget" in str(records[0]["why"])


def test_a_tp_runs_fixed_cost_goes_to_tp_stages() -> None:
    shapes = shapes_for(TINY.num_layers, 2, [2])
    plans = {s.name: predicted(
        shape_plan(s, TINY, HOST, mbs=2, seq_len=64, precision="fp32"),
        CLUSTER, _probe(), TINY,
    ) for s in shapes}  # fmt: skip
    prof, _ = calibrate(
        _probe(), _check(plans["data-parallel-2"], 1.0, 5.0), TINY, run_id="a",
        global_batch_size=16,
    )  # fmt: skip
    step = prof.overheads["cpu"].step_ms
    assert step == pytest.approx(5.0, rel=0.05)
    prof, _ = calibrate(
        prof, _check(plans["tp-2"], 1.0, 45.0), TINY, run_id="b", global_batch_size=16
    )
    o = prof.overheads["cpu"]
    assert o.step_ms == step  # TP 1 plans are not charged the TP run's cost
    assert o.tp_step_ms[2] == pytest.approx(40.0, rel=0.05)
    assert isinstance(o, Overhead)


def test_the_collective_is_the_sync_of_the_last_replica_to_arrive() -> None:
    def st(a: int, b: int, sync: float) -> dict[str, Any]:
        return {"layers": [a, b], "measured": {"sync_ms": sync}}

    # pipelines cut differently: layers 0-3 are held by a [0,3) and a [0,5) stage
    stages = [st(0, 3, 9.0), st(3, 6, 4.0), st(0, 5, 2.0), st(5, 6, 3.0)]
    # segment [0,3): min(9, 2) = 2; [3,5): min(4, 2) = 2; [5,6): min(4, 3) = 3
    assert collective_sync_ms(stages) == 3.0
    assert collective_sync_ms([]) == 0.0


def test_a_run_over_its_time_limit_is_stopped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from autohet_cli.launch.executor import JobOutcome
    from autohet_cli.transport.pool import HostPool

    def fake_job(*_a: Any, stop: Any, **_k: Any) -> JobOutcome:
        assert stop.wait(10), "the time limit never stopped the run"
        return JobOutcome(status="interrupted", exit_code=130, local_run_dir=str(tmp_path))

    monkeypatch.setattr(runcheck, "run_job", fake_job)
    shape = shapes_for(TINY.num_layers, 2, [1])[0]
    plan = predicted(
        shape_plan(shape, TINY, HOST, mbs=2, seq_len=64, precision="fp32"), CLUSTER, _probe(), TINY
    )
    options = RunCheckOptions(run_timeout_s=0.2)
    with HostPool(CLUSTER, options.connect) as pool, pytest.raises(AutohetError, match="took over"):
        runcheck._run(plan, CLUSTER, pool, tmp_path, options, lambda _m: None)
    # Ctrl-C (the caller's stop) stops it too, and says it was interrupted, not slow
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    slow = RunCheckOptions(run_timeout_s=60)
    with HostPool(CLUSTER, slow.connect) as pool, pytest.raises(AutohetError, match="interrupted"):
        runcheck._run(plan, CLUSTER, pool, tmp_path / "b", slow, lambda _m: None, stop)


def test_compile_seconds_come_from_rank_0s_startup_line() -> None:
    from autohet_cli.profiling.runcheck import compile_seconds

    eager = ["[localhost:0] autohet runtime: startup: 3.1 s to the first step (imports 1.00 s)"]
    timed = [
        "step 0 loss 10.1",
        "[localhost:0] autohet runtime: startup: 40.2 s to the first step (imports 1.00 s, "
        "first step 38.00 s, torch.compile on: 35.20 s of the first step)",
    ]
    untimed = ["autohet runtime: startup: 9.0 s to the first step (torch.compile on)"]
    assert compile_seconds(eager) is None
    assert compile_seconds(timed) == 35.2
    assert compile_seconds(untimed) == 0.0
