"""A run against its plan, calibration from it, overheads in the cost model, traces.

The runtime side (what ranks measure and rank 0 reports) runs in one process here;
the comparison, the refit and the traces are pure and checked on known numbers.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autohet_cli.cluster import load_cluster
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.defaults import resolve_cluster_path
from autohet_cli.errors import ConfigError
from autohet_cli.launch.compare import compare, explained_ms, link_send_ms, render
from autohet_cli.models import get_model
from autohet_cli.plan import Device, Pipeline, Plan, Stage
from autohet_cli.profiling.calibrate import calibrate
from autohet_cli.profiling.schema import Overhead, Profile, load_profile, save_profile
from autohet_cli.settings import TrainingSettings
from autohet_cli.trace import Span, chrome_trace, predicted_spans
from tests.planning import plan_tables

MODEL = get_model("gpt-tiny")
TRAINING = TrainingSettings(global_batch_size=8, micro_batch_size=2, seq_len=64, precision="fp32")


def _plan(profile: Profile | None = None) -> Plan:
    """The planner's plan for gpt-tiny on the embedded localhost cluster."""
    cluster = load_cluster(resolve_cluster_path(None))
    tables = CostTables(MODEL, profile, TRAINING, gpu_specs=cluster.gpu_specs)
    return plan_tables(cluster, tables, name="t", time_limit_s=5, with_baselines=False).plan


def _report(plan: Plan, factor: float, *, mem_bytes: int, step_extra_ms: float) -> dict:
    """A run report whose stages took ``factor`` times their prediction."""
    ranks = []
    rank = 0
    for p, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            assert stage.predicted is not None
            m = pipeline.num_microbatches
            for tp in range(stage.tensor_parallel):
                fwd = stage.predicted.fwd_ms * factor * m
                bwd = stage.predicted.bwd_ms * factor * m
                ranks.append(
                    {
                        "rank": rank,
                        "host": "localhost",
                        "pipeline": p,
                        "stage": s,
                        "tp_rank": tp,
                        "num_microbatches": m,
                        "device": "cpu",
                        "peak_mem_bytes": mem_bytes,
                        "medians": {
                            "fwd_ms": fwd,
                            "bwd_ms": bwd,
                            "p2p_ms": 0.0,
                            "sync_ms": 0.0,
                            "optimizer_ms": 1.0,
                            "step_ms": fwd + bwd + 1.0 + step_extra_ms,
                            "steps": 8.0,
                        },
                    }
                )
                rank += 1
    return {"schema": "autohet.run-report/v1", "plan": "t.v1", "ranks": ranks}


def test_the_check_gives_ratios_the_unexplained_step_cost_and_flags_memory() -> None:
    plan = _plan()
    cluster = load_cluster(resolve_cluster_path(None))
    report = _report(plan, 4.0, mem_bytes=50 << 30, step_extra_ms=7.0)
    check = compare(plan, report, link_send_ms(plan, cluster, "cpu"))
    for st in check["stages"]:
        assert st["ratio"]["fwd"] == pytest.approx(0.25)
        assert st["ratio"]["bwd"] == pytest.approx(0.25)
    # one pipeline of one stage per device here: the stage times explain all but 7 ms
    if all(len(p.stages) == 1 for p in plan.pipelines):
        assert check["step_overhead_ms"] == pytest.approx(7.0, abs=1e-6)
    assert check["memory_under_predicted"]  # 50 GiB measured: flagged
    text = render(check)
    assert "predicted vs measured" in text and "memory under-predicted" in text


def test_calibration_scales_each_term_and_adds_the_overheads(tmp_path: Path) -> None:
    plan = _plan()
    report = _report(plan, 3.0, mem_bytes=900 << 20, step_extra_ms=5.0)
    check = compare(plan, report, None)
    refit, rows = calibrate(Profile(), check, MODEL, run_id="run-a", global_batch_size=8)
    assert {r["was"] for r in rows} == {"analytic"}
    assert all(r["fwd_x"] == pytest.approx(3.0) for r in rows)
    assert all(e.source == "calibrated" and e.dtype == "fp32" for e in refit.entries.values())
    over = refit.overheads["cpu"]
    assert over.step_ms == pytest.approx(check["step_overhead_ms"])
    assert over.mem_bytes > 0  # 900 MiB is more than gpt-tiny's prediction
    # The refitted profile predicts the measured stage times and never less memory.
    again = _plan(refit)
    tables = CostTables(MODEL, refit, TRAINING)
    for p in again.pipelines:
        for s in p.stages:
            assert s.predicted is not None
            assert s.predicted.mem_bytes >= 900 << 20
            base = CostTables(MODEL, None, TRAINING).table("cpu", s.tensor_parallel, 2, 80.0)
            fitted = tables.table("cpu", s.tensor_parallel, 2, 80.0)
            a, b = s.layer_start, s.layer_end
            if s.tensor_parallel == 1:
                assert fitted.stage(a, b).fwd_ms == pytest.approx(3 * base.stage(a, b).fwd_ms)
    # The profile file keeps the overheads; a run calibrates a profile once.
    path = save_profile(refit, tmp_path / "p.yaml")
    assert load_profile(path).overheads == refit.overheads
    with pytest.raises(ConfigError, match="already calibrated from run-a"):
        calibrate(refit, check, MODEL, run_id="run-a", global_batch_size=8)


def test_overheads_enter_the_iteration_and_the_memory() -> None:
    plain = _plan()
    extra = Profile(overheads={"cpu": Overhead(step_ms=40.0, mem_bytes=1 << 30)})
    cluster = load_cluster(resolve_cluster_path(None))
    from autohet_cli.costmodel.evaluate import evaluate

    analytic = CostTables(MODEL, None, TRAINING)
    ev0 = evaluate(plain.pipelines, cluster, analytic, 2)
    ev1 = evaluate(plain.pipelines, cluster, CostTables(MODEL, extra, TRAINING), 2)
    # the calibrated step cost replaces the catalog's estimate of it (costmodel.fixed)
    world = len(plain.devices())
    estimated = max(analytic.step_overhead_ms("cpu", s.tensor_parallel, world)
                    for p in plain.pipelines for s in p.stages)  # fmt: skip
    assert estimated > 0
    assert ev1.iteration_ms == pytest.approx(ev0.iteration_ms - estimated + 40.0)
    mem0 = [st.mem_bytes for e in ev0.pipelines for st in e.stages]
    mem1 = [st.mem_bytes for e in ev1.pipelines for st in e.stages]
    assert [b - a for a, b in zip(mem0, mem1, strict=True)] == [1 << 30] * len(mem0)


def test_a_bad_overhead_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("schema: autohet.profile/v1\noverheads: {cpu: {step_ms: -1}}\n")
    with pytest.raises(ConfigError, match="overheads.cpu"):
        load_profile(path)
    path.write_text("schema: autohet.profile/v1\noverheads: {cpu: {stepms: 1}}\n")
    with pytest.raises(ConfigError, match="stepms"):
        load_profile(path)


def test_chrome_trace_rows_and_predicted_spans() -> None:
    from autohet_cli.costmodel.pipeline import simulate_1f1b

    sim = simulate_1f1b([1.0, 2.0], [2.0, 4.0], 3, [0.5], record_timeline=True)
    spans = predicted_spans([sim.timeline], [[0.5]], [[0.3, 0.3]], [[0.1, 0.2]], sim.makespan_ms)
    names = [(s.stage, s.name) for s in spans]
    assert (0, "F0") in names and (1, "B2") in names and (0, "send") in names
    assert sum(1 for s in spans if s.name == "send") == 3  # one per forward of stage 0
    sync = [s for s in spans if s.name == "sync"]
    assert all(s.start_ms == sim.makespan_ms for s in sync)
    trace = chrome_trace(spans, title="x")
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "X"}
    x = [e for e in events if e["ph"] == "X"]
    assert len(x) == len(spans) and all(e["dur"] >= 0 for e in x)
    assert {(e["pid"], e["tid"]) for e in x} == {(0, 0), (0, 1)}
    assert Span(pipeline=0, stage=0, name="B12", start_ms=0, end_ms=1).category == "backward"


# --------------------------------------------------------------------- the runtime side


def test_every_step_is_timed_and_rank_0_reports_and_traces(
    alone: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_runtime_trainer import PLAN

    from autohet_cli.runtime.report import REPORT_PREFIX, RunReportHook
    from autohet_cli.runtime.trainer import TrainConfig, Trainer

    hook = RunReportHook(tmp_path, trace_path=tmp_path / "trace.json")
    trainer = Trainer(PLAN, TrainConfig(device="cpu"), hooks=[hook])
    trainer.fit(6)
    trainer.close()
    medians = trainer.timings.medians()
    assert medians is not None and medians["steps"] == 4  # the first two are start-up
    assert medians["fwd_ms"] > 0 and medians["bwd_ms"] > 0 and medians["optimizer_ms"] > 0
    assert medians["step_ms"] >= medians["fwd_ms"] + medians["bwd_ms"]
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(REPORT_PREFIX))
    report = json.loads(line[len(REPORT_PREFIX) :])
    assert report == json.loads((tmp_path / "report.json").read_text())
    assert [r["rank"] for r in report["ranks"]] == [0]
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["args"]["step"] for e in spans}) == [2, 3, 4]
    per_step = [e["name"] for e in spans if e["args"]["step"] == 3]
    assert per_step.count("F0") == 1 and "B1" in per_step and "optimizer" in per_step
    check = compare(replace(PLAN), report)
    assert check["stages"][0]["measured"]["fwd_ms"] > 0


def test_estimate_writes_the_predicted_trace(tmp_path: Path) -> None:
    from autohet_cli.plan import write_plan
    from tests.cli import autohet

    _, path = write_plan(_plan(), tmp_path)
    out = tmp_path / "pred.json"
    res = autohet("estimate", str(path), "--trace", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"F0", "B0", "optimizer"} <= names
    again = autohet("estimate", str(path), "--trace", str(out), cwd=tmp_path)
    assert again.returncode == 1 and "already exists" in again.stderr


def test_a_slow_gradient_sync_is_calibrated_into_the_sync_factor() -> None:
    from autohet_cli.costmodel.evaluate import evaluate
    from autohet_cli.planner.api import with_predictions

    cluster = load_cluster(resolve_cluster_path(None))
    dp = Plan(
        name="dp",
        version=1,
        model_name="gpt-tiny",
        num_layers=MODEL.num_layers,
        training=TRAINING,
        tensor_parallel=1,
        pipelines=tuple(
            Pipeline(
                num_microbatches=2,
                stages=(
                    Stage(
                        layer_start=0,
                        layer_end=MODEL.num_layers,
                        gpu_type="cpu",
                        tensor_parallel=1,
                        devices=(Device(host="localhost", gpu=g),),
                    ),
                ),
            )
            for g in (0, 1)
        ),
    )
    tables = CostTables(MODEL, None, TRAINING, gpu_specs=cluster.gpu_specs)
    ev = evaluate(dp.pipelines, cluster, tables, 2)
    assert ev.grad_sync_ms > 0
    plan = with_predictions(dp, ev)
    report = _report(plan, 1.0, mem_bytes=1 << 20, step_extra_ms=0.0)
    for r in report["ranks"]:
        # The rank that arrived first also waited 10 ms for the other replica: that
        # wait is imbalance (the makespan's), not the all-reduce's rate.
        r["medians"]["sync_ms"] = 3 * ev.grad_sync_ms + (10.0 if r["pipeline"] == 0 else 0.0)
    check = compare(plan, report)
    refit, _ = calibrate(Profile(), check, MODEL, run_id="r", global_batch_size=8)
    assert refit.overheads["cpu"].sync_x == pytest.approx(3.0)
    ideal = explained_ms(check["stages"], None)
    assert ideal is not None
    slowest = max(st["measured"]["fwd_ms"] + st["measured"]["bwd_ms"] for st in check["stages"])
    assert ideal == pytest.approx(2 * slowest + 3 * ev.grad_sync_ms + 1.0)  # 1 ms: optimizer
    again = evaluate(dp.pipelines, cluster, CostTables(MODEL, refit, TRAINING), 2)
    assert again.grad_sync_ms == pytest.approx(3 * ev.grad_sync_ms)


def test_a_pipelined_run_calibrates_the_exchange_latency() -> None:
    from autohet_cli.costmodel.pipeline import simulate_1f1b
    from autohet_cli.launch.compare import explained_ms

    def stage(s: int, fwd: float, bwd: float) -> dict:
        measured = {"fwd_ms": fwd, "bwd_ms": bwd, "optimizer_ms": 1.0, "sync_ms": 0.0}
        return {
            "pipeline": 0,
            "stage": s,
            "gpu_type": "cpu",
            "tensor_parallel": 1,
            "layers": [0, 3] if s == 0 else [3, MODEL.num_layers],
            "num_microbatches": 4,
            "measured": {**measured, "p2p_ms": 0.0, "mem_bytes": 1 << 20},
        }

    stages = [stage(0, 2.0, 4.0), stage(1, 3.0, 6.0)]
    sends, latency, fixed = [[0.01]], 1.5, 9.0
    sim = simulate_1f1b([2.0, 3.0], [4.0, 6.0], 4, [0.01 + latency])
    measured = sim.makespan_ms + 1.0 + fixed
    check = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "seq_len": 64,
        "stages": stages,
        "send_ms": sends,
        "step": {"measured_ms": measured, "predicted_sync_ms": 0.0},
        "step_overhead_ms": measured - (explained_ms(stages, sends) or 0.0),
    }
    known = Profile(overheads={"cpu": Overhead(step_ms=fixed)})
    refit, _ = calibrate(known, check, MODEL, run_id="pp", global_batch_size=8)
    assert refit.overheads["cpu"].p2p_ms == pytest.approx(latency, rel=1e-3)
    assert refit.overheads["cpu"].step_ms == fixed  # a pipelined run leaves the step cost
    # Without a known step cost the gap is the step cost (no latency can be told apart).
    fresh, _ = calibrate(Profile(), check, MODEL, run_id="pp", global_batch_size=8)
    assert fresh.overheads["cpu"].p2p_ms == 0.0
    assert fresh.overheads["cpu"].step_ms == pytest.approx(check["step_overhead_ms"])


def test_an_analytic_prediction_says_so_in_plain_words() -> None:
    """Issue 31.6: "36.83 ms predicted, 419.69 ms measured (0.09x)" said nothing of
    where 36.83 came from; a plan made without a profile says it is the analytic
    model's and how to measure the cluster, one made with a profile says that."""
    plan = _plan()
    report = _report(plan, 2.0, mem_bytes=1 << 20, step_extra_ms=3.0)
    check = compare(plan, report, None)
    assert check["prediction_source"] == "analytic"
    step_line = render(check).splitlines()[1]
    assert step_line.startswith(
        "  step: " + f"{check['step']['predicted_ms']:.2f} ms predicted from the analytic model "
        "(no measured profile: catalog figures for cpu; `autohet profile run` measures this "
        "cluster), "
    ), step_line
    profiled = replace(plan, inputs={"profile": {"path": "p.yaml", "sha256": "0" * 64}})
    again = compare(profiled, report, None)
    assert again["prediction_source"] == "profile"
    assert "ms predicted from the measured profile, " in render(again)
    # a check kept before checks named their source renders as it did
    del again["prediction_source"]
    assert " ms predicted, " in render(again)


def test_weight_sharded_stages_are_left_out_of_the_refit() -> None:
    """Their times hold FSDP's exposed collectives: a sharded stage measured 10 times
    slower refits nothing; a run of sharded stages alone is refused by name."""
    from dataclasses import replace

    plan = _plan()
    report = _report(plan, 3.0, mem_bytes=900 << 20, step_extra_ms=5.0)
    check = compare(plan, report, None)
    assert all(st["shard"] == "none" for st in check["stages"])
    slow = [dict(st, shard="weights") for st in check["stages"]]
    for st in slow:
        st["measured"] = dict(st["measured"], fwd_ms=st["measured"]["fwd_ms"] * 10)
    with pytest.raises(ConfigError, match="every stage of this run shards its weights"):
        calibrate(Profile(), dict(check, stages=slow), MODEL, run_id="r", global_batch_size=8)
    mixed = dict(check, stages=[*check["stages"], *slow])
    refit, rows = calibrate(Profile(), mixed, MODEL, run_id="r", global_batch_size=8)
    assert all(r["fwd_x"] == pytest.approx(3.0) for r in rows)  # not pulled towards 30
    sharded_plan = replace(
        plan,
        pipelines=tuple(
            replace(p, stages=tuple(replace(s, shard="weights") for s in p.stages))
            for p in plan.pipelines
        ),
    )
    assert compare(sharded_plan, report, None)["stages"][0]["shard"] == "weights"
    # a stage recomputing only its first layers (recompute: N) mixes both times: out too
    partial = [dict(st, recompute=1) for st in slow]
    for st in partial:
        st["shard"] = "none"
    with pytest.raises(ConfigError, match=r"recomputes only some of its layers \(recompute: N\)"):
        calibrate(Profile(), dict(check, stages=partial), MODEL, run_id="r", global_batch_size=8)
    mixed = dict(check, stages=[*check["stages"], *partial])
    _, rows = calibrate(Profile(), mixed, MODEL, run_id="r", global_batch_size=8)
    assert all(r["fwd_x"] == pytest.approx(3.0) for r in rows)
    first = plan.pipelines[0].stages[0]
    halves = replace(first, recompute_layers=1)
    part_plan = replace(
        plan, pipelines=(replace(plan.pipelines[0], stages=(halves,)), *plan.pipelines[1:])
    )
    assert compare(part_plan, report, None)["stages"][0]["recompute"] == 1
    # recompute: N of a stage's N layers is every layer: it refits the recompute times
    every = replace(first, recompute_layers=first.num_layers)
    all_plan = replace(
        plan, pipelines=(replace(plan.pipelines[0], stages=(every,)), *plan.pipelines[1:])
    )
    assert compare(all_plan, report, None)["stages"][0]["recompute"] is True
    assert compare(plan, report, None)["stages"][0]["recompute"] is False


def test_the_calibrate_command_says_it_left_sharded_stages_out(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from autohet_cli.plan import write_plan

    plan = _plan()
    check = compare(plan, _report(plan, 3.0, mem_bytes=900 << 20, step_extra_ms=5.0), None)
    check["stages"] = [
        *check["stages"],
        dict(check["stages"][0], shard="weights"),
        dict(check["stages"][0], recompute=2),
    ]
    run = tmp_path / "run"
    run.mkdir()
    (run / "prediction-check.json").write_text(json.dumps(check))
    _, plan_file = write_plan(plan, tmp_path / "plans")
    cmd = [sys.executable, "-m", "autohet_cli", "profile", "calibrate", str(run)]
    cmd += ["--out", str(tmp_path / "p.yaml"), "--plan", str(plan_file)]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "note: 1 weight-sharded stage(s) left out" in res.stdout
    assert "note: 1 stage(s) recomputing only their first layers left out" in res.stdout
    res = subprocess.run(
        [*cmd[:-4], "--out", str(tmp_path / "q.yaml"), "--plan", str(plan_file), "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["sharded_stages_left_out"] == 1 and got["partial_recompute_stages_left_out"] == 1


def test_a_padded_pipeline_of_a_sharded_plan_is_measured_per_microbatch_run() -> None:
    """In a weight-sharded plan every pipeline runs the most micro-batches of any
    (the runtime pads the others, ``fsdp_stage.padded_microbatches``): a pipeline of
    1 micro-batch beside one of 3 ran 3, and its per-micro-batch times are its sums
    over 3, as its holder's are; the check says 3 ran."""
    plan = _plan()
    whole = Stage(
        layer_start=0,
        layer_end=plan.num_layers,
        gpu_type="cpu",
        tensor_parallel=1,
        devices=(Device(host="localhost", gpu=0),),
        shard="weights",
    )
    pipes = (
        Pipeline(num_microbatches=3, stages=(whole,)),
        Pipeline(
            num_microbatches=1, stages=(replace(whole, devices=(Device(host="localhost", gpu=1),)),)
        ),
    )
    sharded = replace(plan, tensor_parallel=1, pipelines=pipes)
    medians = {"fwd_ms": 30.0, "bwd_ms": 60.0, "p2p_ms": 0.0, "sync_ms": 0.0}
    medians |= {"optimizer_ms": 1.0, "step_ms": 95.0, "steps": 4.0}
    ranks = [
        {"rank": p, "pipeline": p, "stage": 0, "tp_rank": 0, "device": "cpu"}
        | {"peak_mem_bytes": 1 << 20, "medians": medians}
        for p in range(2)
    ]
    check = compare(sharded, {"plan": "t.v1", "ranks": ranks}, None)
    got = [(st["num_microbatches"], st["measured"]["fwd_ms"]) for st in check["stages"]]
    assert got == [(3, 10.0), (3, 10.0)]


@pytest.mark.parametrize("edit", ["no measured", "recompute 1.5", "layers text"])
def test_an_edited_check_is_refused_in_one_line(tmp_path: Path, edit: str) -> None:
    import json

    from autohet_cli.plan import write_plan
    from tests.cli import autohet

    plan = _plan()
    check = compare(plan, _report(plan, 3.0, mem_bytes=900 << 20, step_extra_ms=5.0), None)
    stage = check["stages"][0]
    if edit == "no measured":
        del stage["measured"]
    elif edit == "recompute 1.5":
        check["stages"].append(dict(stage, shard="weights", recompute=1.5, shard_link={
            "holders": 2, "gbps": 1.0, "nic_share": 1}))  # fmt: skip
    else:
        stage["layers"] = "all"
    run = tmp_path / "run"
    run.mkdir()
    (run / "prediction-check.json").write_text(json.dumps(check))
    _, plan_file = write_plan(plan, tmp_path / "plans")
    res = autohet(
        "profile", "calibrate", str(run), "--out", str(tmp_path / "p.yaml"),
        "--plan", str(plan_file), cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert "prediction-check.json: not a prediction check this autohet reads" in res.stderr
    assert not (tmp_path / "p.yaml").exists()
