"""Solving a search's groupings (pure, SCIP through planner.milp): best estimate
first, pruned by lower bound against the incumbent (or the score a caller must see
beaten, ``SearchRequest.must_beat_ms``), judged hopeless by estimate; each split per
template and shared out by SCIP, placed, evaluated; then the best few refined
exactly, split with a forked process where a core is free."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from functools import partial
from math import inf

from autohet_cli.costmodel.budget import seconds_left
from autohet_cli.costmodel.evaluate import PlanEval, evaluate
from autohet_cli.errors import AutohetError, TimeLimitReached, UnknownNameError
from autohet_cli.plan import Pipeline
from autohet_cli.planner import parallel
from autohet_cli.planner.build import place, refine
from autohet_cli.planner.enumeration import Queue
from autohet_cli.planner.estimate import (
    ONES,
    Context,
    Scales,
    describe,
    link_sends,
    scale_of,
    state_bytes,
    sync_rate,
    update_scale,
)
from autohet_cli.planner.groups import Grouping, Template, block_range
from autohet_cli.planner.milp import (
    SplitInputs,
    SplitResult,
    last_status,
    solve_shares,
    solve_split,
)
from autohet_cli.planner.request import Candidate, Progress, SearchRequest

HOPELESS = 1.15  # estimates this far behind the best estimate are not solved
REFINE_TOP = 3
REFINE_MISALIGNED = 3  # more candidates refined: the best with unaligned cuts
MAX_SOLVES = 24  # groupings handed to SCIP at most; the rest count in the bound gap


# ... and of per-type-degree groupings, on top: their estimates are rougher (a segment
# held at two degrees syncs through the full gradient), so they get their own budget
# rather than taking solves from the one-degree groupings.
MAX_MIXED_SOLVES = 8


Solved = tuple[
    "Candidate | None", list["Candidate"], list[float], list[float], tuple[int, int, int], bool
]


def solve_queue(
    req: SearchRequest,
    queue: Queue,
    deadline: float,
    score: Callable[[list[Pipeline], PlanEval], float],
    note: Progress,
    seed: Candidate | None = None,
) -> Solved:
    """SCIP on the groupings, best estimate first, pruning by bound: (best, all
    solved, bounds of what was not solved, MILP gaps, (explored, pruned, hopeless),
    whether the deadline cut it short)."""
    solves = {False: 0, True: 0}  # groupings solved: one degree, per-type degrees
    best: Candidate | None = seed
    explored = pruned = hopeless = 0
    found: list[Candidate] = [seed] if seed is not None else []
    bounds: list[float] = []
    milp_gaps: list[float] = []
    total = len(queue)
    timed_out = False
    target = inf if req.objective != "time" or req.must_beat_ms is None else req.must_beat_ms
    while queue:
        est, _, g, ctx = heapq.heappop(queue)
        done = total - len(queue)
        # the target prunes by the lower bound alone, never by estimate nor by the
        # solve caps (those follow the incumbent, as without a target): only what no
        # layout of the grouping could reach is left out (review)
        bar = min(best.score if best is not None else inf, target)
        if req.objective == "time" and g.lower_bound_ms >= bar:
            pruned += 1
            if best is None or g.lower_bound_ms < best.score:  # pruned by the target
                bounds.append(g.lower_bound_ms)
            continue
        kind = len({c.tp for c in ctx.classes}) > 1  # a per-type-degree grouping
        if best is not None and (
            est > best.score * HOPELESS
            or solves[kind] >= (MAX_MIXED_SOLVES if kind else MAX_SOLVES)
        ):
            hopeless += 1
            bounds.append(g.lower_bound_ms)
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0 and (best is not None or explored > 0):
            timed_out = True
            bounds.append(g.lower_bound_ms)
            bounds.extend(item[2].lower_bound_ms for item in queue)
            break
        # ... but the best-estimate grouping is solved even past the limit (SCIP at
        # its shortest cap): a limit spent enumerating on a loaded machine still
        # gets a plan, as a tight --time-limit promises
        remaining = max(remaining, 0.05)
        note(done / total, f"{ctx.label} mbs={g.mbs} {describe(g, ctx)}")
        explored += 1
        solves[kind] += 1
        try:
            cand, dual = _solve_grouping(req, ctx, g, remaining, score)
        except TimeLimitReached:  # a simulation ran into the deadline
            timed_out = True
            bounds.append(g.lower_bound_ms)
            bounds.extend(item[2].lower_bound_ms for item in queue)
            break
        if dual is not None:
            bounds.append(dual)
        if cand is not None:
            found.append(cand)
            if best is None or cand.score < best.score:
                best = cand
            milp_gaps.append(cand.solver_gap)
    return best, found, bounds, milp_gaps, (explored, pruned, hopeless), timed_out


def seed_candidate(
    req: SearchRequest, score: Callable[[list[Pipeline], PlanEval], float]
) -> Candidate | None:
    """``req.incumbent`` as a candidate of this search's space, if it fits in it."""
    if req.incumbent is None or req.measured_only:
        return None
    pipelines, mbs = list(req.incumbent[0]), req.incumbent[1]
    try:
        ev = evaluate(pipelines, req.cluster, req.tables, mbs)
    except (UnknownNameError, KeyError, ValueError):  # a host or type this cluster lacks
        return None
    if not ev.fits:
        return None
    tp = max(s.tensor_parallel for p in pipelines for s in p.stages)
    return Candidate(pipelines=pipelines, tp=tp, mbs=mbs, eval=ev, score=score(pipelines, ev))


def _misaligned(cand: Candidate) -> bool:
    cuts = {tuple(s.layer_end for s in p.stages) for p in cand.pipelines}
    return len(cuts) > 1


def refine_best(
    req: SearchRequest,
    found: list[Candidate],
    score: Callable[[list[Pipeline], PlanEval], float],
    start: float,
) -> Candidate:
    """Exact local refinement of the few best candidates, within the time left
    (at least a short slice, so a tight --time-limit still gets a clean plan);
    the misaligned ones after them get what the best left of that time.

    The candidates are independent, so where a core is free (``parallel.ahead``:
    not in a planner process, nor with its children on every core but one) every other
    one is refined in a forked process meanwhile (issue 32: a quarter of a 256-GPU
    search); the best is picked in the same order either way. Where refinement
    runs to its local optimum (the usual case: it takes a fraction of its time)
    one process and two refine the same candidates alike; where time cuts it
    short, two processes give the misaligned ones more of it."""
    ranked = sorted(found, key=lambda c: c.score)
    # ... and the best few whose pipelines cut the layers at different places:
    # aligning their cuts merges sync segments (most of all where a segment is held
    # at two degrees and syncs the full gradient), which the MILP, solving one
    # template at a time, cannot see; there refinement gains most (on the
    # brute-force case 3types-8gpu, the optimum came from the 10th best candidate)
    misaligned = [c for c in ranked[REFINE_TOP:] if _misaligned(c)][:REFINE_MISALIGNED]
    top = ranked[:REFINE_TOP] + misaligned
    left = req.time_limit_s - (time.monotonic() - start)
    total_s = max(0.2, min(left, 0.25 * req.time_limit_s))
    slice_s = total_s / min(len(top), REFINE_TOP)
    until = time.monotonic() + total_s
    jobs = list(enumerate(top))
    theirs = None
    if len(jobs) > 1:
        # crowd=1: beside the baselines' child too, which is then often computing the
        # sharded space's baselines that the plain search's verdict will drop (mix-256:
        # 4.9 s without this refinement in parallel, 3.8-4.0 s with it)
        theirs = parallel.ahead(
            partial(_refine_each, req, jobs[1::2], score, slice_s, until), crowd=1
        )
    try:
        done = _refine_each(req, jobs if theirs is None else jobs[0::2], score, slice_s, until)
        if theirs is not None:
            try:
                done += theirs.result(timeout_s=seconds_left())
            except (AutohetError, RuntimeError):  # out of time, or the child died or
                pass  # failed: its refinements are lost, not the plan
    finally:
        if theirs is not None:
            theirs.cancel()
    # the unrefined best first: a refinement replaces it only when strictly better,
    # and of equal ones the earlier in ``top`` wins, as one process refining in order
    ordered = [(-1, top[0]), *sorted(done, key=lambda x: x[0])]
    return min(ordered, key=lambda x: (x[1].score, x[0]))[1]


def _refine_each(
    req: SearchRequest,
    jobs: list[tuple[int, Candidate]],
    score: Callable[[list[Pipeline], PlanEval], float],
    slice_s: float,
    until: float,
) -> list[tuple[int, Candidate]]:
    """(index, refined candidate) of the ``jobs`` (index in the refined list, at
    REFINE_TOP and after: misaligned ones, refined only before ``until``)."""
    out = []
    for i, cand in jobs:
        cut = until if i >= REFINE_TOP else float("inf")
        if cut <= time.monotonic():
            break

        def by_score(e: PlanEval, p: list[Pipeline] = cand.pipelines) -> float:
            return score(p, e)

        try:
            pipelines, ev = refine(
                cand.pipelines,
                req.cluster,
                req.tables,
                cand.mbs,
                by_score,
                deadline=min(time.monotonic() + slice_s, cut),
            )
        except TimeLimitReached:
            break
        out.append(
            (
                i,
                Candidate(
                    pipelines=pipelines,
                    tp=cand.tp,
                    mbs=cand.mbs,
                    eval=ev,
                    score=score(pipelines, ev),
                    solver_gap=cand.solver_gap,
                ),
            )
        )
    return out


def _solve_grouping(
    req: SearchRequest,
    ctx: Context,
    g: Grouping,
    remaining: float,
    score: Callable[[list[Pipeline], PlanEval], float],
) -> tuple[Candidate | None, float | None]:
    """Split each template (SCIP), share the batch (SCIP), split again for the
    shares found, place on devices, refine on the exact model."""
    a, b = block_range(req.model)
    M = req.global_batch_size // g.mbs
    # the call's deadline too (costmodel.budget): SCIP is not interrupted by it
    cap = max(0.05, min(remaining, seconds_left(), max(0.2, req.time_limit_s / 40)))
    sync, scales = sync_rate(req, ctx, g.parts)
    rates = [
        k * tpl.num_stages / min(ctx.stats[c].total_ms for c in tpl.classes) for tpl, k in g.parts
    ]
    m_hat = [
        max(1, round(M * r / sum(rates) / k)) for r, (_, k) in zip(rates, g.parts, strict=True)
    ]
    shares = None
    splits: list[SplitResult] = []
    for _ in range(2):
        splits = []
        for (tpl, _k), m in zip(g.parts, m_hat, strict=True):
            split = template_split(
                req, ctx, tpl, m, sync, b - a, cap, scales=scales, replicas=g.num_pipelines
            )
            if split is None:
                return None, None
            splits.append(split)
        shares = solve_shares(
            [k for _, k in g.parts],
            [x.bottleneck_ms for x in splits],
            [x.fill_ms for x in splits],
            M,
            time_limit_s=cap,
        )
        if shares is None:
            return None, None
        if all(
            abs(m - h) <= max(1, h // 10) for m, h in zip(shares.microbatches, m_hat, strict=True)
        ):
            break
        m_hat = list(shares.microbatches)
    assert shares is not None
    placed = []
    for stage_major in (False, True):
        pipelines = place(
            g.parts,
            [x.blocks for x in splits],
            shares.microbatches,
            shares.extra,
            ctx.classes,
            a,
            req.model.num_layers,
            stage_major=stage_major,
            recompute=req.recompute,
            recompute_types=req.recompute_types,
            shard_weights=req.shard_weights,
        )
        if pipelines is None:
            return None, None
        ev = evaluate(pipelines, req.cluster, req.tables, g.mbs)
        if ev.fits:
            placed.append((score(pipelines, ev), pipelines, ev))
        if g.num_pipelines == 1:
            break  # one pipeline: both placements are the same
    if not placed:
        return None, None
    _, pipelines, ev = min(placed, key=lambda x: x[0])
    cand = Candidate(
        pipelines=pipelines,
        tp=max(s.tensor_parallel for p in pipelines for s in p.stages),
        mbs=g.mbs,
        eval=ev,
        score=score(pipelines, ev),
        solver_gap=max([shares.gap, *(x.gap for x in splits)]),
    )
    return cand, None


def template_split(
    req: SearchRequest,
    ctx: Context,
    tpl: Template,
    m_hat: int,
    sync: float,
    num_blocks: int,
    cap: float,
    *,
    scales: Scales = ONES,
    replicas: int = 1,
) -> SplitResult | None:
    key = (tpl.classes, m_hat, round(sync, 12), scales, replicas)
    if key not in ctx.splits:
        got = solve_split(
            SplitInputs(
                template=tpl,
                stats=ctx.stats,
                mem_cap_bytes=ctx.caps,
                state_bytes_per_param=state_bytes(req, replicas),
                # tied embedding and head: ZeRO-1 and FSDP leave their state replicated
                end_state_bytes_per_param=state_bytes(
                    req, 1 if req.model.tied_embeddings else replicas
                ),
                num_blocks=num_blocks,
                update_scale=update_scale(req, replicas),
                end_update_scale=update_scale(req, replicas, tied=True),
                send_ms=link_sends(req, ctx, tpl),
                sync_ms_per_param=sync,
                sync_scale=[scale_of(scales, c) for c in range(len(ctx.classes))],
                expected_microbatches=m_hat,
            ),
            time_limit_s=cap,
        )
        if got is None and last_status() == "time_limit":
            return None  # no split found in time: not "none fits", so not remembered
        ctx.splits[key] = got
    return ctx.splits[key]
