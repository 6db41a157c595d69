"""Activation recomputation as a planner decision, per stage (pure).

Recomputing a stage's activations costs about a third more compute on that stage
and frees most of its activation memory; it pays only where memory binds. The
decision is made in two steps:

1. **Which space.** The search runs without recomputation. Only when memory binds
   (no plan fits, or the best one fills some GPU beyond ``MEMORY_TIGHT``: the next
   larger micro-batch, fewer stages or a GPU type left idle would not fit) do more
   searches run, together in at most the time the first took: in the space where
   every stage recomputes, and, on a mixed cluster, in each space where one GPU
   type's stages recompute and the others' do not (a small-memory fast card that
   recomputes to hold more layers beside plain slow ones; ``SearchRequest.
   recompute_types``). The fastest plan wins.
2. **Which stages.** For a fixed layout, each stage's memory depends only on its
   own flag (its layers, its position in the 1F1B schedule, its micro-batches),
   and turning recomputation off only makes it faster. So the best choice per
   stage is exact and greedy: recompute exactly the stages that would not fit
   without it (``relax``). In 1F1B that is typically the first stages, which keep
   the most micro-batches in flight. Each of those then recomputes only as many of
   its first layers as it needs to fit (``fewest_layers``, ``recompute: N`` in the
   plan, issue 48): the rest keep their activations and skip the re-run forward.

The search itself assumes one flag per GPU type while choosing the layout; a
layout that would be better with flags mixed within one type is found only as
far as step 2 improves the one found. On the brute-force cases
(tests/unit/test_planner_bruteforce.py), with mixed flags in the optimum, the
per-type spaces took the planner from 12% and 27% above the optimum to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from autohet_cli.costmodel.evaluate import PlanEval, evaluate
from autohet_cli.plan import Pipeline, Stage
from autohet_cli.planner.search import Candidate, SearchRequest

MEMORY_TIGHT = 0.8  # peak memory fraction above which recomputation may pay


def memory_binds(best: Candidate | None) -> bool:
    """Whether recomputation could make a better plan than ``best`` (None: no plan fit)."""
    return best is None or best.eval.memory_peak_fraction > MEMORY_TIGHT


def relax(
    cand: Candidate,
    req: SearchRequest,
    score: Callable[[list[Pipeline], PlanEval], float],
) -> Candidate:
    """``cand`` with recomputation kept only on the stages that need it to fit (on
    every holder of a weight-sharded stage where one of them needs it, ``_unit``)."""
    if not any(s.recompute for p in cand.pipelines for s in p.stages):
        return cand
    plain = [
        replace(p, stages=tuple(replace(s, recompute=False) for s in p.stages))
        for p in cand.pipelines
    ]
    ev_plain = evaluate(plain, req.cluster, req.tables, cand.mbs)
    need = {
        _unit(pi, s)
        for pi, (p, pe) in enumerate(zip(cand.pipelines, ev_plain.pipelines, strict=True))
        for s, se in zip(p.stages, pe.stages, strict=True)
        if s.recompute and se.mem_fraction > 1.0
    }
    mixed = [
        replace(
            p,
            stages=tuple(
                replace(s, recompute=s.recompute and _unit(pi, s) in need) for s in p.stages
            ),
        )
        for pi, p in enumerate(cand.pipelines)
    ]
    ev = evaluate(mixed, req.cluster, req.tables, cand.mbs)
    if not ev.fits:
        return cand
    better = replace(cand, pipelines=mixed, eval=ev, score=score(mixed, ev))
    better = fewest_layers(better, req, score)
    return better if better.score <= cand.score else cand


def fewest_layers(
    cand: Candidate,
    req: SearchRequest,
    score: Callable[[list[Pipeline], PlanEval], float],
) -> Candidate:
    """``cand`` with each recomputing stage recomputing only as many of its first
    layers as it needs to fit (``recompute: N``), where that is fewer than all.

    Per stage the count is found by bisection, every stage at once (the holders of a
    weight-sharded stage as one: the least count that fits them all, ``_unit``): a stage's memory
    depends on its own count only, and falls as the count grows (a recomputed layer
    keeps its input instead of its activations; the one layer at work that it adds
    is less than that, bar the first), while its time grows with it: so the least
    count that fits is that stage's best. The result is checked whole on the exact
    model and kept only if it fits and is no worse."""
    units: dict[tuple[object, ...], list[tuple[int, int]]] = {}
    for pi, p in enumerate(cand.pipelines):
        for si, s in enumerate(p.stages):
            if s.recompute and s.num_layers > 1:
                units.setdefault(_unit(pi, s), []).append((pi, si))
    if not units:
        return cand
    lo = dict.fromkeys(units, 0)  # does not fit (relax: it needs recomputation)
    hi = {k: cand.pipelines[m[0][0]].stages[m[0][1]].num_layers for k, m in units.items()}
    while any(hi[k] - lo[k] > 1 for k in units):
        mid = {k: (lo[k] + hi[k]) // 2 if hi[k] - lo[k] > 1 else hi[k] for k in units}
        pipes = _with_counts(cand.pipelines, units, mid)
        ev = evaluate(pipes, req.cluster, req.tables, cand.mbs)
        for k, members in units.items():
            if hi[k] - lo[k] > 1:
                if all(ev.pipelines[pi].stages[si].mem_fraction <= 1.0 for pi, si in members):
                    hi[k] = mid[k]
                else:
                    lo[k] = mid[k]
    pipes = _with_counts(cand.pipelines, units, hi)
    ev = evaluate(pipes, req.cluster, req.tables, cand.mbs)
    if not ev.fits:
        return cand
    fewer = replace(cand, pipelines=pipes, eval=ev, score=score(pipes, ev))
    return fewer if fewer.score <= cand.score else cand


def _unit(pi: int, s: Stage) -> tuple[object, ...]:
    """What recomputes as one: a weight-sharded stage with every holder of its cut
    (FSDP's backward gathers come in one order on all of them, Plan.validate), any
    other stage on its own."""
    if s.shard == "weights":
        return ("holders", s.layer_start, s.layer_end)
    return ("stage", pi, s.layer_start)


def _with_counts(
    pipes: list[Pipeline],
    units: dict[tuple[object, ...], list[tuple[int, int]]],
    counts: dict[tuple[object, ...], int],
) -> list[Pipeline]:
    """``pipes`` with each unit's stages recomputing their first ``counts[unit]``
    layers (all of them: ``recompute: true``)."""
    at = {m: counts[k] for k, members in units.items() for m in members}
    out = []
    for pi, p in enumerate(pipes):
        stages = []
        for si, s in enumerate(p.stages):
            n = at.get((pi, si))
            if n is not None:
                full = n >= s.num_layers
                s = replace(s, recompute=full, recompute_layers=0 if full else n)
            stages.append(s)
        out.append(replace(p, stages=tuple(stages)))
    return out
