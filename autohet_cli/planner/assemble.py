"""From the search's chosen candidate to a ``Plan``: each stage's and the iteration's
prediction, the solver's record and the GPUs left idle with the reason (pure).

``with_predictions`` is also how a plan made elsewhere (recovery's kept and
contingency plans, profiling's run shapes) gets the cost model's numbers.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Set
from dataclasses import replace

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.evaluate import PlanEval
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.models import ModelSpec
from autohet_cli.plan import (
    Pipeline,
    Plan,
    Prediction,
    SolverInfo,
    Stage,
    StagePrediction,
)
from autohet_cli.planner.request import Candidate, SearchResult


def to_plan(
    *,
    name: str,
    best: Candidate,
    result: SearchResult,
    model: ModelSpec,
    tables: CostTables,
    cluster: Cluster,
    global_batch_size: int,
    objective: str,
    measured_only: bool = False,
) -> Plan:
    ev = best.eval
    pipelines = tuple(
        Pipeline(
            num_microbatches=p.num_microbatches,
            stages=tuple(_with_prediction(s, pe.stages[i]) for i, s in enumerate(p.stages)),
        )
        for p, pe in zip(best.pipelines, ev.pipelines, strict=True)
    )
    training = replace(
        tables.training, global_batch_size=global_batch_size, micro_batch_size=best.mbs
    )
    return Plan(
        name=name,
        version=0,
        model_name=model.name,
        num_layers=model.num_layers,
        architecture=model,
        training=training,
        tensor_parallel=max(st.tensor_parallel for p in pipelines for st in p.stages),
        pipelines=pipelines,
        prediction=prediction_of(ev),
        solver=SolverInfo(
            status=result.status,
            gap=result.gap,
            time_s=result.time_s,
            objective=objective,
            search_gap=result.search_gap,
            groupings_explored=result.explored,
            groupings_pruned=result.pruned + result.hopeless,
        ),
        idle=tuple(
            idle_devices(
                cluster,
                best,
                unmeasured={
                    t
                    for t in cluster.gpu_types()
                    if measured_only and not tables.is_measured(t, best.degree(t), best.mbs)
                },
            )
        ),
        created=created_now(),
    )


def prediction_of(ev: PlanEval) -> Prediction:
    return Prediction(
        iteration_time_s=ev.iteration_ms / 1e3,
        tokens_per_s=ev.tokens_per_s,
        memory_peak_fraction=ev.memory_peak_fraction,
        pipeline_time_s=ev.pipeline_ms / 1e3,
        grad_sync_time_s=ev.grad_sync_ms / 1e3,
        optimizer_time_s=ev.optimizer_ms / 1e3,
        closed_form_time_s=ev.closed_form_iteration_ms / 1e3,
    )


def with_predictions(plan: Plan, ev: PlanEval) -> Plan:
    """``plan`` with every stage's and the iteration's prediction from ``ev``
    (``evaluate`` of the same pipelines): what a plan file carries and a run is
    compared against."""
    pipelines = tuple(
        replace(
            p,
            stages=tuple(
                _with_prediction(s, se) for s, se in zip(p.stages, pe.stages, strict=True)
            ),
        )
        for p, pe in zip(plan.pipelines, ev.pipelines, strict=True)
    )
    return replace(plan, pipelines=pipelines, prediction=prediction_of(ev))


def _with_prediction(s: Stage, se: object) -> Stage:
    from autohet_cli.costmodel.evaluate import StageEval

    assert isinstance(se, StageEval)
    return replace(
        s,
        predicted=StagePrediction(
            fwd_ms=se.cost.fwd_ms,
            bwd_ms=se.cost.bwd_ms,
            update_ms=se.cost.update_ms,
            mem_bytes=se.mem_bytes,
            mem_fraction=se.mem_fraction,
        ),
    )


def idle_devices(
    cluster: Cluster, best: Candidate, unmeasured: Set[str] = frozenset()
) -> list[dict[str, object]]:
    """GPUs the plan leaves unused, per host, with the reason; ``unmeasured`` are the
    GPU types --measured-only kept out (no measurement at the plan's TP and mbs)."""
    used: dict[str, set[int]] = {}
    for p in best.pipelines:
        for s in p.stages:
            for d in s.devices:
                used.setdefault(d.host, set()).add(d.gpu)
    types_used = {s.gpu_type for p in best.pipelines for s in p.stages}
    out: list[dict[str, object]] = []
    for h in cluster.hosts:
        free = [g for g in range(h.num_gpus) if g not in used.get(h.name, set())]
        if not free:
            continue
        tp = best.degree(h.gpu_type) if h.gpu_type in types_used else 1
        if h.num_gpus < tp or (h.name in used and len(free) < tp):
            why = f"tensor_parallel {tp} needs {tp} GPUs of one host; these are left over"
        elif h.gpu_type not in types_used and h.gpu_type in unmeasured:
            why = (
                f"--measured-only: the profile has no measurement of {h.gpu_type} at "
                f"tensor_parallel {tp}, micro-batch size {best.mbs}"
            )
        elif h.gpu_type not in types_used:
            why = (
                f"no {h.gpu_type} GPU is used: every grouping that used them was predicted "
                "slower (slow stages or batch shares too coarse to help)"
            )
        else:
            why = (
                "left over after forming pipelines of the chosen depth; adding them "
                "would unbalance the pipelines"
            )
        out.append({"host": h.name, "gpus": free, "reason": why})
    return out


def created_now() -> str:
    """A new plan's ``created``: now, in UTC, to the second."""
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
