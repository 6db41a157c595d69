"""Plans say which stage times rest on unmeasured profile entries, and
``plan --measured-only`` uses only measured ones (or says clearly why it cannot).

Profiles are cut from Sailor's measured OPT-350M profile so that only some
(GPU type, TP, micro-batch size) combinations of the small-mix cluster are
measured; the rest are analytic, or calibrated to a measurement of the same type.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path

import pytest

from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.errors import InfeasibleError
from autohet_cli.inputs import load_inputs, tables_for
from autohet_cli.models import get_model
from autohet_cli.plan import Device, Pipeline, Plan, Stage, load_plan, write_plan
from autohet_cli.planner.api import make_plan, training_for
from autohet_cli.planner.explain import explain_text, provenance, summary_json
from autohet_cli.profiling.schema import Profile, load_profile, save_profile
from tests.cli import autohet

ROOT = Path(__file__).resolve().parents[2]
SMALL = str(ROOT / "profiles" / "clusters" / "small-mix.yaml")
SAILOR = load_profile(ROOT / "profiles" / "sailor" / "OPT-350M.yaml")
MODEL = get_model("OPT-350M")
BATCH = 32
TRAINING = training_for(BATCH, MODEL.default_seq_len, "bf16", "adam")
# What the partial profile measures on small-mix: no V100-16 at all.
STAGE_ROW = re.compile(r"\s+\d+\s+\S+:\d")  # a row of a pipeline's stage table
MEASURED = {("A100-40", 1, 1), ("A100-40", 1, 2), ("RTX-3090", 1, 1), ("RTX-3090", 1, 2)}


def cut(keep: Collection[tuple[str, int, int]], path: Path) -> str:
    """Sailor's OPT-350M profile with only the ``keep`` combinations, written to ``path``."""
    entries = {
        k: e
        for k, e in SAILOR.entries.items()
        if (k.gpu_type, k.tensor_parallel, k.micro_batch_size) in keep
    }
    save_profile(Profile(devices=SAILOR.devices, entries=entries, meta=SAILOR.meta), path)
    return str(path)


def combos(plan: Plan) -> set[tuple[str, int, int]]:
    mbs = plan.training.micro_batch_size
    return {(s.gpu_type, s.tensor_parallel, mbs) for p in plan.pipelines for s in p.stages}


def hand_plan(profile: str | None) -> Plan:
    """One pipeline over the three GPU types at tp 1, micro-batch 1."""
    stages = tuple(
        Stage(
            layer_start=start,
            layer_end=end,
            gpu_type=gpu,
            tensor_parallel=1,
            devices=(Device(host=host, gpu=0),),
        )
        for start, end, gpu, host in (
            (0, 9, "A100-40", "a100-0"),
            (9, 18, "RTX-3090", "rtx3090-0"),
            (18, 26, "V100-16", "v100-0"),
        )
    )
    inputs: dict[str, dict[str, str]] = {"cluster": {"path": SMALL}, "model": {"name": MODEL.name}}
    if profile is not None:
        inputs["profile"] = {"path": profile}
    return Plan(
        name="honesty",
        version=0,
        model_name=MODEL.name,
        num_layers=MODEL.num_layers,
        training=replace(TRAINING, micro_batch_size=1),
        tensor_parallel=1,
        pipelines=(Pipeline(num_microbatches=BATCH, stages=stages),),
        inputs=inputs,
        architecture=MODEL,
    )


# --- marks: estimate and explain ----------------------------------------------------------


def test_estimate_marks_unmeasured_stages_in_text_and_json(tmp_path: Path) -> None:
    # A100-40 is measured only at mbs 2: at mbs 1 it is calibrated to that measurement.
    profile = cut({("A100-40", 1, 2), ("RTX-3090", 1, 1)}, tmp_path / "partial.yaml")
    _, path = write_plan(hand_plan(profile), tmp_path / "plans")
    res = autohet("estimate", str(path), cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert re.search(r"\bslow\s+source\b", text), text  # the column header
    rows = {line.split()[2]: line for line in text.splitlines() if STAGE_ROW.match(line)}
    assert rows["A100-40"].rstrip().endswith("calibrated from tp=1 mbs=2")
    assert rows["RTX-3090"].rstrip().endswith("sailor")
    assert rows["V100-16"].rstrip().endswith("analytic")
    assert (
        "Stages 2 of 3 rest on unmeasured entries (A100-40 tp1 mbs1: calibrated from tp=1 "
        "mbs=2; V100-16 tp1 mbs1: analytic): their times are estimates; profile them with "
        "`autohet profile run CLUSTER --model OPT-350M --tp 1 --micro-batch-sizes 1` or plan "
        "with --measured-only." in text
    )

    res = autohet("estimate", str(path), "--json", cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [s["source"] for s in out["stages"]] == ["calibrated", "sailor", "analytic"]
    assert out["stages"][0]["calibrated_from"] == {"tensor_parallel": 1, "micro_batch_size": 2}
    assert out["stages"][1]["calibrated_from"] is None
    assert out["stages"][2]["layer_start"] == 18 and out["stages"][2]["layer_end"] == 26
    assert out["unmeasured"] == [
        {
            "gpu_type": gpu,
            "tensor_parallel": 1,
            "micro_batch_size": 1,
            "source": source,
            "measured_precision": None,  # not measured in another precision either
        }
        for gpu, source in (("A100-40", "calibrated"), ("V100-16", "analytic"))
    ]


def test_a_fully_measured_plan_carries_no_marks() -> None:
    inp = load_inputs(SMALL, MODEL.name, [str(ROOT / "profiles" / "sailor" / "OPT-350M.yaml")])
    plan = hand_plan(None)
    tables = tables_for(inp, plan.training)
    ev = evaluate(plan.pipelines, inp.cluster, tables, 1)
    sources = provenance(plan, tables)
    text = explain_text(plan, ev, inp.cluster, solved_now=False, sources=sources)
    assert "source" not in text and "unmeasured" not in text and "analytic" not in text
    out = summary_json(plan, ev, inp.cluster, None, sources=sources)
    assert out["unmeasured"] == []
    assert {s["source"] for s in out["stages"]} == {"sailor"}


def test_without_any_profile_it_says_so_once() -> None:
    inp = load_inputs(SMALL, MODEL.name, [])
    plan = hand_plan(None)
    tables = tables_for(inp, plan.training)
    ev = evaluate(plan.pipelines, inp.cluster, tables, 1)
    sources = provenance(plan, tables)
    text = explain_text(plan, ev, inp.cluster, solved_now=False, sources=sources)
    assert text.count("no profile was given") == 1
    assert "analytic" in text and "source" not in text.split("Iteration")[0]  # no column
    assert "Stages" not in text  # not listed stage by stage
    out = summary_json(plan, ev, inp.cluster, None, sources=sources)
    assert {s["source"] for s in out["stages"]} == {"analytic"}
    assert len(out["unmeasured"]) == 3


def test_plan_explain_marks_calibrated_and_analytic_stages(tmp_path: Path) -> None:
    # Only V100-16 at tp 8 is measured, which small-mix cannot use: every stage is an
    # estimate, V100-16 ones calibrated to that measurement.
    profile = cut({("V100-16", 8, 1)}, tmp_path / "tp8.yaml")
    args = ["plan", "--cluster", SMALL, "--model", "OPT-350M", "--profile", profile]
    args += ["--global-batch-size", str(BATCH), "--time-limit", "1", "--out-dir", "out"]
    res = autohet(*args, "--explain", cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    plan = load_plan(tmp_path / "out" / "small-mix-OPT-350M.v1.yaml")
    n = sum(len(p.stages) for p in plan.pipelines)
    assert f"Stages {n} of {n} rest on unmeasured entries (" in res.stdout
    assert "or plan with --measured-only." in res.stdout
    labels = {
        line.split()[2]: line.rstrip() for line in res.stdout.splitlines() if STAGE_ROW.match(line)
    }
    assert labels
    for gpu, line in labels.items():
        want = "calibrated from tp=8 mbs=1" if gpu == "V100-16" else "analytic"
        assert line.endswith(want), line


# --- --measured-only ----------------------------------------------------------------------


def test_measured_only_uses_only_measured_combinations(tmp_path: Path) -> None:
    profile = cut(MEASURED, tmp_path / "partial.yaml")
    args = ["plan", "--cluster", SMALL, "--model", "OPT-350M", "--profile", profile]
    args += ["--global-batch-size", str(BATCH), "--time-limit", "2", "--out-dir", "out"]
    res = autohet(*args, "--measured-only", "--contingency", "--json", cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["unmeasured"] == []
    assert {s["source"] for s in out["stages"]} == {"sailor"}
    plan = load_plan(tmp_path / out["plan_path"])
    assert combos(plan) <= MEASURED
    assert any("--measured-only" in note for note in plan.notes)
    # V100-16 is measured nowhere: idle, and the reason says why.
    v100 = [x for x in plan.idle if x["host"] == "v100-0"]
    assert v100 and "--measured-only" in str(v100[0]["reason"])
    # Baselines over every GPU (V100-16 included) cannot be measured-only.
    assert plan.baselines["megatron"] is None and plan.baselines["whale"] is None
    # Contingency plans keep to measured combinations too.
    assert plan.contingency
    for lost in plan.contingency.values():
        if lost["feasible"]:
            mbs = lost["micro_batch_size"]
            used = {
                (s["gpu_type"], s["tensor_parallel"], mbs)
                for p in lost["pipelines"]
                for s in p["stages"]
            }
            assert used <= MEASURED, used


def _measured_only(profile: Profile | None) -> None:
    inp = replace(load_inputs(SMALL, MODEL.name, []), profile=profile)
    make_plan(
        name="honesty",
        cluster=inp.cluster,
        model=inp.model,
        tables=tables_for(inp, TRAINING),
        global_batch_size=BATCH,
        time_limit_s=2.0,
        measured_only=True,
    )


def test_measured_only_without_usable_measurements_fails_clearly() -> None:
    # Measured, but at a TP degree no host of small-mix offers.
    only_tp8 = {
        k: e for k, e in SAILOR.entries.items() if (k.gpu_type, k.tensor_parallel) == ("V100-16", 8)
    }
    with pytest.raises(InfeasibleError) as err:
        _measured_only(Profile(devices=SAILOR.devices, entries=only_tp8))
    msg = str(err.value)
    assert msg.startswith("--measured-only: the profile measures none of the combinations")
    assert "A100-40: none; V100-16: none; RTX-3090: none" in msg
    assert "autohet profile run CLUSTER --model OPT-350M --tp 1,2,4 --micro-batch-sizes " in msg
    assert "without --measured-only" in msg

    with pytest.raises(InfeasibleError, match="no profile was given"):
        _measured_only(None)


def test_measured_only_when_nothing_measured_fits_names_what_was_measured() -> None:
    # A100-40 at tp 1, mbs 1 is measured, but (as if) with 400 GB of activations per layer.
    entries = {
        k: replace(e, layers=tuple(replace(lt, act_bytes=4e11) for lt in e.layers))
        for k, e in SAILOR.entries.items()
        if (k.gpu_type, k.tensor_parallel, k.micro_batch_size) == ("A100-40", 1, 1)
    }
    with pytest.raises(InfeasibleError) as err:
        _measured_only(Profile(devices=SAILOR.devices, entries=entries))
    msg = str(err.value)
    assert "--measured-only: no plan for OPT-350M on small-mix fits using only measured" in msg
    assert "A100-40: tp1 mbs1; V100-16: none; RTX-3090: none" in msg
    assert "the search said: " in msg


def test_measured_only_error_reaches_the_user_without_traceback(tmp_path: Path) -> None:
    args = ["plan", "--cluster", SMALL, "--model", "OPT-350M", "--global-batch-size", "32"]
    res = autohet(*args, "--measured-only", "--out-dir", "out", cwd=tmp_path, timeout=120)
    assert res.returncode == 1
    assert "error: --measured-only: no profile was given" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()
