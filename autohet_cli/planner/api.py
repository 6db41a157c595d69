"""One call from inputs to a finished plan: search, baselines, idle GPUs, contingency (pure).

The plan itself is assembled in ``planner.assemble``; what ``--measured-only`` may use
and its failure message are ``planner.measured_only``'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.budget import check_deadline, deadline_in, overrun_s, whole_call
from autohet_cli.costmodel.evaluate import PlanEval
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import ConfigError, InfeasibleError, TimeLimitReached
from autohet_cli.models import ModelSpec
from autohet_cli.plan import Pipeline, Plan, pipelines_entry, weight_sharded
from autohet_cli.planner.assemble import to_plan, with_predictions
from autohet_cli.planner.baselines import baselines as compute_baselines
from autohet_cli.planner.decide import decide, first_space, reevaluated, same_space
from autohet_cli.planner.measured_only import measured_only_message, usable_combinations
from autohet_cli.planner.parallel import Pending
from autohet_cli.planner.phases import phase
from autohet_cli.planner.search import (
    Candidate,
    Progress,
    SearchRequest,
    SearchResult,
    search,
)
from autohet_cli.planner.weights import CHOSEN
from autohet_cli.settings import TrainingSettings

__all__ = [
    "CHILD_MARGIN_S",
    "PlanOutcome",
    "Planner",
    "contingency_plans",
    "make_plan",
    "training_for",
    "with_predictions",  # planner.assemble's, imported from here by callers
]

CHILD_MARGIN_S = 0.3  # the baselines' child ends this long before the call's deadline


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOutcome:
    plan: Plan
    eval: PlanEval
    result: SearchResult
    baselines: Mapping[str, Candidate | None]


# ``make_plan`` as a parameter (recovery's; a stub in its tests). Its keywords are
# make_plan's: a Protocol restating them was a second copy to keep in step, and it
# checked nothing, since recovery passes them as a ``dict[str, Any]``.
Planner = Callable[..., PlanOutcome]


def make_plan(
    *,
    name: str,
    cluster: Cluster,
    model: ModelSpec,
    tables: CostTables,
    global_batch_size: int,
    objective: str = "time",
    time_limit_s: float = 60.0,
    inputs: Mapping[str, Mapping[str, str]] | None = None,
    contingency: bool = False,
    progress: Progress | None = None,
    with_baselines: bool = True,
    recompute: bool | None = None,
    zero1: bool | None = None,
    shard_weights: bool | None = None,
    measured_only: bool = False,
    incumbent: tuple[tuple[Pipeline, ...], int] | None = None,
    tp_candidates: Sequence[int] | None = None,
    mbs_candidates: Sequence[int] | None = None,
    ends_by: float | None = None,
) -> PlanOutcome:
    """Search, baselines and contingency plans, all within ``time_limit_s`` plus a
    short overrun (budget.overrun_s): what the deadline cuts off is left out of
    the plan and named in its notes, never waited for. ``recompute``: None lets
    the planner decide per stage where memory binds (``planner.recompute``); True
    makes every stage of the plan (and of the baselines and contingency plans)
    recompute its activations, False none; ``zero1``: None lets the planner decide
    whether to shard the optimizer state (``planner.decide``) unless
    ``tables.training.zero1`` already asks for it, True or False sets it;
    ``shard_weights``: None lets the planner shard stages' weights where memory binds
    (``planner.weights``), True searches that space whatever the memory, False never;
    ``measured_only`` lets all of them use
    only the (GPU type, TP, micro-batch size) combinations the profile measured;
    ``incumbent`` seeds the search with a plan known to run (``SearchRequest``);
    ``tp_candidates`` and ``mbs_candidates`` narrow the degrees and micro-batch sizes
    searched (recover: the old plan's, for a replan in seconds); ``ends_by`` (a
    ``time.monotonic()`` instant) bounds the whole call instead (``budget.whole_call``)."""
    if not (math.isfinite(time_limit_s) and time_limit_s > 0):
        raise ConfigError(f"--time-limit: must be a positive number of seconds, got {time_limit_s}")
    outer_s = time_limit_s + overrun_s(time_limit_s)
    if ends_by is not None:
        time_limit_s, outer_s = whole_call(min(time_limit_s, ends_by - time.monotonic()))
    req = SearchRequest(
        cluster=cluster,
        model=model,
        tables=tables,
        global_batch_size=global_batch_size,
        objective=objective,
        time_limit_s=time_limit_s,
        # Only degrees the model's heads, MLP and padded vocabulary split into.
        tp_candidates=tuple(
            t for t in (tp_candidates or (1, 2, 4, 8)) if not model.tensor_parallel_problems(t)
        ),
        mbs_candidates=tuple(mbs_candidates or (1, 2, 4, 8)),
        recompute=bool(recompute),
        measured_only=measured_only,
        incumbent=incumbent,
    )
    model_ref = (inputs or {}).get("model", {}).get("path") or model.name  # for --model
    if measured_only and not any(tables.is_measured(*c) for c in usable_combinations(req)):
        raise InfeasibleError(measured_only_message(req, None, model_ref))
    skipped: list[str] = []
    zero1_first = True if zero1 is None and tables.training.zero1 else zero1
    with deadline_in(outer_s) as ends:
        # The baselines on another core meanwhile (planner.parallel): in the space the
        # search starts in, then in the sharded one the planner may choose; again
        # below if the search settles in neither (recomputation).
        guesses = [first_space(req, recompute=recompute, zero1=zero1_first)]
        if zero1 is None and not zero1_first:
            guesses.append(first_space(req, recompute=recompute, zero1=True))
        # The child inherits a deadline a little before this call's: what it finished
        # by then (its baselines past the deadline named as skipped) reaches this
        # process before it stops waiting, instead of just after (review).
        with deadline_in(max(0.1, outer_s - CHILD_MARGIN_S)):
            early = Pending(*(partial(_baselines, g) for g in guesses)) if with_baselines else None
        try:
            try:
                result, req, decided, searched_in = decide(
                    req,
                    progress,
                    recompute=recompute,
                    zero1=zero1_first,
                    shard_weights=shard_weights,
                    on_plain=partial(_spare, early, len(guesses)),
                )
            except TimeLimitReached:
                raise
            except InfeasibleError as exc:
                if not measured_only:
                    raise
                raise InfeasibleError(measured_only_message(req, str(exc), model_ref)) from None
            base: dict[str, Candidate | None] = {}
            if early is not None:
                source = searched_in or req  # the baselines' space: the plan's search's
                hit = next((i for i, g in enumerate(guesses) if same_space(g, source)), None)
                try:
                    base, missed = (
                        _baselines(source)
                        if hit is None
                        else early.result(hit, timeout_s=ends - time.monotonic())
                    )
                except TimeLimitReached:  # still planning them at the deadline
                    base, missed = {}, ["the baselines"]
                if source is not req:
                    base = reevaluated(base, req)
                skipped += missed
        finally:
            if early is not None:
                early.cancel()
        with phase("contingency"):
            if_lost = contingency_plans(req, skipped) if contingency else {}
    best = result.best
    notes = list(decided)
    if measured_only:
        notes.append(
            "planned with --measured-only: only (GPU type, TP, micro-batch size) "
            "combinations the profile measured were searched, baselines and contingency "
            "plans included"
        )
    if skipped:
        notes.append(
            f"not computed within the time limit: {', '.join(skipped)} (raise --time-limit)"
        )
    forced = shard_weights is True and bool(weight_sharded(best.pipelines))  # --shard-weights
    for bname, cand in base.items():
        if cand is not None and not forced and cand.score < best.score * (1 - 1e-9):
            notes.append(f"the {bname} baseline scored better than the search; adopted it")
            # the baselines replicate their weights: the search's sharding is gone
            notes = [n for n in notes if CHOSEN not in n]
            best = cand
            result.status = "baseline"
    result.best = best
    plan = to_plan(
        name=name,
        best=best,
        result=result,
        model=model,
        tables=req.tables,  # the ZeRO-1 decision is in the chosen request's tables
        cluster=cluster,
        global_batch_size=global_batch_size,
        objective=objective,
        measured_only=measured_only,
    )
    plan = replace(
        plan,
        inputs=dict(inputs or {}),
        baselines={k: (None if c is None else c.eval.iteration_ms / 1e3) for k, c in base.items()},
        notes=tuple(notes) + plan.notes,
    )
    if contingency:
        plan = replace(plan, contingency=if_lost)
    return PlanOutcome(plan=plan, eval=best.eval, result=result, baselines=base)


def _spare(early: Pending[Any] | None, guesses: int, binds: bool) -> None:
    """Where memory does not bind after the plain search, no other space is searched
    and the sharded space's baselines (the second guess) are never asked for
    (``decide.reevaluated``): the child skips them, leaving the core to the search."""
    if early is not None and guesses > 1 and not binds:
        early.drop(1)


def _baselines(req: SearchRequest) -> tuple[dict[str, Candidate | None], list[str]]:
    skipped: list[str] = []
    with phase("baselines"):
        return compute_baselines(req, skipped), skipped


def contingency_plans(
    req: SearchRequest, skipped: list[str] | None = None
) -> dict[str, dict[str, object]]:
    """Best plan after losing each spot host, so recovery can start without solving.

    Hosts the planner's deadline leaves no time for are named in ``skipped`` and
    left out: recovery solves for them when it happens.
    """
    out: dict[str, dict[str, object]] = {}
    for h in req.cluster.hosts:
        if not h.spot:
            continue
        sub = req.cluster.without({h.name})
        try:
            check_deadline()
            res = search(replace(req, cluster=sub, time_limit_s=max(1.0, req.time_limit_s / 4)))
        except TimeLimitReached:
            if skipped is not None:
                skipped.append(f"contingency for losing {h.name}")
            continue
        except (InfeasibleError, Exception) as exc:  # noqa: BLE001 - recorded, not fatal
            out[h.name] = {"feasible": False, "reason": str(exc)}
            continue
        b = res.best
        out[h.name] = {
            "feasible": True,
            "tensor_parallel": max(s.tensor_parallel for p in b.pipelines for s in p.stages),
            "micro_batch_size": b.mbs,
            "iteration_time_s": round(b.eval.iteration_ms / 1e3, 6),
            "pipelines": [pipelines_entry(p) for p in b.pipelines],
        }
    return out


def training_for(
    global_batch_size: int, seq_len: int, precision: str, optimizer: str, *, zero1: bool = False
) -> TrainingSettings:
    return TrainingSettings(
        global_batch_size=global_batch_size,
        micro_batch_size=1,
        seq_len=seq_len,
        precision=precision,
        optimizer=optimizer,
        zero1=zero1,
    )
