"""Predicted against measured step time and memory: probe, profile run, one calibration run.

For gpt-small and llama-tiny on the embedded localhost cluster (two CPU devices),
three profiles predict six plan shapes (one device, data parallel 2, uneven
data-parallel shares, 2 stages even, 2 stages uneven, TP 2), each launched for
12 steps with ``autohet launch`` (medians of the steps after the first two, from
each run's ``prediction-check.json``):

- probe: ``autohet profile run --no-runtime-runs`` (layers timed alone);
- profile run: ``autohet profile run`` as a user runs it, which after the probe
  runs the runtime for a few steps (data parallel 2, TP 2, two stages, at its own
  batch size) and refits the profile from those runs: "before calibration";
- calibrated: that profile refitted (``profiling.calibrate``) from the shape's own
  launched run: "after one calibration run".

Printed per shape: the measured step (ms), predicted / measured for each profile,
and whether predicted memory covers the measured peak on every stage. TP with
stages needs four devices: it runs on a four-device copy of localhost (four
processes on however many cores this machine has; on 2 cores, oversubscribed,
which the profile run's runs, filling the host, measure too). CPU timings on a
2-core machine are noisy: the load is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from autohet_cli.cluster import load_cluster
from autohet_cli.defaults import resolve_cluster_path
from autohet_cli.models import get_model
from autohet_cli.plan import Plan, write_plan
from autohet_cli.profiling.calibrate import calibrate
from autohet_cli.profiling.runshapes import Shape, predicted, shape_plan
from autohet_cli.profiling.schema import Profile, load_profile
from benchmarks._common import machine, table

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"gpt-small": 128, "llama-tiny": 128}  # seq len
MBS, STEPS, BATCH = 2, 12, 16
RUN = f"{os.getpid()}-{int(time.time())}"  # run directories on the host are never reused


def shapes(num_layers: int) -> dict[str, tuple[list, int]]:
    L, half = num_layers, num_layers // 2
    return {
        "one device": ([(8, [(0, L)])], 1),
        "data parallel 2": ([(4, [(0, L)]), (4, [(0, L)])], 1),
        "uneven shares 3/5": ([(3, [(0, L)]), (5, [(0, L)])], 1),
        "2 stages even": ([(8, [(0, half), (half, L)])], 1),
        "2 stages uneven": ([(8, [(0, 3), (3, L)])], 1),
        "TP 2": ([(8, [(0, L)])], 2),
    }


def four_device_shapes(num_layers: int) -> dict[str, tuple[list, int]]:
    """Shapes that need four devices, run on a four-device copy of localhost."""
    L, half = num_layers, num_layers // 2
    return {"TP 2 x 2 stages (4 devices)": ([(8, [(0, half), (half, L)])], 2)}


FOUR_DEVICES = """schema: autohet.cluster/v1
name: localhost-4
network: {inter_node_gbps: 100}
hosts:
  - {name: localhost, address: localhost, gpus: {type: cpu, count: 4}, spot: false}
"""


def make_plan(
    name: str,
    model: str,
    seq: int,
    layout: list,
    tp: int,
    cluster_file: str,
    *,
    precision: str = "fp32",
    recompute: bool = False,
) -> Plan:
    """The shape's plan on localhost's first devices, predicted from nothing yet (the
    product's own builder, ``runshapes.shape_plan``, as ``profile run`` uses it)."""
    shape = Shape(
        name=name,
        layout=tuple((m, tuple(stages)) for m, stages in layout),
        tp=tp,
        measures="",
    )
    host = load_cluster(resolve_cluster_path(cluster_file)).host("localhost")
    plan = shape_plan(shape, get_model(model), host, mbs=MBS, seq_len=seq, precision=precision)
    assert plan.training.global_batch_size == BATCH, name
    if recompute:
        plan = replace(
            plan,
            pipelines=tuple(
                replace(p, stages=tuple(replace(s, recompute=True) for s in p.stages))
                for p in plan.pipelines
            ),
        )
    return replace(plan, name=name)


def predict(plan: Plan, profile_path: Path | None, profile=None, cluster_file=None) -> Plan:
    cluster = load_cluster(resolve_cluster_path(cluster_file))
    prof = profile if profile is not None else load_profile(profile_path) if profile_path else None
    return predicted(plan, cluster, prof or Profile(), get_model(plan.model_name))


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def autohet(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autohet_cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )


def profile(
    model: str, seq: int, work: Path, out: Path, *extra: str, cluster: str, tp: str = "1,2"
) -> Path:
    res = autohet(
        "profile", "run", cluster, "--model", model, "--tp", tp,
        "--micro-batch-sizes", str(MBS), "--seq-len", str(seq), "--out", str(out), *extra,
        cwd=work,
    )  # fmt: skip
    if res.returncode != 0:
        raise SystemExit(f"profile run failed:\n{res.stdout}\n{res.stderr}")
    return out


def _mem_ok(plan: Plan, check: dict) -> bool:
    return all(
        s.predicted is not None and s.predicted.mem_bytes >= st["measured"]["mem_bytes"]
        for st in check["stages"]
        for s in [plan.pipelines[st["pipeline"]].stages[st["stage"]]]
    )


def _mem_ratio(plan: Plan, check: dict) -> str:
    """Predicted over measured peak memory, on the stage where it is lowest."""
    ratios = [
        s.predicted.mem_bytes / st["measured"]["mem_bytes"]
        for st in check["stages"]
        for s in [plan.pipelines[st["pipeline"]].stages[st["stage"]]]
        if s.predicted is not None and st["measured"]["mem_bytes"]
    ]
    return f"{min(ratios):.2f}" if ratios else "-"


HEADERS = [
    "plan",
    "measured ms",
    "probe/meas",
    "profile run/meas",
    "calibrated/meas",
    "mem ok (probe)",
    "mem ok (profile run)",
    "mem ok (calibrated)",
    "mem pred/meas (profile run)",
]


def _step_ms(plan: Plan) -> float:
    assert plan.prediction is not None
    return plan.prediction.iteration_time_s * 1e3


Shapes = dict[str, tuple[list, int]]  # name: (layout, tp); a name ending "recompute" recomputes


def run_model(
    model: str,
    seq: int,
    work: Path,
    cluster: str = "localhost",
    *,
    which: Shapes | None = None,
    precision: str = "fp32",
    tp: str = "1,2",
) -> list[list[object]]:
    tag = Path(cluster).stem
    probe = profile(
        model, seq, work, work / f"{model}-{tag}-probe.yaml", "--no-runtime-runs",
        cluster=cluster, tp=tp,
    )  # fmt: skip
    prof = profile(model, seq, work, work / f"{model}-{tag}.yaml", cluster=cluster, tp=tp)
    if which is None:
        which = (shapes if cluster == "localhost" else four_device_shapes)(
            get_model(model).num_layers
        )
    rows = []
    for j, (shape, (layout, tp_deg)) in enumerate(which.items()):
        i = f"{tag}-{j}"
        shaped = make_plan(
            f"{model}-s{i}", model, seq, layout, tp_deg, cluster,
            precision=precision, recompute=shape.endswith("recompute"),
        )  # fmt: skip
        plan = predict(shaped, prof, None, cluster)
        _, path = write_plan(plan, work / "plans")
        res = autohet(
            "launch", str(path), "--cluster", cluster, "--steps", str(STEPS),
            "--checkpoint-every", "0", "--run-id", f"r{i}-{RUN}", cwd=work,
        )  # fmt: skip
        check_file = work / "runs" / f"{plan.name}.v1" / f"r{i}-{RUN}" / "prediction-check.json"
        if res.returncode != 0 or not check_file.is_file():
            raise SystemExit(f"launch of {shape} failed:\n{res.stdout[-3000:]}\n{res.stderr}")
        check = json.loads(check_file.read_text())
        refit, _ = calibrate(
            load_profile(prof), check, get_model(model), run_id=shape, global_batch_size=BATCH
        )
        by_probe = predict(plan, probe, None, cluster)
        after = predict(plan, None, refit, cluster)
        measured = check["step"]["measured_ms"]
        rows.append(
            [
                f"{model}: {shape}",
                f"{measured:.1f}",
                f"{_step_ms(by_probe) / measured:.2f}",
                f"{_step_ms(plan) / measured:.2f}",
                f"{_step_ms(after) / measured:.2f}",
                "yes" if _mem_ok(by_probe, check) else "NO",
                "yes" if not check["memory_under_predicted"] else "NO",
                "yes" if _mem_ok(after, check) else "NO",
                _mem_ratio(plan, check),
            ]
        )
    return rows


def main() -> None:
    print(__doc__.split("\n\n")[0])
    print(machine())
    rows = []
    with tempfile.TemporaryDirectory(prefix="autohet-bench-pred-") as tmp:
        four = Path(tmp) / "localhost-4.yaml"
        four.write_text(FOUR_DEVICES)
        for model, seq in MODELS.items():
            rows += run_model(model, seq, Path(tmp))
            # 4 processes on this machine's 2 cores: oversubscribed, and measured so
            rows += run_model(model, seq, Path(tmp), str(four))
    print(table(HEADERS, rows))
    print(machine())


if __name__ == "__main__":
    main()
