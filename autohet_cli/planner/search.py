"""The grouping search: bound, order, solve with SCIP, refine, keep the best (pure).

A search context is a micro-batch size and a TP degree per GPU type: one degree
for all (as Megatron would), or a different one per type (a V100-16 stage at TP 2
beside A100 stages at TP 1, as Metis and Sailor plan). Per-type degrees multiply
the contexts, so where their combinations are many (``MAX_DEGREE_COMBOS``) each
type keeps its two best degrees, judged by the type's best estimate on its own
(``_standalone_ms``). In every context, each device class gets a few pipeline
shapes (depth, count) that fit its memory; their combinations, plus mixed
pipelines spanning every class, are the groupings. Each grouping gets a valid
lower bound (groups.lower_bound_ms) and a quick estimate (balanced split,
water-filled batch). Groupings are solved by SCIP in order of estimate; a
grouping whose lower bound cannot beat the incumbent is pruned, and one whose
estimate is far behind the best estimate is deemed hopeless and never solved
(its lower bound still counts in the reported gap).
"""

from __future__ import annotations

import heapq
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import accumulate, chain, product
from typing import Any

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.budget import deadline_in, overrun_s, seconds_left
from autohet_cli.costmodel.evaluate import (
    PlanEval,
    evaluate,
    ring_allreduce_ms,
    send_copies,
    transfer_ms,
)
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import AutohetError, InfeasibleError, TimeLimitReached, UnknownNameError
from autohet_cli.models import ModelSpec
from autohet_cli.plan import Pipeline
from autohet_cli.planner import parallel
from autohet_cli.planner.build import place, refine
from autohet_cli.planner.groups import (
    BlockStats,
    DeviceClass,
    Grouping,
    Template,
    aligned_parts,
    block_range,
    block_stats,
    device_classes,
    enumerate_parts,
    homogeneous_options,
    lower_bound_ms,
    min_depth,
)
from autohet_cli.planner.milp import (
    SplitInputs,
    SplitResult,
    last_status,
    solve_shares,
    solve_split,
)
from autohet_cli.planner.phases import phase

Progress = Callable[[float, str], None]
HOPELESS = 1.15  # estimates this far behind the best estimate are not solved
MAX_OPTIONS_PER_CLASS = 8
REFINE_TOP = 3
REFINE_MISALIGNED = 3  # more candidates refined: the best with unaligned cuts
RUNNERS_UP = 8  # other solved candidates a result keeps (SearchResult.runners_up)
ENUMERATE_SHARE = 0.4  # of the time limit, at most, for building and bounding groupings
MAX_SOLVES = 24  # groupings handed to SCIP at most; the rest count in the bound gap
# ... and of per-type-degree groupings, on top: their estimates are rougher (a segment
# held at two degrees syncs through the full gradient), so they get their own budget
# rather than taking solves from the one-degree groupings.
MAX_MIXED_SOLVES = 8
MAX_DEGREE_COMBOS = 9  # per-type degree combinations per micro-batch size tried in full
DEGREES_PER_TYPE = 2  # beyond that, each GPU type's best degrees combined
# Per-type contexts are enumerated, most promising first, until they have given
# MIXED_SHARE times the groupings of the one-degree contexts (at least MIXED_FLOOR):
# on big clusters each context costs ~0.5 s of estimates, and the planner speed
# targets leave room for about half as many again.
MIXED_SHARE = 0.5
MIXED_FLOOR = 5000


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchRequest:
    cluster: Cluster
    model: ModelSpec
    tables: CostTables
    global_batch_size: int
    objective: str = "time"  # or "cost": $ per token
    time_limit_s: float = 60.0
    tp_candidates: Sequence[int] = (1, 2, 4, 8)
    mbs_candidates: Sequence[int] = (1, 2, 4, 8)
    # Every stage of every plan searched recomputes its activations (Stage.recompute):
    # times and memory throughout (MILP, estimates, bounds, evaluation) are those of
    # recompute stages, and the plans carry the flag.
    recompute: bool = False
    # Stages on these GPU types recompute too (with recompute False): where one type's
    # memory binds and another's does not, the best layouts mix flags by type
    # (planner.recompute).
    recompute_types: frozenset[str] = frozenset()
    # Only (GPU type, TP, micro-batch size) combinations the profile measured
    # (CostTables.is_measured): a class without a measurement at a context's
    # (TP, mbs) is left out of that context, as if the cluster lacked it.
    measured_only: bool = False
    # A plan known to run here (recover: the old plan's survivors kept in place):
    # (pipelines, micro-batch size). It seeds the search as its first incumbent, so
    # groupings whose bound or estimate cannot beat it are never solved; the result
    # is never worse than it.
    incumbent: tuple[tuple[Pipeline, ...], int] | None = None

    def recomputes(self, gpu_type: str) -> bool:
        """Whether the stages this request plans on ``gpu_type`` recompute."""
        return self.recompute or gpu_type in self.recompute_types


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    pipelines: list[Pipeline]
    tp: int  # the largest stage degree
    mbs: int
    eval: PlanEval
    score: float
    solver_gap: float = 0.0

    def degree(self, gpu_type: str) -> int:
        """The TP degree of this candidate's stages on ``gpu_type`` (``tp`` if none)."""
        used = {
            s.tensor_parallel for p in self.pipelines for s in p.stages if s.gpu_type == gpu_type
        }
        return max(used, default=self.tp)


@dataclass(slots=True, kw_only=True)
class SearchResult:
    best: Candidate
    status: str
    gap: float  # SCIP's gap on the chosen grouping's split and shares
    search_gap: float  # against the lower bound over every grouping (a weak bound)
    time_s: float
    explored: int = 0
    pruned: int = 0
    hopeless: int = 0
    milp_gaps: list[float] = field(default_factory=list)
    # the next best candidates solved (best first, at most RUNNERS_UP): other layouts
    # that a change of settings (ZeRO-1) is re-evaluated on without a new search
    runners_up: list[Candidate] = field(default_factory=list)


@dataclass(slots=True)
class _Context:
    tp: int  # the largest degree of its classes
    mbs: int
    classes: list[DeviceClass]
    stats: list[BlockStats]
    caps: list[float]
    params_per_gpu: int
    splits: dict[tuple[tuple[int, ...], int, float, bool, int], SplitResult | None] = field(
        default_factory=dict
    )
    sends: dict[Template, list[float]] = field(default_factory=dict)  # _sends, memoised
    # what every grouping of this context asks again (_estimate, _sync_rate): per
    # template, per class, per cluster; computed once (10^5 groupings on 1024 GPUs)
    memo: dict[object, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``tp=2``, or the degree per GPU type where they differ."""
        degrees = dict.fromkeys((c.gpu_type, c.tp) for c in self.classes)
        if len({t for _, t in degrees}) <= 1:
            return f"tp={self.tp}"
        return "tp=" + ",".join(f"{g}:{t}" for g, t in degrees)


def scorer(cluster: Cluster, objective: str) -> Callable[[list[Pipeline], PlanEval], float]:
    """Seconds per iteration, or dollars per million tokens of the hosts in use."""

    def score(pipelines: list[Pipeline], ev: PlanEval) -> float:
        if objective == "time":
            return ev.iteration_ms
        hosts = {s.host for p in pipelines for s in p.stages}
        price = sum(cluster.host(h).price_per_hour for h in hosts)
        return price / 3600.0 / ev.tokens_per_s * 1e6 if ev.tokens_per_s else float("inf")

    return score


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
        queue, incomplete = _enumerate(req, start, note)
    if not queue:
        raise InfeasibleError(_shortfall(req))
    with phase("solve"):
        solved = _solve_queue(req, queue, deadline, score, note, _seed(req, score))
    best, found, bounds, milp_gaps, (explored, pruned, hopeless), timed_out = solved
    if best is None:
        raise TimeLimitReached(_too_slow(req)) if timed_out else InfeasibleError(_shortfall(req))
    with phase("refine"):
        best = _refine_best(req, found, score, start)
    lb = min([best.score, *bounds]) if req.objective == "time" else best.score
    search_gap = max(0.0, (best.score - lb) / best.score)
    if timed_out:
        status = "time_limit"
    elif best.solver_gap <= 1e-3 and hopeless == 0 and not incomplete:
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


Queue = list[tuple[float, int, Grouping, "_Context"]]


def _enumerate(req: SearchRequest, start: float, note: Progress) -> tuple[Queue, bool]:
    """Every grouping of every context with its bound and estimate, as a heap by
    estimate; and whether some degree combinations were left out."""
    queue: Queue = []
    uniform = mixed = 0  # groupings enumerated in one-degree and per-type contexts
    contexts, incomplete = _contexts(req)  # incomplete: some degree combinations left out
    for n, (ctx, per_type) in enumerate(contexts):
        if per_type and mixed >= max(MIXED_FLOOR, MIXED_SHARE * uniform):
            left = sum(1 for _, pt in contexts[n:] if pt)
            note(0.0, f"per-type TP degrees: {left} less promising combinations not searched")
            incomplete = True
            break
        before = len(queue)
        M = req.global_batch_size // ctx.mbs
        options = [
            _trim(homogeneous_options(c.num_groups, d)) if d else []
            for c, d in zip(ctx.classes, _min_depths(req, ctx), strict=True)
        ]
        bounds: dict[Template, tuple[int, float, float]] = {}  # lower_bound_ms's, this context
        for parts in chain(
            enumerate_parts(ctx.classes, options, mixed_orders=True), aligned_parts(ctx.classes)
        ):
            if sum(k for _, k in parts) > M:
                continue
            low, rate = _sync_rates(req, ctx, parts)
            lb = lower_bound_ms(
                parts,
                ctx.stats,
                M,
                low,
                ctx.params_per_gpu,
                update_scale=_update_scale(req, sum(k for _, k in parts)),
                memo=bounds,
            )
            g = Grouping(tp=ctx.tp, mbs=ctx.mbs, parts=parts, lower_bound_ms=lb)
            est = _estimate(req, ctx, parts, M, rate)
            heapq.heappush(queue, (est, len(queue), g, ctx))
        if per_type:
            mixed += len(queue) - before
        else:
            uniform += len(queue) - before
        if queue and time.monotonic() > start + ENUMERATE_SHARE * req.time_limit_s:
            note(0.0, "time limit: stopped enumerating groupings early")
            break
    return queue, incomplete


Solved = tuple[
    "Candidate | None", list["Candidate"], list[float], list[float], tuple[int, int, int], bool
]


def _solve_queue(
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
    while queue:
        est, _, g, ctx = heapq.heappop(queue)
        done = total - len(queue)
        if best is not None and req.objective == "time" and g.lower_bound_ms >= best.score:
            pruned += 1
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
        note(done / total, f"{ctx.label} mbs={g.mbs} {_describe(g, ctx)}")
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


def _seed(
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


def _refine_best(
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


def _contexts(req: SearchRequest) -> tuple[list[tuple[_Context, bool]], bool]:
    """(context, per-type degrees?): one degree for every type first (in degree,
    then micro-batch order), then the per-type combinations (``_ranked_combos``),
    most promising first; and whether combinations were left out."""
    out = []
    max_gpus = max(h.num_gpus for h in req.cluster.hosts)
    batch_sizes = [m for m in req.mbs_candidates if req.global_batch_size % m == 0]
    for tp in req.tp_candidates:
        if tp > max_gpus:
            continue
        for mbs in batch_sizes:
            ctx = _context(req, tp, mbs)
            if ctx is not None:
                out.append((ctx, False))
    combos = []
    trimmed = False
    for i, mbs in enumerate(batch_sizes):
        ranked, left_out = _ranked_combos(req, mbs)
        trimmed = trimmed or left_out
        combos += [(rank, i, mbs, degrees) for rank, degrees in ranked]
    for _, _, mbs, degrees in sorted(combos, key=lambda x: x[:2]):
        ctx = _context(req, degrees, mbs)
        # --measured-only may drop a type, leaving one degree: a uniform context
        if ctx is not None and len({c.tp for c in ctx.classes}) > 1:
            out.append((ctx, True))
    return out, trimmed


def _context(req: SearchRequest, degrees: int | Mapping[str, int], mbs: int) -> _Context | None:
    classes = _allowed_classes(req, device_classes(req.cluster, degrees), mbs)
    if not classes:
        return None
    stats = [
        block_stats(
            req.tables.table(c.gpu_type, c.tp, mbs, c.intra_node_gbps),
            req.model,
            recompute=req.recomputes(c.gpu_type),
        )
        for c in classes
    ]
    caps = [float(c.mem_bytes - req.tables.reserve_bytes(c.gpu_type)) for c in classes]
    params = min(
        req.tables.table(c.gpu_type, c.tp, mbs, c.intra_node_gbps).params(0, req.model.num_layers)
        for c in classes
    )
    return _Context(
        tp=max(c.tp for c in classes),
        mbs=mbs,
        classes=classes,
        stats=stats,
        caps=caps,
        params_per_gpu=params,
    )


def _ranked_combos(req: SearchRequest, mbs: int) -> tuple[list[tuple[int, dict[str, int]]], bool]:
    """Per-GPU-type TP degrees that are not all equal (those are the uniform
    contexts), each with a rank (the sum of its degrees' ranks in their types: 0
    for every type's best degree). All combinations where they are at most
    MAX_DEGREE_COMBOS; else each type's DEGREES_PER_TYPE best degrees by
    ``_standalone_ms``, combined. Also whether some type's degrees were left out."""
    types = req.cluster.gpu_types()
    if len(types) < 2:
        return [], False
    allowed = {
        g: [
            t
            for t in req.tp_candidates
            if any(h.num_gpus >= t for h in req.cluster.hosts if h.gpu_type == g)
        ]
        for g in types
    }
    count = 1
    for g in types:
        count *= len(allowed[g])
    keep = len(req.tp_candidates) if count <= MAX_DEGREE_COMBOS else DEGREES_PER_TYPE
    ranked = {
        g: [t for _, t in sorted((_standalone_ms(req, g, t, mbs), t) for t in ts)][:keep]
        for g, ts in allowed.items()
    }
    combos = []
    for choice in product(*(range(len(ranked[g])) for g in types)):
        degrees = {g: ranked[g][i] for g, i in zip(types, choice, strict=True)}
        if len(set(degrees.values())) > 1:
            combos.append((sum(choice), degrees))
    return combos, any(len(ranked[g]) < len(allowed[g]) for g in types)


def _standalone_ms(req: SearchRequest, gpu_type: str, tp: int, mbs: int) -> float:
    """The best estimate of ``gpu_type``'s GPUs training alone at (tp, mbs): inf
    where they cannot hold the model alone (they may still serve in mixed pipelines,
    so such degrees rank last, smallest first)."""
    ctx = _context(req, {gpu_type: tp}, mbs)
    if ctx is None:
        return float("inf")
    M = req.global_batch_size // mbs
    best = float("inf")
    for c, d in zip(ctx.classes, _min_depths(req, ctx), strict=True):
        if d is None:
            continue
        for depth, k in _trim(homogeneous_options(c.num_groups, d)):
            if k <= M:
                parts = ((Template(classes=(c.index,) * depth), k),)
                best = min(best, _estimate(req, ctx, parts, M))
    return best


def _allowed_classes(req: SearchRequest, classes: list[DeviceClass], mbs: int) -> list[DeviceClass]:
    """All classes, or with ``measured_only`` those measured at (their tp, mbs),
    renumbered so that a class's index stays its position (templates index by it)."""
    if not req.measured_only:
        return classes
    kept = [c for c in classes if req.tables.is_measured(c.gpu_type, c.tp, mbs)]
    return [replace(c, index=i) for i, c in enumerate(kept)]


def _min_depths(req: SearchRequest, ctx: _Context) -> list[int | None]:
    a, b = block_range(req.model)
    return [
        min_depth(st, cap, _state_bytes(req, c.num_groups), b - a)
        for st, cap, c in zip(ctx.stats, ctx.caps, ctx.classes, strict=True)
    ]


def _update_scale(req: SearchRequest, replicas: int, *, tied: bool = False) -> float:
    """The share of a stage's update each holder steps: 1/P of what ZeRO-1 shards
    over ``replicas`` pipelines (``tied``: a tied embedding or head, never sharded;
    a segment held at two degrees is not either, so the scale is a lower bound)."""
    if not req.tables.training.zero1 or replicas < 2 or (tied and req.model.tied_embeddings):
        return 1.0
    return 1.0 / replicas


def _state_bytes(req: SearchRequest, replicas: int) -> int:
    """Bytes per parameter a GPU keeps for its stage's weights, gradients and
    optimizer state, with ZeRO-1 (``training.zero1``) over ``replicas`` pipelines:
    the optimizer's part split over them (tied weights and segments held at
    different degrees are not sharded; the exact evaluation counts those, so a
    split this admits may still be refused there)."""
    t = req.tables.training
    if not t.zero1 or replicas < 2:
        return t.state_bytes_per_param
    return int(t.state_bytes_per_param - t.optimizer_bytes_per_param * (1 - 1 / replicas))


def _trim(options: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Keep the shallowest shapes (most data parallelism) and a geometric spread
    of deeper ones, so big clusters do not explode the combinations."""
    if len(options) <= MAX_OPTIONS_PER_CLASS:
        return options
    head = options[:4]
    rest = options[4:]
    step = max(1, len(rest) // (MAX_OPTIONS_PER_CLASS - 4))
    return head + rest[::step][: MAX_OPTIONS_PER_CLASS - 4]


def _slowest_link(cluster: Cluster) -> float:
    return min([cluster.inter_node_gbps, *cluster.pair_gbps.values()])


def _sends(req: SearchRequest, ctx: _Context, tpl: Template) -> list[float]:
    """Per link of a template: latency + the boundary bytes times the copies a rank
    sends between the two degrees (``evaluate.send_copies``). Memoised per context:
    every grouping's estimate asks again for the same few templates."""
    got = ctx.sends.get(tpl)
    if got is None:
        got = ctx.sends[tpl] = _link_ms(req, ctx, tpl)
    return got


Link = tuple[int, int, str | None, str | None]  # _one_link_ms's arguments


def _link_ms(req: SearchRequest, ctx: _Context, tpl: Template) -> list[float]:
    """Per link of ``tpl``: latency + transfer of the boundary bytes (``_sends``),
    each distinct link (its two classes, and its two hosts or whether it stays on
    one) memoised per context: templates on 1024 GPUs run to 50 stages, built
    from a few classes and links."""
    links: dict[Link, float] = ctx.memo.setdefault("links", {})
    pairs = list(zip(tpl.classes, tpl.classes[1:], strict=False))
    keys: list[Link]
    if tpl.hosts:  # host-aligned: the links between the stage hosts are known
        keys = [(a, b, tpl.hosts[s], tpl.hosts[s + 1]) for s, (a, b) in enumerate(pairs)]
    else:  # "" "": inside one host; None None: the slowest link between hosts
        fits = [tpl.num_stages <= min(c.groups_per_host) for c in ctx.classes]
        keys = [(a, b, "", "") if a == b and fits[a] else (a, b, None, None) for a, b in pairs]
    out = []
    for key in keys:
        got = links.get(key)
        if got is None:
            got = links[key] = _one_link_ms(req, ctx, *key)
        out.append(got)
    return out


def _one_link_ms(
    req: SearchRequest, ctx: _Context, a: int, b: int, src: str | None, dst: str | None
) -> float:
    """One link of ``_link_ms``: from a stage of class ``a`` on host ``src`` to one
    of class ``b`` on ``dst`` (both "": inside one host; both None: hosts not
    known, the cluster's slowest link)."""
    latency = req.tables.p2p_latency_ms(ctx.classes[a].gpu_type, ctx.classes[b].gpu_type)
    nbytes = ctx.stats[a].out_bytes * send_copies(ctx.classes[a].tp, ctx.classes[b].tp)
    if src is None or dst is None:
        gbps = _slowest_link(req.cluster)
    elif src == "":
        gbps = ctx.classes[a].intra_node_gbps
    else:
        gbps = req.cluster.link_gbps(src, dst)
    return latency + transfer_ms(nbytes, gbps)


def _sync_rate(
    req: SearchRequest,
    ctx: _Context,
    parts: Sequence[tuple[Template, int]],
    *,
    optimistic: bool = False,
) -> tuple[float, bool]:
    """Ring all-reduce ms per parameter of one stage, across all pipelines, and
    whether it is per *full* parameter (to be multiplied by the class's TP degree
    times its per-GPU parameters).

    Placement fills hosts in order, so a grouping whose groups fit on one host
    syncs over that host's links, per parameter a GPU holds; otherwise over the
    slowest inter-host link, where a TP group's rings share its host's NIC (and a
    full-gradient sync between degrees moves the full gradient too): per full
    parameter. ``optimistic`` takes the fastest link any segment could use, per
    parameter a GPU holds, which keeps lower bounds valid whatever the placement.
    """
    low, rate = _sync_rates(req, ctx, parts)
    return (low, False) if optimistic else rate


def _sync_rates(
    req: SearchRequest, ctx: _Context, parts: Sequence[tuple[Template, int]]
) -> tuple[float, tuple[float, bool]]:
    """``_sync_rate`` both ways from one pass over the grouping: the optimistic
    rate (for its lower bound) and (rate, per full parameter) for its estimate;
    every grouping asks for both (10^5 of them on 1024 GPUs)."""
    d = sum(k for _, k in parts)
    nbytes = req.tables.training.grad_bytes_per_param
    used = [0] * len(ctx.classes)
    counts: dict[Template, tuple[tuple[int, int], ...]] = ctx.memo.setdefault("counts", {})
    for tpl, k in parts:
        per_class = counts.get(tpl)
        if per_class is None:  # stages per class: templates run to 50 stages of few classes
            per_class = counts[tpl] = tuple(Counter(tpl.classes).items())
        for c, n in per_class:
            used[c] += k * n
    fixed = _context_rates(req, ctx)
    intra = max(g for g, n in zip(fixed["intra"], used, strict=True) if n)
    aligned = all(tpl.hosts for tpl, _ in parts)
    if aligned:
        slowest_intra = min(_hosts_intra(req, ctx, tpl) for tpl, _ in parts)
        low = ring_allreduce_ms(nbytes, d, slowest_intra)
    else:  # no ZeRO-1 factor either: it is 1 for a tied layer's share
        low = ring_allreduce_ms(nbytes, d, max(intra, fixed["fastest"]))
    # ZeRO-1's reduce-scatter + all-gather against the all-reduce (costmodel.evaluate);
    # segments held at two degrees sync the full gradient, unsharded: no factor
    uniform = len({c.tp for c, n in zip(ctx.classes, used, strict=True) if n}) == 1
    f = max(fixed["zero1"][c] for c, n in enumerate(used) if n) if d > 1 and uniform else 1.0
    if aligned:  # stage-major: each stage's copies on one host
        return low, (f * low, False)
    hosts = sum(  # the hosts a class's groups fill, in order, to hold ``need`` of them
        min(bisect_left(cum, need) + 1, len(cum))
        for cum, need in zip(fixed["cumulative"], used, strict=True)
        if need > 0
    )
    if hosts > 1:
        return low, (f * ring_allreduce_ms(nbytes, d, fixed["slowest"]), True)
    return low, (f * ring_allreduce_ms(nbytes, d, intra), False)


def _context_rates(req: SearchRequest, ctx: _Context) -> dict[str, Any]:
    """Per class: its all-reduce rate inside a host and the running count of its
    groups host by host; the cluster's fastest and slowest links (memoised)."""
    got = ctx.memo.get("rates")
    if got is None:
        got = ctx.memo["rates"] = {
            "intra": [_allreduce_gbps(req, c.gpu_type, c.intra_node_gbps) for c in ctx.classes],
            "cumulative": [list(accumulate(c.groups_per_host)) for c in ctx.classes],
            "fastest": max([req.cluster.inter_node_gbps, *req.cluster.pair_gbps.values()]),
            "slowest": _slowest_link(req.cluster),
            "zero1": [
                req.tables.spec(c.gpu_type).fixed.zero1_sync_factor
                if req.tables.training.zero1
                else 1.0
                for c in ctx.classes
            ],
        }
    return got


def _hosts_intra(req: SearchRequest, ctx: _Context, tpl: Template) -> float:
    """The slowest one-host all-reduce rate among a host-aligned template's hosts."""
    key = ("hosts_intra", tpl)
    got = ctx.memo.get(key)
    if got is None:
        got = ctx.memo[key] = min(
            _allreduce_gbps(req, req.cluster.host(h).gpu_type, req.cluster.host(h).intra_node_gbps)
            for h in tpl.hosts
        )
    return float(got)


def _allreduce_gbps(req: SearchRequest, gpu_type: str, nominal_gbps: float) -> float:
    """The rate of a one-host all-reduce of this GPU type: the probe's measured fit
    (``DeviceFacts.allreduce_gbytes_s``, what the final evaluation charges) when the
    profile has one, else the host's nominal link speed."""
    measured = req.tables.allreduce_gbps(gpu_type)
    return nominal_gbps if measured is None else measured


def _estimate(
    req: SearchRequest,
    ctx: _Context,
    parts: Sequence[tuple[Template, int]],
    M: int,
    sync: tuple[float, bool] | None = None,
) -> float:
    """Balanced continuous split per template; micro-batches shared so that all
    pipelines finish together, then rounded (cheap enough for 10^5 groupings).
    ``sync``: ``_sync_rate`` of the grouping, where the caller has it."""
    got = ctx.memo.get("blocks")
    if got is None:
        got = ctx.memo["blocks"] = block_range(req.model)
    a, b = got
    n = b - a
    upd = 0.0
    params = 0.0
    shapes = []
    rate, per_full = sync or _sync_rate(req, ctx, parts)
    for tpl, k in parts:
        c_ms, fill_ms, tpl_upd, tpl_params = _shape(req, ctx, tpl, n, per_full)
        shapes.append((k, c_ms, fill_ms))
        upd = max(upd, tpl_upd)
        params = max(params, tpl_params)
    pipes = sum(k for k, _, _ in shapes)
    t_ms = (M - pipes + sum(k * f / c for k, c, f in shapes)) / sum(k / c for k, c, _ in shapes)
    t_ms = max(t_ms, max(f for _, _, f in shapes))
    ms = [max(1, int((t_ms - f) / c) + 1) for _, c, f in shapes]
    left = M - sum(k * m for (k, _, _), m in zip(shapes, ms, strict=True))
    while left > 0:  # rounding down left a few micro-batches: give them out
        j = min(range(len(shapes)), key=lambda i: ms[i] * shapes[i][1] + shapes[i][2])
        ms[j] += 1
        left -= shapes[j][0]
    t_ms = max((m - 1) * c + f for (_, c, f), m in zip(shapes, ms, strict=True))
    total = t_ms + upd * _update_scale(req, pipes) + rate * params
    if req.objective == "cost":
        used = {c for tpl, _ in parts for c in tpl.classes}
        price = sum(req.cluster.host(h).price_per_hour for c in used for h in ctx.classes[c].hosts)
        return total * max(price, 1e-9)
    return total


def _shape(
    req: SearchRequest, ctx: _Context, tpl: Template, n: int, per_full: bool
) -> tuple[float, float, float, float]:
    """A template's balanced continuous split (``_estimate``): its bottleneck and
    fill ms per micro-batch, its update ms and the parameters its fullest stage
    syncs; memoised per context (groupings share their few templates)."""
    key = ("shape", tpl, per_full)
    got = ctx.memo.get(key)
    if got is None:
        st = [ctx.stats[c] for c in tpl.classes]
        inv = sum(1.0 / s.block_ms for s in st)
        fixed = (st[0].head_ms / st[0].block_ms) + (st[-1].tail_ms / st[-1].block_ms)
        sends = _sends(req, ctx, tpl)
        c_ms = max((n + fixed) / inv, 2 * max(sends, default=0.0))
        held = [
            ctx.stats[c].block_params * (ctx.classes[c].tp if per_full else 1) for c in tpl.classes
        ]
        got = ctx.memo[key] = (
            c_ms,
            c_ms * tpl.num_stages + 2 * sum(sends),
            max(s.total_upd_ms for s in st) / tpl.num_stages,
            max(held) * n / tpl.num_stages,
        )
    return got


def _solve_grouping(
    req: SearchRequest,
    ctx: _Context,
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
    sync, per_full = _sync_rate(req, ctx, g.parts)
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
            split = _split(
                req, ctx, tpl, m, sync, b - a, cap, per_full=per_full, replicas=g.num_pipelines
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


def _split(
    req: SearchRequest,
    ctx: _Context,
    tpl: Template,
    m_hat: int,
    sync: float,
    num_blocks: int,
    cap: float,
    *,
    per_full: bool = False,
    replicas: int = 1,
) -> SplitResult | None:
    key = (tpl.classes, m_hat, round(sync, 12), per_full, replicas)
    if key not in ctx.splits:
        got = solve_split(
            SplitInputs(
                template=tpl,
                stats=ctx.stats,
                mem_cap_bytes=ctx.caps,
                state_bytes_per_param=_state_bytes(req, replicas),
                # tied embedding and head: ZeRO-1 leaves their state replicated
                end_state_bytes_per_param=_state_bytes(
                    req, 1 if req.model.tied_embeddings else replicas
                ),
                num_blocks=num_blocks,
                update_scale=_update_scale(req, replicas),
                end_update_scale=_update_scale(req, replicas, tied=True),
                send_ms=_sends(req, ctx, tpl),
                sync_ms_per_param=sync,
                sync_scale=[float(c.tp) if per_full else 1.0 for c in ctx.classes],
                expected_microbatches=m_hat,
            ),
            time_limit_s=cap,
        )
        if got is None and last_status() == "time_limit":
            return None  # no split found in time: not "none fits", so not remembered
        ctx.splits[key] = got
    return ctx.splits[key]


def _describe(g: Grouping, ctx: _Context) -> str:
    parts = []
    for tpl, k in g.parts:
        names = [ctx.classes[c].gpu_type for c in tpl.classes]
        runs: list[str] = []
        for name in dict.fromkeys(names):
            runs.append(f"{names.count(name)}x{name}")
        parts.append(f"{k}x[{'+'.join(runs)}]")
    return " ".join(parts)


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
