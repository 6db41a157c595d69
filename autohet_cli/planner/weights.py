"""Sharded weights as a planner decision (issue 48), after ZeRO-1 and recomputation.

Where memory still binds on the plan that ``planner.decide`` chose (or nothing fit),
the planner searches the weight-sharded space (``SearchRequest.shard_weights``):
groupings of one pipeline template copied k >= 2 times (any TP degrees), whose k
copies of each stage keep 1/k of its weights, gradients and optimizer state (FSDP, ``shard:
weights``). That is the layout the issue's hand-built plans use: fewer, shorter
pipelines that only fit sharded, paying per-layer gathers and reduce-scatters hidden
behind compute (costmodel.sharding) instead of a long pipeline's bubble or a third
more compute for recomputation. Its best plan is then tuned stage by stage
(``tune``): each stage column (the k copies of one stage, which must agree) takes
the best of sharded, sharded with its weights kept gathered from the forward to the
backward (one gather per micro-batch, more memory), and replicated, on the exact
cost model. It is adopted only where it is ``WEIGHTS_MIN_GAIN`` faster than the plan
without it (cheaper under ``--objective cost``): below that the gain is inside the
cost model's error, and a replicated stage is simpler to run.

Not searched: sharded weights where memory does not bind (the plain plan is then
within the bubble's reach of the compute limit and sharding only adds traffic), and
recomputation inside the sharded space unless nothing fits without it.
"""

from __future__ import annotations

import time
from dataclasses import replace

from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.errors import InfeasibleError, TimeLimitReached
from autohet_cli.plan import Pipeline, weight_sharded
from autohet_cli.planner.recompute import memory_binds, relax
from autohet_cli.planner.search import (
    Candidate,
    Progress,
    SearchRequest,
    SearchResult,
    scorer,
    search,
)

CHOSEN = "sharded weights chosen by the planner"  # the note of a plan that shards
WEIGHTS_MIN_GAIN = 0.01  # relative gain below which replicated weights are kept
# (shard, reshard_after_forward) a stage column may take, in the order tried
VARIANTS = (("weights", True), ("weights", False), ("none", True))


def wanted(result: SearchResult | None, shard_weights: bool | None) -> bool:
    """Whether step 4 runs: the user left it to the planner (or asked for it) and
    memory binds on the plan chosen so far, or nothing fit."""
    if shard_weights is False:
        return False
    return shard_weights is True or result is None or memory_binds(result.best)


def choose_weights(
    space: SearchRequest,
    current: SearchResult | None,
    progress: Progress | None,
    budget_s: float,
    *,
    forced: bool = False,
    recompute: bool | None = None,
) -> tuple[SearchResult | None, str | None]:
    """The result with sharded weights where they win (``current`` otherwise) and a
    note saying what was decided. ``space``: the space ``current`` was found in (its
    ZeRO-1 tables are kept); ``forced``: ``--shard-weights`` (adopted whenever a
    sharded plan fits, however small the gain); ``recompute``: the user's flag (None:
    without recomputation first, with it on every stage where nothing fit without)."""
    sharded = replace(space, shard_weights=True, recompute=False, recompute_types=frozenset())
    must_beat = None
    if current is not None and space.objective == "time" and not forced:
        must_beat = current.best.score * (1 - WEIGHTS_MIN_GAIN)
    alt: SearchResult | None = None
    deadline = time.monotonic() + budget_s
    flags = (False, True) if recompute is None else (recompute,)
    for req in [replace(sharded, recompute=flag) for flag in flags]:
        left = deadline - time.monotonic()
        if left <= 0.05:
            break
        try:
            alt = search(replace(req, time_limit_s=left, must_beat_ms=must_beat), progress)
            if req.recompute and recompute is None:  # only where the stages need it
                alt.best = relax(alt.best, req, scorer(req.cluster, req.objective))
            alt.best = tune(alt.best, req, deadline=deadline)
            break
        except (InfeasibleError, TimeLimitReached):
            continue  # recomputing too, where nothing fit without it
    if alt is None or not weight_sharded(alt.best.pipelines):
        if current is None:
            return None, None
        return current, (
            "sharded weights were considered (memory binds) and not used: no sharded "
            "plan was faster"
        )
    if current is None:
        return alt, _chosen_note(alt.best, "nothing fit without it")
    gain = 1 - alt.best.score / current.best.score
    if gain < WEIGHTS_MIN_GAIN and not forced:
        return current, (
            "sharded weights were considered (memory binds) and not used: "
            + (
                f"the best sharded plan was {-gain:.1%} slower"
                if gain <= -0.0005  # what prints as 0.1% or more
                else f"the best sharded plan was only {gain:.1%} faster"
                if gain >= 0.0005
                else "the best sharded plan was no faster"
            )
        )
    what = "cheaper per token" if space.objective == "cost" else "faster"
    if gain < 0:  # forced (--shard-weights)
        what = "more expensive per token" if space.objective == "cost" else "slower"
    why = f"{abs(gain):.1%} {what} than without it"
    return alt, _chosen_note(alt.best, why, forced=forced and gain < WEIGHTS_MIN_GAIN)


def tune(cand: Candidate, req: SearchRequest, *, deadline: float) -> Candidate:
    """Each stage column's best of ``VARIANTS`` on the exact model, greedily in stage
    order, keeping only what fits: sharding a stage that fits replicated adds traffic
    for nothing, and keeping a sharded stage's weights gathered saves a gather where
    memory allows."""
    score = scorer(req.cluster, req.objective)
    best = cand
    columns = max(len(p.stages) for p in cand.pipelines)
    for col in range(columns):
        if not any(
            col < len(p.stages) and p.stages[col].shard == "weights" for p in cand.pipelines
        ):
            continue
        for shard, reshard in VARIANTS:
            if time.monotonic() >= deadline:
                return best
            pipes = _with_column(best.pipelines, col, shard, reshard)
            ev = evaluate(pipes, req.cluster, req.tables, best.mbs)
            if ev.fits and score(pipes, ev) < best.score * (1 - 1e-9):
                best = replace(best, pipelines=pipes, eval=ev, score=score(pipes, ev))
    return best


def _with_column(pipes: list[Pipeline], col: int, shard: str, reshard: bool) -> list[Pipeline]:
    out = []
    for p in pipes:
        stages = list(p.stages)
        if col < len(stages):
            stages[col] = replace(stages[col], shard=shard, reshard_after_forward=reshard)
        out.append(replace(p, stages=tuple(stages)))
    return out


def _chosen_note(cand: Candidate, why: str, *, forced: bool = False) -> str:
    """``forced``: kept because ``--shard-weights`` asked, where the planner alone
    would not have sharded (a gain under ``WEIGHTS_MIN_GAIN``, or a loss)."""
    stages = [s for p in cand.pipelines for s in p.stages]
    n = weight_sharded(cand.pipelines)
    head = "sharded weights, as --shard-weights asks" if forced else CHOSEN
    return (
        f"{head}: {n} of {len(stages)} stages hold 1/"
        f"{len(cand.pipelines)} of their weights, gradients and optimizer state ({why}; "
        "--no-shard-weights turns it off)"
    )
