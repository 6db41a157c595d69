"""The plan artifact: round trip, validation naming the field, cluster checks, versioned writes."""

from __future__ import annotations

import copy
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from autohet_cli.cluster import load_cluster
from autohet_cli.errors import AutohetError, ConfigError, PlanError
from autohet_cli.plan import (
    SCHEMA,
    Device,
    Pipeline,
    Plan,
    Prediction,
    SolverInfo,
    Stage,
    StagePrediction,
    check_against_cluster,
    load_plan,
    plan_from_dict,
    plan_to_dict,
    validate_name,
    write_plan,
)
from autohet_cli.settings import TrainingSettings
from autohet_cli.yamlio import dump_yaml, write_new
from tests.cli import ROOT

WHERE = "p.yaml"


def tp_stage(start: int, end: int, gpu_type: str, host: str, *gpus: int, **kw: Any) -> Stage:
    return Stage(
        layer_start=start,
        layer_end=end,
        gpu_type=gpu_type,
        tensor_parallel=len(gpus),
        devices=tuple(Device(host=host, gpu=g) for g in gpus),
        **kw,
    )


def make_plan(name: str = "lab-mix", version: int = 1) -> Plan:
    """A valid plan for small-mix (2x A100-40, 2x V100-16, 4x RTX-3090), everything filled in."""
    predicted = StagePrediction(
        fwd_ms=1.5, bwd_ms=3.0, update_ms=0.25, mem_bytes=123_456_789, mem_fraction=0.5
    )
    return Plan(
        name=name,
        version=version,
        model_name="gpt-tiny",
        num_layers=6,
        training=TrainingSettings(
            global_batch_size=16, micro_batch_size=2, seq_len=64, precision="fp16", optimizer="sgd"
        ),
        tensor_parallel=2,
        pipelines=(
            Pipeline(
                num_microbatches=5,
                stages=(tp_stage(0, 6, "A100-40", "a100-0", 0, 1, predicted=predicted),),
            ),
            Pipeline(
                num_microbatches=3,
                stages=(
                    tp_stage(0, 4, "RTX-3090", "rtx3090-0", 0, 1),
                    tp_stage(4, 6, "RTX-3090", "rtx3090-0", 2, 3, predicted=predicted),
                ),
            ),
        ),
        inputs={
            "cluster": {"path": "profiles/clusters/small-mix.yaml", "sha256": "ab" * 32},
            "profile": {"path": "profiles/sailor/OPT-350M.yaml", "sha256": "cd" * 32},
        },
        prediction=Prediction(
            iteration_time_s=2.16,
            tokens_per_s=60700.5,
            memory_peak_fraction=0.83,
            pipeline_time_s=1.9,
            grad_sync_time_s=0.2,
            optimizer_time_s=0.06,
            closed_form_time_s=2.31,
        ),
        solver=SolverInfo(
            status="optimal",
            gap=0.001,
            time_s=3.5,
            objective="time",
            groupings_explored=12,
            groupings_pruned=7,
        ),
        baselines={"megatron-homogeneous": 3.125, "even-split": None},
        idle=({"host": "v100-0", "gpus": [0, 1], "reason": "no memory for any stage"},),
        notes=("V100s idle: a stage would not fit", "second note"),
        parent="lab-mix.v0",
        created="2026-01-02T03:04:05+00:00",
        contingency={"rtx3090-0": {"plan": "lab-mix-minus-rtx.v1", "iteration_time_s": 4.2}},
    )


def small_mix_hosts() -> dict[str, tuple[str, int]]:
    cluster = load_cluster(ROOT / "profiles" / "clusters" / "small-mix.yaml")
    return {h.name: (h.gpu_type, h.num_gpus) for h in cluster.hosts}


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


# --- round trip -----------------------------------------------------------------------------


def test_to_dict_from_dict_round_trip() -> None:
    plan = make_plan()
    d = plan_to_dict(plan)
    assert d["schema"] == SCHEMA
    assert d["pipelines"][1]["stages"][1]["layers"] == [4, 6]
    assert d["pipelines"][1]["stages"][1]["devices"] == [
        {"host": "rtx3090-0", "gpu": 2},
        {"host": "rtx3090-0", "gpu": 3},
    ]
    back = plan_from_dict(d, WHERE)
    assert back == plan
    assert plan_to_dict(back) == d


def test_round_trip_through_yaml_text() -> None:
    plan = make_plan()
    text = dump_yaml(plan_to_dict(plan))
    assert text == dump_yaml(plan_to_dict(plan))  # deterministic
    assert plan_from_dict(yaml.safe_load(text), WHERE) == plan


def test_minimal_plan_round_trips_with_defaults() -> None:
    plan = Plan(
        name="one",
        version=3,
        model_name="gpt-tiny",
        num_layers=6,
        training=TrainingSettings(global_batch_size=4, micro_batch_size=1, seq_len=64),
        tensor_parallel=1,
        pipelines=(Pipeline(num_microbatches=4, stages=(tp_stage(0, 6, "cpu", "localhost", 0),)),),
    )
    d = plan_to_dict(plan)
    assert "prediction" not in d and "solver" not in d and "contingency" not in d
    assert plan_from_dict(d, WHERE) == plan


def test_hand_written_stage_may_omit_tensor_parallel() -> None:
    d = plan_to_dict(make_plan())
    del d["pipelines"][0]["stages"][0]["tensor_parallel"]
    assert plan_from_dict(d, WHERE) == make_plan()


# --- validation names the field -------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    """``_set("pipelines.1.stages.0.layers", [1, 4])`` sets that entry of a plan dict."""

    def mutate(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = d
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        node[int(last) if last.isdigit() else last] = value

    return mutate


def _dev(host: str, gpu: Any) -> dict[str, Any]:
    return {"host": host, "gpu": gpu}


INVALID: dict[str, tuple[Mutation, str]] = {
    "first stage does not start at 0": (
        _set("pipelines.1.stages.0.layers", [1, 4]),
        "p.yaml: pipelines[1].stages[0].layers: [1, 4) must start at 0",
    ),
    "gap between stages": (
        _set("pipelines.1.stages.1.layers", [5, 6]),
        "p.yaml: pipelines[1].stages[1].layers: [5, 6) must start at 4",
    ),
    "overlapping stages": (
        _set("pipelines.1.stages.1.layers", [3, 6]),
        "p.yaml: pipelines[1].stages[1].layers: [3, 6) must start at 4",
    ),
    "empty stage": (
        _set("pipelines.1.stages.1.layers", [4, 4]),
        "p.yaml: pipelines[1].stages[1].layers: [4, 4) must start at 4 and be non-empty",
    ),
    "layers stop short of the model": (
        _set("pipelines.1.stages.1.layers", [4, 5]),
        "p.yaml: pipelines[1].stages: layers end at 5 but the model has 6 layers",
    ),
    "layers run past the model": (
        _set("pipelines.0.stages.0.layers", [0, 7]),
        "p.yaml: pipelines[0].stages: layers end at 7 but the model has 6 layers",
    ),
    "model has more layers than covered": (
        _set("model.num_layers", 8),
        "p.yaml: pipelines[0].stages: layers end at 6 but the model has 8 layers",
    ),
    "layers is not a pair": (
        _set("pipelines.1.stages.0.layers", [0, 2, 4]),
        "p.yaml: pipelines[1].stages[0].layers: expected [start, end)",
    ),
    "device used by two pipelines": (
        _set("pipelines.1.stages.0.devices", [_dev("a100-0", 1), _dev("a100-0", 2)]),
        "p.yaml: pipelines[1].stages[0].devices: a100-0 gpu 1 is already used by "
        "p.yaml: pipelines[0].stages[0]",
    ),
    "device used twice in one stage": (
        _set("pipelines.1.stages.1.devices", [_dev("rtx3090-0", 2), _dev("rtx3090-0", 2)]),
        "p.yaml: pipelines[1].stages[1].devices: rtx3090-0 gpu 2 is already used by "
        "p.yaml: pipelines[1].stages[1]",
    ),
    "fewer devices than the TP degree": (
        _set("pipelines.0.stages.0.devices", [_dev("a100-0", 0)]),
        "p.yaml: pipelines[0].stages[0].devices: 1 devices for tensor_parallel 2",
    ),
    "more devices than the TP degree": (
        _set("pipelines.0.stages.0.devices", [_dev("a100-0", 0), _dev("a100-0", 1), _dev("a", 5)]),
        "p.yaml: pipelines[0].stages[0].devices: 3 devices for tensor_parallel 2",
    ),
    "TP group spanning hosts": (
        _set("pipelines.1.stages.1.devices", [_dev("rtx3090-0", 2), _dev("v100-0", 0)]),
        "p.yaml: pipelines[1].stages[1].devices: a TP group must sit on one host",
    ),
    "negative GPU index": (
        _set("pipelines.1.stages.1.devices", [_dev("rtx3090-0", -1), _dev("rtx3090-0", 3)]),
        "p.yaml: pipelines[1].stages[1].devices: gpu index must be >= 0",
    ),
    "stage TP disagrees with its devices": (
        _set("pipelines.1.stages.1.tensor_parallel", 1),
        "p.yaml: pipelines[1].stages[1].devices: 2 devices for tensor_parallel 1",
    ),
    "stage TP above the plan's": (
        _set("pipelines.1.stages.1.tensor_parallel", 4),
        "p.yaml: pipelines[1].stages[1].tensor_parallel: must be 1 to the plan's "
        "tensor_parallel 2 (the largest stage's), got 4",
    ),
    "plan TP is not the largest stage's": (
        _set("tensor_parallel", 4),
        "p.yaml: tensor_parallel: 4, but the largest stage tensor_parallel is 2",
    ),
    "stage TP of zero": (
        _set("pipelines.0.stages.0.tensor_parallel", 0),
        "p.yaml: pipelines[0].stages[0].tensor_parallel: must be 1 to the plan's",
    ),
    "micro-batches do not sum to the global batch": (
        _set("pipelines.0.num_microbatches", 4),
        "p.yaml: pipelines[*].num_microbatches sum to 7 x micro_batch_size 2 = 14, but "
        "training.global_batch_size is 16",
    ),
    "global batch not a multiple of the micro-batch": (
        _set("training.global_batch_size", 15),
        "p.yaml: training.global_batch_size 15 is not a multiple of micro_batch_size 2",
    ),
    "pipeline without micro-batches": (
        _set("pipelines.0.num_microbatches", 0),
        "p.yaml: pipelines[*].num_microbatches sum to 3",
    ),
    "pipeline without stages": (
        _set("pipelines.0.stages", []),
        "p.yaml: pipelines[0].stages: a pipeline needs at least one stage",
    ),
    "no pipelines": (
        _set("pipelines", []),
        "p.yaml: pipelines: a plan needs at least one pipeline",
    ),
    "wrong schema": (
        _set("schema", "autohet.plan/v2"),
        "p.yaml: schema: expected 'autohet.plan/v1', got 'autohet.plan/v2'",
    ),
    "not an integer": (
        _set("pipelines.0.num_microbatches", "five"),
        "p.yaml: pipelines[0].num_microbatches: expected an integer",
    ),
    "device GPU not an integer": (
        _set("pipelines.0.stages.0.devices", [_dev("a100-0", "0"), _dev("a100-0", 1)]),
        "p.yaml: pipelines[0].stages[0].devices[0].gpu: expected an integer",
    ),
    "bad training setting": (
        _set("training.precision", "int8"),
        "p.yaml: training.precision: expected one of bf16, fp16, fp32",
    ),
    "prediction not a number": (
        _set("prediction.iteration_time_s", "fast"),
        "p.yaml: prediction.iteration_time_s: expected a number",
    ),
    "pipelines not a list": (
        _set("pipelines", {"stages": []}),
        "p.yaml: pipelines: expected a list",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_plans_name_the_field(case: str) -> None:
    mutate, message = INVALID[case]
    d = copy.deepcopy(plan_to_dict(make_plan()))
    mutate(d)
    with pytest.raises(AutohetError, match=re.escape(message)):
        plan_from_dict(d, WHERE)


def test_a_pipeline_without_microbatches_is_named() -> None:
    # a pipeline with 0 micro-batches whose share another pipeline took: the count is named
    d = plan_to_dict(make_plan())
    d["pipelines"][0]["num_microbatches"] = 0
    d["pipelines"][1]["num_microbatches"] = 8
    with pytest.raises(PlanError, match=re.escape("p.yaml: pipelines[0].num_microbatches")):
        plan_from_dict(d, WHERE)


UNKNOWN_AT: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], str]] = {
    "top": (lambda d: d, "p.yaml"),
    "model": (lambda d: d["model"], "p.yaml: model"),
    "training": (lambda d: d["training"], "p.yaml: training"),
    "pipeline": (lambda d: d["pipelines"][1], "p.yaml: pipelines[1]"),
    "stage": (lambda d: d["pipelines"][1]["stages"][1], "p.yaml: pipelines[1].stages[1]"),
    "device": (
        lambda d: d["pipelines"][1]["stages"][1]["devices"][1],
        "p.yaml: pipelines[1].stages[1].devices[1]",
    ),
    "stage prediction": (
        lambda d: d["pipelines"][0]["stages"][0]["predicted"],
        "p.yaml: pipelines[0].stages[0].predicted",
    ),
    "prediction": (lambda d: d["prediction"], "p.yaml: prediction"),
    "solver": (lambda d: d["solver"], "p.yaml: solver"),
}


@pytest.mark.parametrize("level", sorted(UNKNOWN_AT))
def test_unknown_keys_are_rejected_at_every_level(level: str) -> None:
    pick, where = UNKNOWN_AT[level]
    d = copy.deepcopy(plan_to_dict(make_plan()))
    pick(d)["cuont"] = 1
    with pytest.raises(ConfigError, match=re.escape(f"{where}: unknown key 'cuont'")):
        plan_from_dict(d, WHERE)


@pytest.mark.parametrize(
    ("path", "where"),
    [
        ("", "p.yaml: missing required key 'pipelines'"),
        ("model", "p.yaml: model: missing required key 'num_layers'"),
        ("pipelines.0", "p.yaml: pipelines[0]: missing required key 'stages'"),
        ("pipelines.0.stages.0", "p.yaml: pipelines[0].stages[0]: missing required key 'devices'"),
    ],
)
def test_missing_required_keys_are_named(path: str, where: str) -> None:
    d = copy.deepcopy(plan_to_dict(make_plan()))
    node: Any = d
    for key in filter(None, path.split(".")):
        node = node[int(key)] if key.isdigit() else node[key]
    last = re.search(r"'(\w+)'$", where)
    assert last is not None
    del node[last.group(1)]
    with pytest.raises(ConfigError, match=re.escape(where)):
        plan_from_dict(d, WHERE)


def test_a_non_numeric_baseline_is_named() -> None:
    d = plan_to_dict(make_plan())
    d["baselines"]["megatron-homogeneous"] = "n/a"
    with pytest.raises(ConfigError, match=re.escape("baselines.megatron-homogeneous")):
        plan_from_dict(d, WHERE)


def test_a_pipeline_level_predicted_key_is_not_silently_dropped() -> None:
    d = plan_to_dict(make_plan())
    d["pipelines"][0]["predicted"] = {"time_ms": 12.0}
    try:
        plan = plan_from_dict(d, WHERE)
    except ConfigError as exc:
        assert "p.yaml: pipelines[0]" in str(exc)
    else:
        assert plan_to_dict(plan)["pipelines"][0].get("predicted") == {"time_ms": 12.0}


# --- against a cluster ----------------------------------------------------------------------


def test_check_against_cluster_accepts_a_matching_plan() -> None:
    check_against_cluster(make_plan(), small_mix_hosts(), "small-mix.yaml")


def _with_stage(plan: Plan, pipeline: int, index: int, new: Stage) -> Plan:
    stages = list(plan.pipelines[pipeline].stages)
    stages[index] = new
    pipelines = list(plan.pipelines)
    pipelines[pipeline] = replace(pipelines[pipeline], stages=tuple(stages))
    return replace(plan, pipelines=tuple(pipelines))


@pytest.mark.parametrize(
    ("new", "message"),
    [
        (
            tp_stage(4, 6, "RTX-3090", "rtx3090-9", 2, 3),
            "small-mix.yaml: pipelines[1].stages[1].devices: host 'rtx3090-9' is not in "
            "the cluster",
        ),
        (
            tp_stage(4, 6, "RTX-3090", "rtx3090-0", 3, 4),
            "small-mix.yaml: pipelines[1].stages[1].devices: rtx3090-0 has 4 GPUs, no gpu 4",
        ),
        (
            tp_stage(4, 6, "V100-16", "rtx3090-0", 2, 3),
            "small-mix.yaml: pipelines[1].stages[1].devices: stage says V100-16 but "
            "rtx3090-0 has RTX-3090 GPUs",
        ),
    ],
)
def test_check_against_cluster_names_the_mismatch(new: Stage, message: str) -> None:
    plan = _with_stage(make_plan(), 1, 1, new)
    plan.validate()  # valid on its own: only the cluster can tell
    with pytest.raises(PlanError, match=re.escape(message)):
        check_against_cluster(plan, small_mix_hosts(), "small-mix.yaml")


# --- versioned writes -----------------------------------------------------------------------


def test_write_plan_numbers_versions_and_never_overwrites(tmp_path: Path) -> None:
    plan = make_plan(version=41)
    first, p1 = write_plan(plan, tmp_path)
    second, p2 = write_plan(plan, tmp_path)
    assert (first.version, p1.name) == (1, "lab-mix.v1.yaml")
    assert (second.version, p2.name) == (2, "lab-mix.v2.yaml")
    before = {p: p.read_bytes() for p in (p1, p2)}

    hand = tmp_path / "lab-mix.v3.yaml"
    hand.write_text("# written by hand\n", encoding="utf-8")
    third, p3 = write_plan(plan, tmp_path)
    assert (third.version, p3.name) == (4, "lab-mix.v4.yaml")
    assert hand.read_text(encoding="utf-8") == "# written by hand\n"
    assert {p: p.read_bytes() for p in (p1, p2)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "lab-mix.v1.yaml",
        "lab-mix.v2.yaml",
        "lab-mix.v3.yaml",
        "lab-mix.v4.yaml",
    ]


def test_write_plan_skips_gaps_and_other_names(tmp_path: Path) -> None:
    for name in ("lab-mix.v7.yaml", "lab-mix-2.v9.yaml", "lab.v5.yaml", "lab-mix.v8.yaml.tmp"):
        (tmp_path / name).write_text("x\n", encoding="utf-8")
    assert write_plan(make_plan("lab-mix"), tmp_path)[1].name == "lab-mix.v8.yaml"
    assert write_plan(make_plan("lab"), tmp_path)[1].name == "lab.v6.yaml"
    assert write_plan(make_plan("lab-mix-2"), tmp_path)[1].name == "lab-mix-2.v10.yaml"
    assert write_plan(make_plan("fresh"), tmp_path / "new" / "dir")[1].name == "fresh.v1.yaml"


def test_written_plan_loads_back_equal(tmp_path: Path) -> None:
    plan = make_plan(version=9)
    written, path = write_plan(plan, tmp_path)
    assert written == replace(plan, version=1)
    loaded = load_plan(path)
    assert loaded == written
    assert replace(loaded, version=plan.version) == plan


def test_written_plan_is_readable_by_others(tmp_path: Path, umask_022: None) -> None:
    _, path = write_plan(make_plan(), tmp_path)
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode != 0o600
    assert mode == 0o644


@pytest.mark.parametrize(
    "name", ["", "../evil", "a/b", "lab.v2", "lab.v", ".hidden", "has space", "-dash", "x\n"]
)
def test_write_plan_rejects_bad_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="plan name"):
        validate_name(name)
    with pytest.raises(ConfigError, match="plan name"):
        write_plan(make_plan(name), tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["lab-mix", "opt_350m", "run.3", "A100x8"])
def test_validate_name_accepts_plain_names(name: str) -> None:
    assert validate_name(name) == name


def test_write_plan_refuses_an_invalid_plan(tmp_path: Path) -> None:
    plan = make_plan()
    bad = replace(plan, pipelines=(replace(plan.pipelines[0], num_microbatches=1),))
    with pytest.raises(PlanError, match="global_batch_size"):
        write_plan(bad, tmp_path)
    assert list(tmp_path.iterdir()) == []


# --- yamlio.write_new -----------------------------------------------------------------------


def test_write_new_creates_the_file_and_its_folders(tmp_path: Path, umask_022: None) -> None:
    target = tmp_path / "a" / "b" / "x.yaml"
    assert write_new(target, "k: 1\n") == target
    assert target.read_text(encoding="utf-8") == "k: 1\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert os.listdir(target.parent) == ["x.yaml"]


def test_write_new_refuses_to_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "x.yaml"
    target.write_text("old\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="already exists"):
        write_new(target, "new\n")
    assert target.read_text(encoding="utf-8") == "old\n"
    assert os.listdir(tmp_path) == ["x.yaml"]  # no temp file left behind


def test_write_new_leaves_nothing_behind_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "x.yaml"
    with pytest.raises(UnicodeEncodeError):
        write_new(target, "lone surrogate \udcff\n")
    assert not target.exists()
    assert os.listdir(tmp_path) == []


# --- the plan carries its model ----------------------------------------------------------


def _tiny_llama_plan() -> Plan:
    from autohet_cli.hfconfig import load_hf_config

    tiny = load_hf_config(str(ROOT / "profiles" / "models" / "tiny-llama" / "config.json"))
    spec = replace(tiny, num_blocks=3)  # 6 layers, as make_plan's stages
    base = make_plan()
    return replace(base, model_name=spec.name, num_layers=spec.num_layers, architecture=spec)


def test_architecture_round_trips_through_yaml() -> None:
    plan = _tiny_llama_plan()
    d = plan_to_dict(plan)
    assert d["model"]["architecture"]["family"] == "llama"
    assert d["model"]["architecture"]["rope_scaling"]["kind"] == "llama3"
    back = plan_from_dict(yaml.safe_load(dump_yaml(d)), WHERE)
    assert back == plan and back.architecture == plan.architecture


def test_architecture_is_validated_strictly() -> None:
    d = plan_to_dict(_tiny_llama_plan())
    bad = copy.deepcopy(d)
    bad["model"]["architecture"]["num_kv_head"] = 2
    with pytest.raises(ConfigError, match=r"model.architecture: unknown key 'num_kv_head'"):
        plan_from_dict(bad, WHERE)
    bad = copy.deepcopy(d)
    bad["model"]["architecture"]["num_kv_heads"] = 3
    with pytest.raises(ConfigError, match=r"num_kv_heads: 3 must divide num_heads 4"):
        plan_from_dict(bad, WHERE)
    bad = copy.deepcopy(d)
    bad["model"]["architecture"]["rope_scaling"]["kind"] = "yarn"
    with pytest.raises(ConfigError, match=r"rope_scaling.kind: 'yarn'"):
        plan_from_dict(bad, WHERE)
    bad = copy.deepcopy(d)
    bad["model"]["num_layers"] = 7
    with pytest.raises(PlanError, match="architecture has 6 partitionable layers"):
        plan_from_dict(bad, WHERE)
