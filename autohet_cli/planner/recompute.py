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
   the most micro-batches in flight.

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
    return better if better.score <= cand.score else cand
