"""The old plan's contingency entry for the lost host, as a plan to resume on
(*contingency* in ``recovery.replan``): no solving, only checks (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import AutohetError
from autohet_cli.plan import Plan, check_against_cluster, pipeline_from_dict
from autohet_cli.planner.assemble import with_predictions
from autohet_cli.recovery.choice import CONTINGENCY
from autohet_cli.recovery.errors import RecoveryError
from autohet_cli.recovery.survivors import derived_plan, unsolved, with_idle


def from_contingency(
    old: Plan,
    survivors: Cluster,
    lost: tuple[str, ...],
    added: tuple[str, ...],
    tables: CostTables | None,
    notes: list[str],
) -> tuple[Plan, float] | None:
    """The old plan's contingency entry for the lost host as a plan, if it applies
    (why not goes to ``notes``), with its iteration time: the cost model's with
    ``tables``, else the one recorded."""
    if len(lost) != 1:
        notes.append(f"{len(lost)} hosts lost: contingency plans cover one lost host")
        return None
    host = lost[0]
    entry = old.contingency.get(host)
    if entry is None:
        notes.append(
            f"the old plan has no contingency entry for {host} (plan with --contingency "
            "to recover without solving)"
        )
        return None
    if added:
        notes.append(f"hosts were added ({', '.join(added)}): solved to use them")
        return None
    if entry.get("feasible") is not True:
        notes.append(f"the contingency plan for losing {host} is infeasible: {entry.get('reason')}")
        return None
    where = f"plan {old.name}.v{old.version}: contingency.{host}"
    try:
        plan, recorded_s = _plan_from_entry(old, entry, where)
        check_against_cluster(
            plan, {h.name: (h.gpu_type, h.num_gpus) for h in survivors.hosts}, where
        )
    except AutohetError as exc:
        notes.append(f"the contingency plan for losing {host} does not apply: {exc}")
        return None
    plan = replace(plan, solver=unsolved(CONTINGENCY, old))
    if tables is None:
        return with_idle(plan, survivors), recorded_s
    ev = evaluate(plan.pipelines, survivors, tables, plan.training.micro_batch_size)
    if not ev.fits:
        notes.append(
            f"the contingency plan for losing {host} no longer fits in memory "
            f"(peak {ev.memory_peak_fraction:.0%} of a GPU)"
        )
        return None
    return with_idle(with_predictions(plan, ev), survivors), ev.iteration_ms / 1e3


def _plan_from_entry(old: Plan, entry: Mapping[str, Any], where: str) -> tuple[Plan, float]:
    def need(key: str) -> Any:
        if key not in entry:
            raise RecoveryError(f"{where}: missing {key!r}")
        return entry[key]

    raw_pipes = need("pipelines")
    if not isinstance(raw_pipes, list):
        raise RecoveryError(f"{where}.pipelines: expected a list")
    pipelines = tuple(
        pipeline_from_dict(pv, f"{where}.pipelines[{i}]") for i, pv in enumerate(raw_pipes)
    )
    tp, mbs, time_s = need("tensor_parallel"), need("micro_batch_size"), need("iteration_time_s")
    if not isinstance(tp, int) or not isinstance(mbs, int) or not isinstance(time_s, int | float):
        raise RecoveryError(f"{where}: tensor_parallel, micro_batch_size, iteration_time_s")
    plan = derived_plan(
        old,
        training=replace(old.training, micro_batch_size=mbs),
        tensor_parallel=tp,
        pipelines=pipelines,
        prediction=None,
    )
    plan.validate(where)
    return plan, float(time_s)
