"""The plan artifact ``autohet.plan/v1``: schema, validation, versioned read/write (pure).

A plan says, for every data-parallel replica (pipeline), how many micro-batches
it takes and which devices hold which half-open layer range at which TP
degree. Each stage has its own TP degree (a V100 stage may need TP 2 where an
A100 stage runs alone); the plan-level ``tensor_parallel`` is the largest of
them, kept so that readers of plans written before per-stage degrees still find
the number they used. It is immutable once written as ``plans/<name>.v<N>.yaml``: a new plan
(a re-plan, a recovery) is a new version, and ``parent`` links it to the old.
Loading validates everything the launcher and runtime rely on, so a
hand-edited plan fails here with the field named, not later on a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autohet_cli.architecture import spec_from_dict, spec_to_dict
from autohet_cli.errors import ConfigError, PlanError
from autohet_cli.limits import MAX_BLOCKS, MAX_GPUS_PER_HOST, MAX_TENSOR_PARALLEL, at_most
from autohet_cli.models import ModelSpec
from autohet_cli.names import check_host_name
from autohet_cli.settings import TrainingSettings
from autohet_cli.yamlio import (
    as_list,
    as_mapping,
    check_keys,
    coerce,
    dump_yaml,
    load_yaml,
    write_new,
)
from autohet_cli.yamlio import field as get

SCHEMA = "autohet.plan/v1"


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    host: str
    gpu: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePrediction:
    fwd_ms: float
    bwd_ms: float
    update_ms: float
    mem_bytes: int
    mem_fraction: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    layer_start: int
    layer_end: int
    gpu_type: str
    tensor_parallel: int
    devices: tuple[Device, ...]
    predicted: StagePrediction | None = None
    # Full activation recomputation: the runtime wraps each layer of the stage in a
    # (non-reentrant) torch.utils.checkpoint, keeping only each layer's input per
    # micro-batch in flight and re-running the layer's forward before its backward.
    # Written to YAML only when true, so plans without it keep their bytes and digests.
    recompute: bool = False

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def host(self) -> str:
        return self.devices[0].host


@dataclass(frozen=True, slots=True, kw_only=True)
class Pipeline:
    num_microbatches: int
    stages: tuple[Stage, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    iteration_time_s: float
    tokens_per_s: float
    memory_peak_fraction: float
    pipeline_time_s: float
    grad_sync_time_s: float
    optimizer_time_s: float
    closed_form_time_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SolverInfo:
    status: str  # optimal | heuristic | time_limit | baseline
    gap: float  # SCIP's relative gap on the chosen grouping
    time_s: float
    objective: str = "time"
    search_gap: float = 0.0  # against a lower bound over all groupings
    groupings_explored: int = 0
    groupings_pruned: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    name: str
    version: int
    model_name: str
    num_layers: int
    training: TrainingSettings
    tensor_parallel: int
    pipelines: tuple[Pipeline, ...]
    inputs: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    prediction: Prediction | None = None
    solver: SolverInfo | None = None
    baselines: Mapping[str, float | None] = field(default_factory=dict)
    idle: tuple[Mapping[str, Any], ...] = ()
    notes: tuple[str, ...] = ()
    parent: str | None = None
    created: str = ""
    contingency: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # The model itself (``model.architecture``), so workers need no zoo or config.json;
    # None in plans written before plans carried it (workers look the name up).
    architecture: ModelSpec | None = None

    def devices(self) -> list[Device]:
        return [d for p in self.pipelines for s in p.stages for d in s.devices]

    def hosts(self) -> list[str]:
        return list(dict.fromkeys(d.host for d in self.devices()))

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        """The distinct stage TP degrees, ascending (one value: a uniform plan)."""
        return tuple(sorted({s.tensor_parallel for p in self.pipelines for s in p.stages}))

    def validate(self, where: str = "plan") -> None:
        """Every invariant the runtime relies on; errors name the field."""
        t = self.training
        try:  # the name picks folders (plans/, checkpoints, runs): never a path
            validate_name(self.name)
        except ConfigError as exc:
            raise PlanError(f"{where}: name: {exc}") from None
        if not 1 <= self.tensor_parallel <= MAX_TENSOR_PARALLEL:
            raise PlanError(
                f"{where}: tensor_parallel: must be 1 to {MAX_TENSOR_PARALLEL} (the GPUs of one "
                f"host), got {self.tensor_parallel}"
            )
        at_most(
            self.num_layers,
            MAX_BLOCKS + 3,
            f"{where}: model.num_layers",
            "no model has more blocks; 3 more: embedding, final norm, head",
        )
        if not self.pipelines:
            raise PlanError(f"{where}: pipelines: a plan needs at least one pipeline")
        arch = self.architecture
        if arch is not None and arch.num_layers != self.num_layers:
            raise PlanError(
                f"{where}: model.architecture has {arch.num_layers} partitionable layers "
                f"but model.num_layers is {self.num_layers}"
            )
        if t.global_batch_size % t.micro_batch_size:
            raise PlanError(
                f"{where}: training.global_batch_size {t.global_batch_size} is not a multiple "
                f"of micro_batch_size {t.micro_batch_size}"
            )
        total = sum(p.num_microbatches for p in self.pipelines)
        if total * t.micro_batch_size != t.global_batch_size:
            raise PlanError(
                f"{where}: pipelines[*].num_microbatches sum to {total} x micro_batch_size "
                f"{t.micro_batch_size} = {total * t.micro_batch_size}, but "
                f"training.global_batch_size is {t.global_batch_size}"
            )
        seen: dict[Device, str] = {}
        for i, p in enumerate(self.pipelines):
            _validate_pipeline(self, p, f"{where}: pipelines[{i}]", seen)
        largest = max(s.tensor_parallel for p in self.pipelines for s in p.stages)
        if largest != self.tensor_parallel:
            raise PlanError(
                f"{where}: tensor_parallel: {self.tensor_parallel}, but the largest stage "
                f"tensor_parallel is {largest}; the plan-level value must be the largest "
                "stage's (stages carry their own)"
            )


def _validate_pipeline(plan: Plan, p: Pipeline, at: str, seen: dict[Device, str]) -> None:
    if p.num_microbatches < 1:
        raise PlanError(f"{at}.num_microbatches: must be at least 1, got {p.num_microbatches}")
    if not p.stages:
        raise PlanError(f"{at}.stages: a pipeline needs at least one stage")
    expect = 0
    for j, s in enumerate(p.stages):
        sat = f"{at}.stages[{j}]"
        if s.layer_start != expect or s.layer_end <= s.layer_start:
            raise PlanError(
                f"{sat}.layers: [{s.layer_start}, {s.layer_end}) must start at {expect} and "
                "be non-empty: stages cover the model's layers in order, exactly once"
            )
        expect = s.layer_end
        if not 1 <= s.tensor_parallel <= plan.tensor_parallel:
            raise PlanError(
                f"{sat}.tensor_parallel: must be 1 to the plan's tensor_parallel "
                f"{plan.tensor_parallel} (the largest stage's), got {s.tensor_parallel}"
            )
        if len(s.devices) != s.tensor_parallel:
            raise PlanError(
                f"{sat}.devices: {len(s.devices)} devices for tensor_parallel {s.tensor_parallel}"
            )
        if len({d.host for d in s.devices}) != 1:
            raise PlanError(f"{sat}.devices: a TP group must sit on one host")
        for d in s.devices:
            check_host_name(d.host, f"{sat}.devices")
            if d.gpu < 0:
                raise PlanError(f"{sat}.devices: gpu index must be >= 0, got {d.gpu}")
            if d.gpu >= MAX_GPUS_PER_HOST:
                raise PlanError(f"{sat}.devices: gpu index {d.gpu}: no host has that many GPUs")
            if d in seen:
                raise PlanError(f"{sat}.devices: {d.host} gpu {d.gpu} is already used by {seen[d]}")
            seen[d] = sat
    if expect != plan.num_layers:
        raise PlanError(
            f"{at}.stages: layers end at {expect} but the model has {plan.num_layers} layers"
        )


def check_against_cluster(plan: Plan, hosts: Mapping[str, tuple[str, int]], where: str) -> None:
    """``hosts`` maps host name to (gpu_type, num_gpus) of the cluster."""
    for i, p in enumerate(plan.pipelines):
        for j, s in enumerate(p.stages):
            for d in s.devices:
                at = f"{where}: pipelines[{i}].stages[{j}].devices"
                if d.host not in hosts:
                    raise PlanError(f"{at}: host {d.host!r} is not in the cluster")
                gpu_type, count = hosts[d.host]
                if d.gpu >= count:
                    raise PlanError(f"{at}: {d.host} has {count} GPUs, no gpu {d.gpu}")
                if gpu_type != s.gpu_type:
                    raise PlanError(
                        f"{at}: stage says {s.gpu_type} but {d.host} has {gpu_type} GPUs"
                    )


# --------------------------------------------------------------------- to/from dict


def plan_to_dict(p: Plan) -> dict[str, Any]:
    t = p.training
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "name": p.name,
        "version": p.version,
        "created": p.created,
        "parent": p.parent,
        "inputs": {k: dict(v) for k, v in p.inputs.items()},
        "model": {"name": p.model_name, "num_layers": p.num_layers},
        "training": {
            "global_batch_size": t.global_batch_size,
            "micro_batch_size": t.micro_batch_size,
            "seq_len": t.seq_len,
            "precision": t.precision,
            "optimizer": t.optimizer,
            **({"zero1": True} if t.zero1 else {}),
        },
        "tensor_parallel": p.tensor_parallel,
        "pipelines": [pipelines_entry(pl) for pl in p.pipelines],
    }
    if p.architecture is not None:
        out["model"]["architecture"] = spec_to_dict(p.architecture)
    if p.prediction is not None:
        out["prediction"] = {k: _round(getattr(p.prediction, k)) for k in Prediction.__slots__}
    if p.solver is not None:
        out["solver"] = {k: _round(getattr(p.solver, k)) for k in SolverInfo.__slots__}
    out["baselines"] = {k: _round(v) for k, v in p.baselines.items()}
    out["idle"] = [dict(x) for x in p.idle]
    out["notes"] = list(p.notes)
    if p.contingency:
        out["contingency"] = {k: dict(v) for k, v in p.contingency.items()}
    return out


def pipelines_entry(pl: Pipeline) -> dict[str, Any]:
    return {"num_microbatches": pl.num_microbatches, "stages": [_stage_dict(s) for s in pl.stages]}


def _stage_dict(s: Stage) -> dict[str, Any]:
    d: dict[str, Any] = {
        "layers": [s.layer_start, s.layer_end],
        "gpu_type": s.gpu_type,
        "tensor_parallel": s.tensor_parallel,
        "devices": [{"host": x.host, "gpu": x.gpu} for x in s.devices],
    }
    if s.recompute:
        d["recompute"] = True
    if s.predicted is not None:
        d["predicted"] = {k: _round(getattr(s.predicted, k)) for k in StagePrediction.__slots__}
    return d


def _round(v: Any) -> Any:
    return round(v, 6) if isinstance(v, float) else v


def plan_from_dict(raw: Any, where: str) -> Plan:
    d = as_mapping(raw, where)
    check_keys(
        d,
        where,
        ["schema", "name", "version", "model", "training", "tensor_parallel", "pipelines"],
        [
            "created",
            "parent",
            "inputs",
            "prediction",
            "solver",
            "baselines",
            "idle",
            "notes",
            "contingency",
        ],
    )
    if d["schema"] != SCHEMA:
        raise ConfigError(f"{where}: schema: expected {SCHEMA!r}, got {d['schema']!r}")
    model = as_mapping(d["model"], f"{where}: model")
    check_keys(model, f"{where}: model", ["name", "num_layers"], ["architecture"])
    arch = model.get("architecture")
    tr = as_mapping(d["training"], f"{where}: training")
    tat = f"{where}: training"
    check_keys(
        tr,
        tat,
        ["global_batch_size", "micro_batch_size", "seq_len"],
        ["precision", "optimizer", "zero1"],
    )
    try:
        training = TrainingSettings(
            global_batch_size=get(tr, "global_batch_size", int, tat),
            micro_batch_size=get(tr, "micro_batch_size", int, tat),
            seq_len=get(tr, "seq_len", int, tat),
            precision=get(tr, "precision", str, tat, "bf16"),
            optimizer=get(tr, "optimizer", str, tat, "adam"),
            zero1=coerce(tr["zero1"], bool, f"{tat}.zero1") if "zero1" in tr else False,
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    pipelines = tuple(
        pipeline_from_dict(pv, f"{where}: pipelines[{i}]")
        for i, pv in enumerate(as_list(d["pipelines"], f"{where}: pipelines"))
    )
    inputs = as_mapping(d.get("inputs") or {}, f"{where}: inputs")
    baselines = as_mapping(d.get("baselines") or {}, f"{where}: baselines")
    plan = Plan(
        name=get(d, "name", str, where),
        version=get(d, "version", int, where),
        model_name=get(model, "name", str, f"{where}: model"),
        num_layers=get(model, "num_layers", int, f"{where}: model"),
        training=training,
        tensor_parallel=get(d, "tensor_parallel", int, where),
        pipelines=pipelines,
        inputs={
            str(k): {str(a): str(b) for a, b in as_mapping(v, f"{where}: inputs.{k}").items()}
            for k, v in inputs.items()
        },
        prediction=_prediction(d.get("prediction"), f"{where}: prediction"),
        solver=_solver(d.get("solver"), f"{where}: solver"),
        baselines={
            str(k): None if v is None else coerce(v, float, f"{where}: baselines.{k}")
            for k, v in baselines.items()
        },
        idle=tuple(as_mapping(x, f"{where}: idle") for x in as_list(d.get("idle") or [], where)),
        notes=tuple(str(x) for x in as_list(d.get("notes") or [], f"{where}: notes")),
        parent=get(d, "parent", str, where, None),
        created=get(d, "created", str, where, ""),
        contingency={
            str(k): as_mapping(v, f"{where}: contingency.{k}")
            for k, v in as_mapping(d.get("contingency") or {}, where).items()
        },
        architecture=None if arch is None else spec_from_dict(arch, f"{where}: model.architecture"),
    )
    if plan.version < 1:
        raise ConfigError(
            f"{where}: version: must be at least 1 (written plans start at v1), got {plan.version}"
        )
    plan.validate(where)
    return plan


def pipeline_from_dict(raw: Any, at: str) -> Pipeline:
    pm = as_mapping(raw, at)
    check_keys(pm, at, ["num_microbatches", "stages"])
    stages = []
    for j, sv in enumerate(as_list(pm["stages"], f"{at}.stages")):
        sat = f"{at}.stages[{j}]"
        sm = as_mapping(sv, sat)
        check_keys(
            sm,
            sat,
            ["layers", "gpu_type", "devices"],
            ["tensor_parallel", "predicted", "recompute"],
        )
        layers = as_list(sm["layers"], f"{sat}.layers")
        if len(layers) != 2:
            raise ConfigError(f"{sat}.layers: expected [start, end), got {layers}")
        devices = []
        for k, dv in enumerate(as_list(sm["devices"], f"{sat}.devices")):
            dat = f"{sat}.devices[{k}]"
            dm = as_mapping(dv, dat)
            check_keys(dm, dat, ["host", "gpu"])
            devices.append(Device(host=get(dm, "host", str, dat), gpu=get(dm, "gpu", int, dat)))
        stages.append(
            Stage(
                layer_start=get({"s": layers[0]}, "s", int, f"{sat}.layers[0]"),
                layer_end=get({"e": layers[1]}, "e", int, f"{sat}.layers[1]"),
                gpu_type=get(sm, "gpu_type", str, sat),
                tensor_parallel=get(sm, "tensor_parallel", int, sat, len(devices)),
                devices=tuple(devices),
                predicted=_stage_prediction(sm.get("predicted"), f"{sat}.predicted"),
                # Strict: true or false only (not null, 1 or "yes"), named in the error.
                recompute=coerce(sm["recompute"], bool, f"{sat}.recompute")
                if "recompute" in sm
                else False,
            )
        )
    return Pipeline(num_microbatches=get(pm, "num_microbatches", int, at), stages=tuple(stages))


def _stage_prediction(raw: Any, at: str) -> StagePrediction | None:
    if raw is None:
        return None
    m = as_mapping(raw, at)
    check_keys(m, at, StagePrediction.__slots__)
    return StagePrediction(
        fwd_ms=get(m, "fwd_ms", float, at),
        bwd_ms=get(m, "bwd_ms", float, at),
        update_ms=get(m, "update_ms", float, at),
        mem_bytes=get(m, "mem_bytes", int, at),
        mem_fraction=get(m, "mem_fraction", float, at),
    )


def _prediction(raw: Any, at: str) -> Prediction | None:
    if raw is None:
        return None
    m = as_mapping(raw, at)
    check_keys(m, at, Prediction.__slots__)
    return Prediction(**{k: get(m, k, float, at) for k in Prediction.__slots__})


def _solver(raw: Any, at: str) -> SolverInfo | None:
    if raw is None:
        return None
    m = as_mapping(raw, at)
    check_keys(
        m,
        at,
        ["status", "gap", "time_s"],
        ["objective", "search_gap", "groupings_explored", "groupings_pruned"],
    )
    return SolverInfo(
        status=get(m, "status", str, at),
        gap=get(m, "gap", float, at),
        time_s=get(m, "time_s", float, at),
        objective=get(m, "objective", str, at, "time"),
        search_gap=get(m, "search_gap", float, at, 0.0),
        groupings_explored=get(m, "groupings_explored", int, at, 0),
        groupings_pruned=get(m, "groupings_pruned", int, at, 0),
    )


# --------------------------------------------------------------------- files

_VERSIONED = re.compile(r"^(?P<name>.+)\.v(?P<version>\d+)\.yaml$")


def load_plan(path: str | Path) -> Plan:
    return plan_from_dict(load_yaml(path), str(path))


def next_version(directory: Path, name: str) -> int:
    versions = [
        int(m.group("version"))
        for f in directory.glob(f"{name}.v*.yaml")
        if (m := _VERSIONED.match(f.name)) and m.group("name") == name
    ]
    return max(versions, default=0) + 1


def validate_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or ".v" in name:
        raise ConfigError(
            f"plan name {name!r}: use letters, digits, '-', '_' and '.' (no '.v', which "
            "marks versions)"
        )
    return name


def default_plan_name(cluster_name: str, model_name: str) -> str:
    """``<cluster>-<model>``, made a valid plan name: without the model, plans of
    different models on one cluster became versions of one plan (v1..v4), and a
    version is meant to be a re-plan of the same job."""
    raw = f"{cluster_name}-{model_name}"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", raw).replace(".v", "-v").strip("-_.")
    return validate_name(re.sub(r"-{2,}", "-", name) or "plan")


def write_plan(plan: Plan, directory: str | Path) -> tuple[Plan, Path]:
    """Write ``plan`` as the next free version; never overwrites, safe against races."""
    from dataclasses import replace

    folder = Path(directory)
    validate_name(plan.name)
    plan.validate()
    for _ in range(100):
        versioned = replace(plan, version=next_version(folder, plan.name))
        target = folder / f"{plan.name}.v{versioned.version}.yaml"
        try:
            return versioned, write_new(target, dump_yaml(plan_to_dict(versioned)))
        except ConfigError:
            if not target.exists():
                raise
    raise PlanError(f"{folder}: could not find a free version for {plan.name!r}")
