"""The plan as plain data (the ``autohet.plan/v1`` YAML form), both ways (pure).

Writing rounds floats to 6 places and leaves out what a plan does not carry (no
``recompute`` on a stage that does not, no ``shard`` on a replicated stage, no
``reshard_after_forward`` where it is true, no ``zero1`` when off), so plans written
before a field existed keep their bytes and digests. Reading checks every key and
type, then ``Plan.validate``; errors name the field.
"""

from __future__ import annotations

from typing import Any

from autohet_cli.architecture import spec_from_dict, spec_to_dict
from autohet_cli.errors import ConfigError
from autohet_cli.plan.schema import (
    SCHEMA,
    Device,
    Pipeline,
    Plan,
    Prediction,
    SolverInfo,
    Stage,
    StagePrediction,
    shard_mode_error,
)
from autohet_cli.settings import TrainingSettings
from autohet_cli.yamlio import as_list, as_mapping, check_keys, coerce
from autohet_cli.yamlio import field as get


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
    elif s.recompute_layers:  # partial: the stage's first N layers
        d["recompute"] = s.recompute_layers
    if s.shard != "none":
        d["shard"] = s.shard
    if not s.reshard_after_forward:  # only on a weight-sharded stage (Plan.validate)
        d["reshard_after_forward"] = False
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
            ["tensor_parallel", "predicted", "recompute", "shard", "reshard_after_forward"],
        )
        shard = get(sm, "shard", str, sat, "none")
        if (why := shard_mode_error(shard)) is not None:
            raise ConfigError(f"{sat}.shard: {why}")
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
                **_recompute_fields(sm.get("recompute", False), f"{sat}.recompute"),
                shard=shard,
                reshard_after_forward=coerce(
                    sm["reshard_after_forward"], bool, f"{sat}.reshard_after_forward"
                )
                if "reshard_after_forward" in sm
                else True,
            )
        )
    return Pipeline(num_microbatches=get(pm, "num_microbatches", int, at), stages=tuple(stages))


def _recompute_fields(raw: Any, at: str) -> dict[str, Any]:
    """``recompute``: true or false (every layer or none), or a count of the stage's
    first layers; strict: not null, "yes" or 2.0, named in the error (the count is
    checked against the stage's layers by ``Plan.validate``)."""
    if isinstance(raw, bool):
        return {"recompute": raw}
    if isinstance(raw, int) and raw >= 0:
        return {"recompute_layers": raw}
    raise ConfigError(
        f"{at}: expected true, false or a count of the stage's first layers to recompute, "
        f"got {raw!r}"
    )


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
