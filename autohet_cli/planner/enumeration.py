"""Enumerating a search's groupings (pure): its contexts (one TP degree for all
GPU types, then per-type degrees, most promising first), and in each, every
grouping of pipeline shapes that fit each class's memory, with its valid lower bound
(groups.lower_bound_ms) and quick estimate (``estimate.estimate_ms``), as a heap by
estimate."""

from __future__ import annotations

import heapq
import time
from collections.abc import Mapping
from dataclasses import replace
from itertools import chain, product

from autohet_cli.planner.estimate import (
    Context,
    estimate_ms,
    gathered_bytes,
    state_bytes,
    sync_rates,
    update_scale,
)
from autohet_cli.planner.groups import (
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
from autohet_cli.planner.request import Progress, SearchRequest

MAX_OPTIONS_PER_CLASS = 8
ENUMERATE_SHARE = 0.4  # of the time limit, at most, for building and bounding groupings
MAX_DEGREE_COMBOS = 9  # per-type degree combinations per micro-batch size tried in full
DEGREES_PER_TYPE = 2  # beyond that, each GPU type's best degrees combined


# Per-type contexts are enumerated, most promising first, until they have given
# MIXED_SHARE times the groupings of the one-degree contexts (at least MIXED_FLOOR):
# on big clusters each context costs ~0.5 s of estimates, and the planner speed
# targets leave room for about half as many again.
MIXED_SHARE = 0.5
MIXED_FLOOR = 5000


Queue = list[tuple[float, int, Grouping, "Context"]]


def enumerate_groupings(req: SearchRequest, start: float, note: Progress) -> tuple[Queue, bool]:
    """Every grouping of every context with its bound and estimate, as a heap by
    estimate; and whether some degree combinations were left out."""
    queue: Queue = []
    uniform = mixed = 0  # groupings enumerated in one-degree and per-type contexts
    contexts, incomplete = search_contexts(req)  # incomplete: some degree combinations left out
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
            for c, d in zip(ctx.classes, min_depths(req, ctx), strict=True)
        ]
        bounds: dict[Template, tuple[int, float, float]] = {}  # lower_bound_ms's, this context
        for parts in chain(
            enumerate_parts(ctx.classes, options, mixed_orders=True), aligned_parts(ctx.classes)
        ):
            if sum(k for _, k in parts) > M:
                continue
            if req.shard_weights and (len(parts) != 1 or parts[0][1] < 2):
                continue  # holders of one cut: one template, copied (request.shard_weights)
            low, rate = sync_rates(req, ctx, parts)
            if req.shard_weights:  # no end-of-step all-reduce: a bound must not count one
                low = 0.0
            lb = lower_bound_ms(
                parts,
                ctx.stats,
                M,
                low,
                ctx.params_per_gpu,
                update_scale=update_scale(req, sum(k for _, k in parts)),
                memo=bounds,
            )
            g = Grouping(tp=ctx.tp, mbs=ctx.mbs, parts=parts, lower_bound_ms=lb)
            est = estimate_ms(req, ctx, parts, M, rate)
            heapq.heappush(queue, (est, len(queue), g, ctx))
        if per_type:
            mixed += len(queue) - before
        else:
            uniform += len(queue) - before
        if queue and time.monotonic() > start + ENUMERATE_SHARE * req.time_limit_s:
            note(0.0, "time limit: stopped enumerating groupings early")
            break
    return queue, incomplete


def search_contexts(req: SearchRequest) -> tuple[list[tuple[Context, bool]], bool]:
    """(context, per-type degrees?): one degree for every type first (in degree,
    then micro-batch order), then the per-type combinations (``ranked_combos``),
    most promising first; and whether combinations were left out."""
    out = []
    max_gpus = max(h.num_gpus for h in req.cluster.hosts)
    batch_sizes = [m for m in req.mbs_candidates if req.global_batch_size % m == 0]
    for tp in req.tp_candidates:
        if tp > max_gpus:
            continue
        for mbs in batch_sizes:
            ctx = make_context(req, tp, mbs)
            if ctx is not None:
                out.append((ctx, False))
    combos = []
    trimmed = False
    for i, mbs in enumerate(batch_sizes):
        ranked, left_out = ranked_combos(req, mbs)
        trimmed = trimmed or left_out
        combos += [(rank, i, mbs, degrees) for rank, degrees in ranked]
    for _, _, mbs, degrees in sorted(combos, key=lambda x: x[:2]):
        ctx = make_context(req, degrees, mbs)
        # --measured-only may drop a type, leaving one degree: a uniform context
        if ctx is not None and len({c.tp for c in ctx.classes}) > 1:
            out.append((ctx, True))
    return out, trimmed


def make_context(req: SearchRequest, degrees: int | Mapping[str, int], mbs: int) -> Context | None:
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
    if req.shard_weights:  # the gathered weights are in the compute dtype: no cast copies
        # (costmodel.sharding), which would take 2 bytes a parameter off a V100's room;
        # a tied embedding and head stay whole, with their copies
        tied = req.model.tied_embeddings
        stats = [
            replace(
                st,
                block_cast=0.0,
                head_cast=st.head_cast if tied else 0.0,
                tail_cast=st.tail_cast if tied else 0.0,
            )
            for st in stats
        ]
    caps = [
        float(c.mem_bytes - req.tables.reserve_bytes(c.gpu_type) - gathered_bytes(req, c, st))
        for c, st in zip(classes, stats, strict=True)
    ]
    params = min(
        req.tables.table(c.gpu_type, c.tp, mbs, c.intra_node_gbps).params(0, req.model.num_layers)
        for c in classes
    )
    return Context(
        tp=max(c.tp for c in classes),
        mbs=mbs,
        classes=classes,
        stats=stats,
        caps=caps,
        params_per_gpu=params,
    )


def ranked_combos(req: SearchRequest, mbs: int) -> tuple[list[tuple[int, dict[str, int]]], bool]:
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
    ctx = make_context(req, {gpu_type: tp}, mbs)
    if ctx is None:
        return float("inf")
    M = req.global_batch_size // mbs
    best = float("inf")
    for c, d in zip(ctx.classes, min_depths(req, ctx), strict=True):
        if d is None:
            continue
        for depth, k in _trim(homogeneous_options(c.num_groups, d)):
            if k <= M:
                parts = ((Template(classes=(c.index,) * depth), k),)
                best = min(best, estimate_ms(req, ctx, parts, M))
    return best


def _allowed_classes(req: SearchRequest, classes: list[DeviceClass], mbs: int) -> list[DeviceClass]:
    """All classes, or with ``measured_only`` those measured at (their tp, mbs),
    renumbered so that a class's index stays its position (templates index by it)."""
    if not req.measured_only:
        return classes
    kept = [c for c in classes if req.tables.is_measured(c.gpu_type, c.tp, mbs)]
    return [replace(c, index=i) for i, c in enumerate(kept)]


def min_depths(req: SearchRequest, ctx: Context) -> list[int | None]:
    a, b = block_range(req.model)
    return [
        min_depth(st, cap, state_bytes(req, c.num_groups), b - a)
        for st, cap, c in zip(ctx.stats, ctx.caps, ctx.classes, strict=True)
    ]


def _trim(options: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Keep the shallowest shapes (most data parallelism) and a geometric spread
    of deeper ones, so big clusters do not explode the combinations."""
    if len(options) <= MAX_OPTIONS_PER_CLASS:
        return options
    head = options[:4]
    rest = options[4:]
    step = max(1, len(rest) // (MAX_OPTIONS_PER_CLASS - 4))
    return head + rest[::step][: MAX_OPTIONS_PER_CLASS - 4]
