"""Predicted against measured step time and memory, before and after calibration.

For gpt-small and llama-tiny on the embedded localhost cluster (two CPU devices):
measure a profile with ``autohet profile run`` (TP 1 and 2, micro-batch 2), then
launch six plan shapes for 12 steps each with ``autohet launch`` (one device,
data parallel 2, uneven data-parallel shares, 2 stages even, 2 stages uneven,
TP 2), each predicted with that measured profile. Launch writes each run's
``prediction-check.json`` (medians of the steps after the first two). Then
``profiling.calibrate`` refits the profile from three of those runs (data
parallel 2 for TP 1 and TP 2 for TP 2: one per TP degree, as localhost's two
devices cannot hold both in one run; then 2 stages even, for the latency of a
stage-to-stage exchange) and every shape is predicted again.

Printed per shape: predicted and measured step (ms), the ratio predicted /
measured before and after calibration, and whether predicted memory covers the
measured peak on every stage. TP with stages needs four devices and is not run
here. CPU timings on a 2-core machine are noisy: the load is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autohet_cli.cluster import load_cluster
from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.defaults import resolve_cluster_path
from autohet_cli.models import get_model
from autohet_cli.plan import Device, Pipeline, Plan, Stage, write_plan
from autohet_cli.planner.api import with_predictions
from autohet_cli.profiling.calibrate import calibrate
from autohet_cli.profiling.schema import load_profile
from autohet_cli.settings import TrainingSettings
from benchmarks._common import machine, table

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"gpt-small": 128, "llama-tiny": 128}  # seq len
MBS, STEPS, BATCH = 2, 12, 16
# One run per TP degree (step cost, layer times, gradient-sync rate), then a pipelined
# one (the exchange latency, told apart from the step cost the first two measured).
CALIBRATE_FROM = ("data parallel 2", "TP 2", "2 stages even")
RUN = f"{os.getpid()}-{int(time.time())}"  # run directories on the host are never reused


def shapes(num_layers: int) -> dict[str, tuple[list[tuple[int, list[tuple[int, int]]]], int]]:
    L, half = num_layers, num_layers // 2
    return {
        "one device": ([(8, [(0, L)])], 1),
        "data parallel 2": ([(4, [(0, L)]), (4, [(0, L)])], 1),
        "uneven shares 3/5": ([(3, [(0, L)]), (5, [(0, L)])], 1),
        "2 stages even": ([(8, [(0, half), (half, L)])], 1),
        "2 stages uneven": ([(8, [(0, 3), (3, L)])], 1),
        "TP 2": ([(8, [(0, L)])], 2),
    }


def make_plan(name: str, model: str, seq: int, layout: list, tp: int) -> Plan:
    gpus = iter(range(8))
    spec = get_model(model)
    return Plan(
        name=name,
        version=1,
        model_name=model,
        num_layers=spec.num_layers,
        training=TrainingSettings(
            global_batch_size=BATCH, micro_batch_size=MBS, seq_len=seq, precision="fp32"
        ),
        tensor_parallel=tp,
        pipelines=tuple(
            Pipeline(
                num_microbatches=m,
                stages=tuple(
                    Stage(
                        layer_start=a,
                        layer_end=b,
                        gpu_type="cpu",
                        tensor_parallel=tp,
                        devices=tuple(Device(host="localhost", gpu=next(gpus)) for _ in range(tp)),
                    )
                    for a, b in stages
                ),
            )
            for m, stages in layout
        ),
        architecture=spec,
    )


def predict(plan: Plan, profile_path: Path | None, profile=None) -> Plan:
    cluster = load_cluster(resolve_cluster_path(None))
    prof = profile if profile is not None else load_profile(profile_path) if profile_path else None
    tables = CostTables(
        get_model(plan.model_name), prof, plan.training, gpu_specs=cluster.gpu_specs
    )
    return with_predictions(plan, evaluate(plan.pipelines, cluster, tables, MBS))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def autohet(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autohet_cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )


def run_model(model: str, seq: int, work: Path) -> list[list[object]]:
    prof = work / f"{model}-measured.yaml"
    res = autohet(
        "profile", "run", "localhost", "--model", model, "--tp", "1,2",
        "--micro-batch-sizes", str(MBS), "--seq-len", str(seq), "--out", str(prof), cwd=work,
    )  # fmt: skip
    if res.returncode != 0:
        raise SystemExit(f"profile run failed:\n{res.stdout}\n{res.stderr}")
    checks, plans = {}, {}
    for i, (shape, (layout, tp)) in enumerate(shapes(get_model(model).num_layers).items()):
        plan = predict(make_plan(f"{model}-s{i}", model, seq, layout, tp), prof)
        _, path = write_plan(plan, work / "plans")
        res = autohet(
            "launch", str(path), "--cluster", "localhost", "--steps", str(STEPS),
            "--checkpoint-every", "0", "--run-id", f"r{i}-{RUN}", cwd=work,
        )  # fmt: skip
        check_file = work / "runs" / f"{plan.name}.v1" / f"r{i}-{RUN}" / "prediction-check.json"
        if res.returncode != 0 or not check_file.is_file():
            raise SystemExit(f"launch of {shape} failed:\n{res.stdout[-3000:]}\n{res.stderr}")
        checks[shape] = json.loads(check_file.read_text())
        plans[shape] = plan
    refit = load_profile(prof)
    for shape in CALIBRATE_FROM:
        refit, _ = calibrate(
            refit, checks[shape], get_model(model), run_id=shape, global_batch_size=BATCH
        )
    rows = []
    for shape, check in checks.items():
        after = predict(plans[shape], None, profile=refit)
        measured = check["step"]["measured_ms"]
        before_ms = check["step"]["predicted_ms"]
        assert after.prediction is not None
        after_ms = after.prediction.iteration_time_s * 1e3
        mem_ok_before = not check["memory_under_predicted"]
        mem_ok_after = all(
            s.predicted is not None and s.predicted.mem_bytes >= st["measured"]["mem_bytes"]
            for st in check["stages"]
            for s in [after.pipelines[st["pipeline"]].stages[st["stage"]]]
        )
        rows.append(
            [
                f"{model}: {shape}",
                f"{before_ms:.1f}",
                f"{measured:.1f}",
                f"{before_ms / measured:.2f}",
                f"{after_ms:.1f}",
                f"{after_ms / measured:.2f}",
                "yes" if mem_ok_before else "NO",
                "yes" if mem_ok_after else "NO",
            ]
        )
    return rows


def main() -> None:
    print(__doc__.split("\n\n")[0])
    print(machine())
    rows = []
    with tempfile.TemporaryDirectory(prefix="autohet-bench-pred-") as tmp:
        for model, seq in MODELS.items():
            rows += run_model(model, seq, Path(tmp))
    print(
        table(
            [
                "plan",
                "pred ms",
                "measured ms",
                "pred/meas",
                "calibrated ms",
                "cal/meas",
                "mem ok",
                "mem ok (cal)",
            ],
            rows,
        )
    )
    print(machine())


if __name__ == "__main__":
    main()
