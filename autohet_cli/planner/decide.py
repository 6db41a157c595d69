"""ZeRO-1 and activation recomputation as planner decisions, around the search.

ZeRO-1 (``training.zero1``, runtime.zero) costs no time in the cost model: the
reduce-scatter plus all-gather move the all-reduce's bytes, and each of the P
holders of a segment steps 1/P of its update and keeps 1/P of its optimizer state.
Recomputation (planner.recompute) costs a third more compute on a stage and frees
most of its activations. So the free one is decided first, and recomputation is
searched on top of whichever space won, only where memory still binds:

1. **Plain search**, neither on.
2. **ZeRO-1.** The plain result's best plan and its runners-up, re-evaluated with
   their state sharded (one evaluation each: the update shrinks). Where memory binds
   (or nothing fit), also a search in the sharded space, in at most as long as the
   plain search took (all the time left where nothing fit): layouts that only fit
   sharded (fewer, wider stages, more pipelines, a larger micro-batch). That search
   is told what it must beat (``SearchRequest.must_beat_ms``: the threshold below
   the plain plan, or a re-scored layout in hand) and solves no grouping whose lower
   bound says it cannot; where none can, it costs its enumeration alone.
   ZeRO-1 is adopted only where it makes the plan at least ``ZERO1_MIN_GAIN``
   faster (cheaper, under ``--objective cost``) and shards something (P >= 2
   pipelines hold a segment at one degree). Below that the gain is inside the cost
   model's error, and the replicated optimizer is simpler to run: a checkpoint
   save needs no all-gather of the optimizer state.
3. **Recomputation** (``recompute_spaces``), in the chosen space, where memory still
   binds, again in at most as long as the plain search took. Where a core is free
   (``planner.parallel``) it starts in the plain space beside step 2's sharded
   search, and is used when step 2 keeps the plain space (searched again in the
   sharded one otherwise): the same result, one search earlier.

4. **Sharded weights** (``planner.weights``, issue 48), where memory still binds
   (or nothing fit): the weight-sharded space (one template copied k >= 2
   times), in at most ``WEIGHTS_SPACE_TIMES`` as long as the plain search took, so
   that planning stays within its speed targets; adopted where it makes the plan
   ``WEIGHTS_MIN_GAIN`` faster, each stage column tuned (sharded, kept gathered or
   replicated). The baselines stay in the space step 3 left.

Not searched: the sharded space where memory does not bind. A layout that only
sharding makes fastest is then found only among the plain search's runners-up;
searching it everywhere would double planning time for gains of the order of the
update time (the brute-force cases, tests/unit/test_planner_bruteforce.py, say
how far that leaves the planner from the optimum).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from autohet_cli.costmodel.budget import seconds_left
from autohet_cli.costmodel.evaluate import PlanEval, evaluate, zero_sharded
from autohet_cli.errors import InfeasibleError, TimeLimitReached
from autohet_cli.plan import Pipeline
from autohet_cli.planner import parallel, weights
from autohet_cli.planner.phases import phase
from autohet_cli.planner.recompute import memory_binds, relax
from autohet_cli.planner.search import (
    Candidate,
    Progress,
    SearchRequest,
    SearchResult,
    scorer,
    search,
)

Scorer = Callable[[list[Pipeline], PlanEval], float]

ZERO1_MIN_GAIN = 0.01  # relative gain below which the replicated optimizer is kept
# The sharded space's search may take this many times as long as the plain one: a
# search enumerates groupings for a share of its limit, and sharding admits more of
# them (shallower pipelines); with the plain search's time it missed a plan 12%
# faster on scale-1024 (benchmarks/planner_speed.py) that this finds.
ZERO1_SPACE_TIMES = 1.5
WEIGHTS_SPACE_TIMES = 0.5  # the weight-sharded space (planner.weights): one template
MIN_SPACE_S = 0.5  # a space given less time than this is not searched (a plan exists)
# The weight-sharded space's floor: its best groupings are often per-type TP degrees,
# which come late in its queue; OPT-30B on 64 GPUs found them in 0.16 s of 0.5 s on an
# idle machine, a margin a loaded one can eat (64 GPUs still plan within 3 s).
WEIGHTS_MIN_S = 1.0


def decide(
    req: SearchRequest,
    progress: Progress | None,
    *,
    recompute: bool | None,
    zero1: bool | None,
    shard_weights: bool | None = None,
    on_plain: Callable[[bool], None] | None = None,
) -> tuple[SearchResult, SearchRequest, tuple[str, ...], SearchRequest | None]:
    """The search under the user's flags, each None one decided here; the result,
    the request it was found under (for baselines and contingency plans: its tables
    carry the ZeRO-1 decision), a note saying what ZeRO-1 did, if it was decided,
    and, where the chosen space was not searched itself (ZeRO-1 adopted by
    re-evaluating the plain search's layouts), the space that was: the baselines
    are then searched there and re-evaluated in the chosen one
    (``reevaluated``), as the plan was. ``on_plain`` hears, once the plain search
    is done, whether a search in another space may follow (memory binds)."""
    start = time.monotonic()
    first = first_space(req, recompute=recompute, zero1=zero1)
    found: SearchResult | None = None
    failure: Exception | None = None
    try:
        found = search(first, progress)
    except TimeLimitReached:
        raise  # out of time, not of memory: more spaces would not help
    except InfeasibleError as exc:
        failure = exc
    spent = time.monotonic() - start
    # judged on the plain search's own best, before step 2 may replace it
    plain_binds = found is None or memory_binds(found.best)
    if on_plain is not None:
        on_plain(plain_binds)

    def budget(times: float = 1.0) -> float:
        """``times`` as long as the plain search took (at least a second), within
        the limit; where nothing fit, what the limit leaves."""
        left = req.time_limit_s - (time.monotonic() - start)
        return left if found is None else min(left, max(1.0, times * spent))

    # Where memory binds, recomputation will be searched in the space ZeRO-1 leaves;
    # that is the plain one unless sharding wins. So the plain space's recomputation
    # search starts now on the other core, beside the sharded search (issue 32: on
    # 1024 GPUs the two took 10 and 9 s one after the other); it is used only where
    # ZeRO-1 kept the plain result, else dropped and searched again in the sharded space.
    ahead = None
    if zero1 is None and recompute is None and found is not None and plain_binds:
        # (crowd=1: beside the baselines' child too, which is done before this
        # process is, while this search would be on the critical path)
        ahead = parallel.ahead(partial(_recompute_in, found, first, budget()), crowd=1)
    try:
        result, space, note = found, first, None
        if zero1 is None:
            with phase("zero1"):
                result, space, note = _choose_zero1(
                    first, found, progress, budget(ZERO1_SPACE_TIMES)
                )
        # the sharded space chosen on the plain search's layouts alone (memory did not
        # bind, so no search ran in it): the baselines follow the same method
        searched_in = None
        if result is found and space is not first and not plain_binds:
            searched_in = first
        if recompute is None and memory_binds(result.best if result else None):
            try:
                with phase("recompute"):
                    if (
                        ahead is not None
                        and found is not None
                        and result is found
                        and space is first
                    ):
                        result, space = _recompute_from(ahead, found, first)
                    else:
                        if ahead is not None:  # the sharded space won: not wanted
                            ahead.cancel()
                        result, space = recompute_spaces(result, space, progress, budget())
            except (InfeasibleError, TimeLimitReached) as exc:
                if isinstance(exc, TimeLimitReached) or not weights.wanted(None, shard_weights):
                    raise (failure or exc) from None
                failure, result = failure or exc, None  # sharded weights may still fit
        weights_note = None
        # at most WEIGHTS_SPACE_TIMES the plain search's time (all that is left where
        # nothing fit or the user asked for it)
        weights_s = budget()
        if result is not None and not shard_weights:
            weights_s = min(weights_s, max(WEIGHTS_MIN_S, WEIGHTS_SPACE_TIMES * spent))
        if weights.wanted(result, shard_weights) and weights_s >= MIN_SPACE_S / 2:
            with phase("weights"):
                result, weights_note = weights.choose_weights(
                    space,
                    result,
                    progress,
                    weights_s,
                    forced=shard_weights is True,
                    recompute=recompute,
                )
    finally:
        if ahead is not None:
            ahead.cancel()
    if result is None:
        assert failure is not None
        raise failure
    if zero1 is None and space.tables.training.zero1:
        if not _shards(result.best, space):
            space = _zero1(space, False)  # its best shards nothing: no flag to carry
            note = None
            searched_in = None
        elif note is None:  # nothing fit plain, nor sharded without recomputation
            why = "no plan fit without it or recomputation, and it costs no time"
            note = _chosen_note(result.best, why)
    if result is not found:
        result.time_s = time.monotonic() - start
        searched_in = None  # recomputation searched the space it chose
    return result, space, tuple(x for x in (note, weights_note) if x), searched_in


def reevaluated(
    cands: dict[str, Candidate | None], space: SearchRequest
) -> dict[str, Candidate | None]:
    """Candidates found in another space (the baselines of the plain search)
    scored in ``space``: what ``decide`` does to the plain search's layouts when it
    adopts ZeRO-1 without searching the sharded space, so that plan and baselines
    are compared by one method (issue 32: searching the baselines again in the
    sharded space doubled their time, 3.3 s on 256 GPUs, for gains of the order of
    the update's). A layout that does not fit there keeps its old score."""
    score = scorer(space.cluster, space.objective)
    out: dict[str, Candidate | None] = {}
    for name, cand in cands.items():
        if cand is not None:
            ev = evaluate(cand.pipelines, space.cluster, space.tables, cand.mbs)
            if ev.fits:
                cand = replace(cand, eval=ev, score=score(cand.pipelines, ev))
        out[name] = cand
    return out


def first_space(req: SearchRequest, *, recompute: bool | None, zero1: bool | None) -> SearchRequest:
    """The space the plain search runs in (step 1): the user's flags, None as off."""
    return replace(_zero1(req, bool(zero1)), recompute=bool(recompute), recompute_types=frozenset())


def same_space(a: SearchRequest, b: SearchRequest) -> bool:
    """Whether two requests search the same space (baselines in one serve the other)."""
    return (
        a.tables.training == b.tables.training
        and a.recompute == b.recompute
        and a.recompute_types == b.recompute_types
        and a.cluster is b.cluster
    )


def _zero1(req: SearchRequest, on: bool) -> SearchRequest:
    return replace(req, tables=req.tables.with_zero1(on))


def _choose_zero1(
    plain: SearchRequest, found: SearchResult | None, progress: Progress | None, budget_s: float
) -> tuple[SearchResult | None, SearchRequest, str | None]:
    """Step 2 of the module docstring: (the result, its space, a note)."""
    score = scorer(plain.cluster, plain.objective)
    sharded = _zero1(plain, True)
    options: list[Candidate] = []
    if found is not None:
        for cand in (found.best, *found.runners_up):
            if _shards(cand, sharded):
                ev = evaluate(cand.pipelines, sharded.cluster, sharded.tables, cand.mbs)
                if ev.fits:
                    options.append(replace(cand, eval=ev, score=score(cand.pipelines, ev)))
    alt: SearchResult | None = None
    binds = found is None or memory_binds(found.best)
    if binds and (found is None or budget_s >= MIN_SPACE_S):
        # Item 3 of issue 32: only a sharded plan under ``must_beat_ms`` could be
        # chosen (ZeRO-1's threshold under the plain plan, or a re-scored layout in
        # hand), so the search leaves out every grouping whose bound says it cannot
        # get there; where none can, it solves nothing (NoBetterPlan).
        must_beat = None
        if found is not None and plain.objective == "time":
            must_beat = min([found.best.score * (1 - ZERO1_MIN_GAIN), *(c.score for c in options)])
        try:
            alt = search(
                replace(sharded, time_limit_s=max(budget_s, 0.1), must_beat_ms=must_beat),
                progress,
            )
            options.append(alt.best)
        except (InfeasibleError, TimeLimitReached):
            pass
    if found is None:
        if alt is None:
            return None, sharded, None  # recomputation is tried in the sharded space
        if not _shards(alt.best, sharded):
            return alt, plain, None
        why = "no plan fits without it unless activations are recomputed"
        return alt, sharded, _chosen_note(alt.best, why)
    best = min((c for c in options if _shards(c, sharded)), key=lambda c: c.score, default=None)
    if best is None or best.score >= found.best.score * (1 - ZERO1_MIN_GAIN):
        note: str | None = None
        if binds:
            note = "ZeRO-1 was considered (memory binds) and not used: it made no plan faster"
        elif best is not None:
            note = unused_note(1 - best.score / found.best.score)
        return found, plain, note
    # The gain against the plan without ZeRO-1 before ``result.best`` is replaced:
    # ``result`` may be ``found`` itself (issue 31: the note printed 0.0%).
    gain = 1 - best.score / found.best.score
    result = alt if alt is not None and best is alt.best else found
    result.best = best
    what = "cheaper per token" if plain.objective == "cost" else "faster"
    return result, sharded, _chosen_note(best, f"{gain:.1%} {what} than without it")


def unused_note(gain: float) -> str:
    """Why ZeRO-1 was left off, ``gain`` being its (maybe negative) relative gain."""
    if gain >= 0.0005:  # what prints as 0.1% or more
        return f"ZeRO-1 not used: it would make this plan only {gain:.1%} faster"
    return "ZeRO-1 not used: it would not make this plan faster"


def _chosen_note(cand: Candidate, why: str) -> str:
    return (
        f"ZeRO-1 chosen by the planner: the optimizer state is sharded over the "
        f"{len(cand.pipelines)} pipelines ({why}; --no-zero1 turns it off)"
    )


def _shards(cand: Candidate, req: SearchRequest) -> bool:
    """Whether ZeRO-1 shards any stage of ``cand`` (not one that shards its weights:
    ZeRO-1 leaves those alone, ``costmodel.evaluate``)."""
    sharded = zero_sharded(cand.pipelines, req.cluster, _zero1(req, True).tables, cand.mbs)
    return any(
        x > 0
        for p, row in zip(cand.pipelines, sharded, strict=True)
        for s, x in zip(p.stages, row, strict=True)
        if s.shard != "weights"
    )


def _recompute_in(
    result: SearchResult, req: SearchRequest, total_s: float
) -> tuple[SearchResult, int]:
    """``recompute_spaces`` for another process: the result and the index of its
    space in ``_spaces(req)`` (the requests, with their cost tables, stay here)."""
    best, space = recompute_spaces(result, req, None, total_s)
    flags = [(s.recompute, s.recompute_types) for s in _spaces(req)]
    key = (space.recompute, space.recompute_types)
    return best, (flags.index(key) if key in flags else -1)


def _recompute_from(
    ahead: parallel.Pending[tuple[SearchResult, int]], result: SearchResult, req: SearchRequest
) -> tuple[SearchResult, SearchRequest]:
    """What ``_recompute_in`` sent back, with its space rebuilt here; ``result`` in
    ``req`` where it has not answered by the deadline (as ``recompute_spaces`` keeps
    it when every search there runs out of time)."""
    plain = replace(req, recompute=False, recompute_types=frozenset())
    try:
        best, index = ahead.result(timeout_s=seconds_left())
    except TimeLimitReached:
        return result, plain
    if index < 0:  # nothing beat it: the result itself, not the child's copy of it
        return result, plain
    return best, _spaces(req)[index]


def _spaces(req: SearchRequest) -> list[SearchRequest]:
    """The recomputation spaces of ``req`` in search order: every stage
    recomputing, then each GPU type's stages alone (where the cluster mixes types)."""
    plain = replace(req, recompute=False, recompute_types=frozenset())
    types = sorted({h.gpu_type for h in req.cluster.hosts})
    spaces = [replace(plain, recompute=True)]
    if len(types) > 1:
        spaces += [replace(plain, recompute_types=frozenset({t})) for t in types]
    return spaces


def recompute_spaces(
    result: SearchResult | None,
    req: SearchRequest,
    progress: Progress | None,
    total_s: float,
) -> tuple[SearchResult, SearchRequest]:
    """Where memory binds on ``result`` (found without recomputation under ``req``),
    the spaces where every stage recomputes and where one GPU type's stages do, in
    ``total_s``, keeping recomputation per stage only where needed
    (``planner.recompute``); the best result and the request it was found under."""
    plain = replace(req, recompute=False, recompute_types=frozenset())
    if result is not None and total_s < MIN_SPACE_S:
        return result, plain
    spaces = _spaces(req)
    deadline = time.monotonic() + total_s
    best: tuple[SearchResult, SearchRequest] | None = (result, plain) if result else None
    failure: Exception | None = None
    for i, space in enumerate(spaces):
        left = deadline - time.monotonic()
        if left < MIN_SPACE_S and best is not None:
            break
        # every stage recomputing first (all the time left where nothing fit, else
        # half when per-type spaces follow), then the per-type spaces share the rest
        if i == 0:
            share = left / 2 if len(spaces) > 1 and result is not None else left
        else:
            share = left / (len(spaces) - i)
        try:
            alt = search(replace(space, time_limit_s=max(share, 0.1)), progress)
        except (InfeasibleError, TimeLimitReached) as exc:
            failure = failure or exc  # every stage recomputing: the most that can fit
            continue
        alt.best = relax(alt.best, space, scorer(req.cluster, req.objective))
        if best is None or alt.best.score < best[0].best.score:
            best = (alt, space)
    if best is None:
        assert failure is not None
        raise failure
    return best
