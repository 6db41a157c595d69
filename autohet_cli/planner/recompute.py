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
from autohet_cli.plan import Pipeline
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
    """``cand`` with recomputation kept only on the stages that need it to fit."""
    if not any(s.recompute for p in cand.pipelines for s in p.stages):
        return cand
    plain = [
        replace(p, stages=tuple(replace(s, recompute=False) for s in p.stages))
        for p in cand.pipelines
    ]
    ev_plain = evaluate(plain, req.cluster, req.tables, cand.mbs)
    mixed = [
        replace(
            p,
            stages=tuple(
                replace(s, recompute=s.recompute and pe.stages[i].mem_fraction > 1.0)
                for i, s in enumerate(p.stages)
            ),
        )
        for p, pe in zip(cand.pipelines, ev_plain.pipelines, strict=True)
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

    Per stage the count is found by bisection, every stage at once: a stage's memory
    depends on its own count only, and falls as the count grows (a recomputed layer
    keeps its input instead of its activations; the one layer at work that it adds
    is less than that, bar the first), while its time grows with it: so the least
    count that fits is that stage's best. The result is checked whole on the exact
    model and kept only if it fits and is no worse."""
    where = [
        (pi, si)
        for pi, p in enumerate(cand.pipelines)
        for si, s in enumerate(p.stages)
        if s.recompute and s.num_layers > 1
    ]
    if not where:
        return cand
    lo = dict.fromkeys(where, 0)  # does not fit (relax: it needs recomputation)
    hi = {k: cand.pipelines[k[0]].stages[k[1]].num_layers for k in where}  # fits
    while any(hi[k] - lo[k] > 1 for k in where):
        mid = {k: (lo[k] + hi[k]) // 2 if hi[k] - lo[k] > 1 else hi[k] for k in where}
        pipes = _with_counts(cand.pipelines, mid)
        ev = evaluate(pipes, req.cluster, req.tables, cand.mbs)
        for k in where:
            if hi[k] - lo[k] > 1:
                if ev.pipelines[k[0]].stages[k[1]].mem_fraction <= 1.0:
                    hi[k] = mid[k]
                else:
                    lo[k] = mid[k]
    pipes = _with_counts(cand.pipelines, hi)
    ev = evaluate(pipes, req.cluster, req.tables, cand.mbs)
    if not ev.fits:
        return cand
    fewer = replace(cand, pipelines=pipes, eval=ev, score=score(pipes, ev))
    return fewer if fewer.score <= cand.score else cand


def _with_counts(pipes: list[Pipeline], counts: dict[tuple[int, int], int]) -> list[Pipeline]:
    """``pipes`` with stage (pi, si) recomputing its first ``counts[(pi, si)]`` layers
    (all of them: ``recompute: true``)."""
    out = []
    for pi, p in enumerate(pipes):
        stages = []
        for si, s in enumerate(p.stages):
            n = counts.get((pi, si))
            if n is not None:
                full = n >= s.num_layers
                s = replace(s, recompute=full, recompute_layers=0 if full else n)
            stages.append(s)
        out.append(replace(p, stages=tuple(stages)))
    return out
