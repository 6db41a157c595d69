"""The grouping search: bound, order, solve with SCIP, refine, keep the best (pure).

A search context is a micro-batch size and a TP degree per GPU type: one degree
for all (as Megatron would), or a different one per type (a V100-16 stage at TP 2
beside A100 stages at TP 1, as Metis and Sailor plan). Per-type degrees multiply
the contexts, so where their combinations are many (``MAX_DEGREE_COMBOS``) each
type keeps its two best degrees, judged by the type's best estimate on its own
(``enumeration``). In every context, each device class gets a few pipeline
shapes (depth, count) that fit its memory; their combinations, plus mixed
pipelines spanning every class, are the groupings. Each grouping gets a valid
lower bound (groups.lower_bound_ms) and a quick estimate (balanced split,
water-filled batch). Groupings are solved by SCIP in order of estimate; a
grouping whose lower bound cannot beat the incumbent is pruned, and one whose
estimate is far behind the best estimate is deemed hopeless and never solved
(its lower bound still counts in the reported gap).

This module runs the phases; ``request`` holds what a search is asked and gives,
``enumeration`` the contexts and groupings, ``estimate`` the quick cost model they
are bounded and ordered by, ``solve`` the SCIP solves and the refinement.
"""

from __future__ import annotations

import time

from autohet_cli.costmodel.budget import deadline_in, overrun_s
from autohet_cli.errors import InfeasibleError, NoBetterPlan, TimeLimitReached
from autohet_cli.planner.enumeration import enumerate_groupings
from autohet_cli.planner.phases import phase
from autohet_cli.planner.request import Candidate, Progress, SearchRequest, SearchResult, scorer
from autohet_cli.planner.solve import refine_best, seed_candidate, solve_queue

__all__ = [
    "Candidate",
    "Progress",
    "SearchRequest",
    "SearchResult",
    "scorer",
    "search",
]


RUNNERS_UP = 8  # other solved candidates a result keeps (SearchResult.runners_up)


def search(req: SearchRequest, progress: Progress | None = None) -> SearchResult:
    """The best plan found within ``req.time_limit_s``: solving stops at the limit,
    and refinement and simulation stop at most ``overrun_s`` after it."""
    with deadline_in(req.time_limit_s + overrun_s(req.time_limit_s)), phase("search"):
        return _search(req, progress)


def _search(req: SearchRequest, progress: Progress | None) -> SearchResult:
    start = time.monotonic()
    deadline = start + req.time_limit_s
    note = progress or (lambda _f, _m: None)
    score = scorer(req.cluster, req.objective)
    with phase("enumerate"):
        queue, incomplete = enumerate_groupings(req, start, note)
    if not queue:
        raise InfeasibleError(_shortfall(req))
    with phase("solve"):
        solved = solve_queue(req, queue, deadline, score, note, seed_candidate(req, score))
    best, found, bounds, milp_gaps, (explored, pruned, hopeless), timed_out = solved
    if best is None:
        if timed_out:
            raise TimeLimitReached(_too_slow(req))
        if req.must_beat_ms is not None:
            raise NoBetterPlan(
                f"no plan in this space beats {req.must_beat_ms:.1f} ms per iteration: "
                f"{pruned} groupings bounded out, {explored} solved without a plan that fits"
            )
        raise InfeasibleError(_shortfall(req))
    with phase("refine"):
        best = refine_best(req, found, score, start)
    lb = min([best.score, *bounds]) if req.objective == "time" else best.score
    search_gap = max(0.0, (best.score - lb) / best.score)
    if timed_out:
        status = "time_limit"
    elif (
        best.solver_gap <= 1e-3
        and hopeless == 0
        and not incomplete
        and all(b >= best.score for b in bounds)  # none pruned by a target under the best
    ):
        status = "optimal"  # every grouping solved or pruned by its lower bound
    else:
        status = "heuristic"  # some groupings were judged hopeless by estimate
    note(1.0, "done")
    return SearchResult(
        best=best,
        status=status,
        gap=best.solver_gap,
        search_gap=search_gap,
        time_s=time.monotonic() - start,
        explored=explored,
        pruned=pruned,
        hopeless=hopeless,
        milp_gaps=milp_gaps,
        runners_up=[c for c in sorted(found, key=lambda c: c.score) if c is not best][:RUNNERS_UP],
    )


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _too_slow(req: SearchRequest) -> str:
    return (
        f"no plan for {req.model.name} on {req.cluster.name} was found within the time limit "
        f"of {req.time_limit_s:g} s (a global batch of {req.global_batch_size} means up to "
        "that many micro-batches to simulate per pipeline); raise --time-limit or lower "
        "--global-batch-size"
    )


def _shortfall(req: SearchRequest) -> str:
    """Why nothing fits: total memory needed versus what the cluster has."""
    t = req.tables.training
    need = req.model.num_params * t.state_bytes_per_param
    have = sum(  # a card smaller than its runtime reserve adds nothing, not less
        h.num_gpus * max(0, h.gpu_mem_bytes - req.tables.reserve_bytes(h.gpu_type))
        for h in req.cluster.hosts
    )
    if need > have:
        return (
            f"{req.model.name} does not fit on {req.cluster.name}: its weights, gradients and "
            f"{t.optimizer} state need {_bytes(need)}, the cluster has {_bytes(have)} of GPU "
            "memory after runtime reserves; add GPUs or use a smaller model"
        )
    remedy = "" if req.recompute else "--recompute (about 1/3 more compute), "
    return (
        f"no plan fits {req.model.name} with global batch {req.global_batch_size} on "
        f"{req.cluster.name}: weights and optimizer state need {_bytes(need)} of "
        f"{_bytes(have)}, but the activations of in-flight micro-batches do not fit at any "
        f"TP degree and micro-batch size tried; use {remedy}a shorter --seq-len, more GPUs, "
        "or a global batch that allows more micro-batches"
    )
