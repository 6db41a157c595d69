"""The planner on the survivors (*solved* in ``recovery.replan``): first in the old
plan's space, for a replan in seconds, then in full (pure)."""

from __future__ import annotations

from typing import Any

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import InfeasibleError, TimeLimitReached
from autohet_cli.plan import Plan
from autohet_cli.planner.api import Planner, PlanOutcome
from autohet_cli.recovery.survivors import objective_of

# The search in the old plan's space: seconds at most, whatever the limit.
FIRST_SPACE_S = 1.5


def solve_on_survivors(
    old: Plan,
    survivors: Cluster,
    tables: CostTables,
    planner: Planner,
    time_limit_s: float,
    contingency: bool,
    kept: Plan | None,
) -> PlanOutcome:
    """The planner on the survivors, first in the old plan's space, then in full.

    Recovery time is solve time (issue 32: a replan in 2 s). The survivors are
    the old plan's hardware minus the lost hosts, so the old plan's choices, its
    TP degrees, micro-batch size, ZeRO-1 and whether any stage recomputes, still
    fit them best unless memory says otherwise: the first search keeps them, with
    no baselines, seeded with the survivors kept in place. Only when nothing fits
    that space does the full search run (every degree and size, ZeRO-1 and
    recomputation decided anew). ``autohet plan`` on the survivors' cluster
    searches everything, for a plan to move to at the next restart.

    The first search is anytime and gets ``FIRST_SPACE_S`` when it is seeded (the
    survivors could be kept; else it gets the whole limit, and so does a second try
    when the short one found nothing in time): its seed is a plan that runs, and
    SCIP takes the most promising groupings first, so the rest of a long limit
    bought nothing on the clusters measured (mix-64 and mix-256 minus a host:
    the same plans at 1.5 s as at 30 s, 1.8 s and 2.1 s in all, against 3.1 s and
    4.4 s)."""
    common: dict[str, Any] = {
        "name": old.name,
        "cluster": survivors,
        "model": tables.model,
        "tables": tables,
        "global_batch_size": old.training.global_batch_size,
        "objective": objective_of(old),
        "time_limit_s": time_limit_s,
        "inputs": dict(old.inputs),
        "contingency": contingency,
        "with_baselines": False,
        "incumbent": None
        if kept is None
        else (tuple(kept.pipelines), kept.training.micro_batch_size),
    }
    recomputes = any(s.recomputed for p in old.pipelines for s in p.stages)
    first: dict[str, Any] = {
        **common,
        "recompute": None if recomputes else False,
        "zero1": old.training.zero1,
        "tp_candidates": sorted({s.tensor_parallel for p in old.pipelines for s in p.stages}),
        "mbs_candidates": [old.training.micro_batch_size],
    }
    capped = kept is not None and time_limit_s > FIRST_SPACE_S  # a seed: anytime is safe
    try:
        try:
            return planner(**({**first, "time_limit_s": FIRST_SPACE_S} if capped else first))
        except TimeLimitReached:
            if not capped:
                raise
            return planner(**first)  # the short search found nothing in time: the whole limit
    except TimeLimitReached:
        raise  # out of time, not of memory: a wider search would not be faster
    except InfeasibleError:
        # The planner decides where memory binds, per stage and GPU type (an old
        # plan's flags were for other GPUs).
        return planner(**common, recompute=None)
