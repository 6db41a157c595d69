"""The lines of ``--explain`` that say what a plan's memory modes do (pure): activation
recomputation (every layer or the first N), sharded weights and ZeRO-1; split from
``planner.explain`` by what they describe."""

from __future__ import annotations

from autohet_cli.cluster import Cluster
from autohet_cli.plan import Plan, Stage, weight_sharded


def recompute_count(plan: Plan) -> tuple[int, int]:
    """(stages that recompute some activations, all stages) over every pipeline."""
    stages = [s for p in plan.pipelines for s in p.stages]
    return sum(s.recomputed > 0 for s in stages), len(stages)


def recompute_cell(s: Stage) -> str:
    """R: every layer recomputes; R 3/8: the stage's first 3 of its 8 layers."""
    if s.recomputed == s.num_layers:  # ``recompute: true`` included
        return "R"
    return f"R {s.recomputed}/{s.num_layers}" if s.recomputed else ""


def recompute_line(plan: Plan) -> str | None:
    """What recomputation costs and saves here; None when no stage recomputes."""
    n, total = recompute_count(plan)
    if not n:
        return None
    stages = [s for p in plan.pipelines for s in p.stages]
    partial = sum(0 < s.recomputed < s.num_layers for s in stages)
    if n == total and not partial:
        which = "every stage re-runs its forward before its backward"
    elif n == total:
        which = "every stage (marked R) re-runs its forward before its backward"
    else:
        which = f"{n} of {total} stages (marked R) re-run their forward before the backward"
    if partial:
        which += (
            f"; {partial} of them only for their first layers (R k/n: k of its n), as few "
            "as their memory needs"
        )
    return (
        f"Recompute: {which} (included in bwd ms), keeping only each recomputed layer's "
        "input per micro-batch in flight"
    )


def shard_cell(s: Stage) -> str:
    if s.shard != "weights":
        return "" if s.shard == "none" else s.shard
    return "weights" if s.reshard_after_forward else "weights, kept gathered"


def shard_line(plan: Plan, cluster: Cluster) -> str | None:
    """What weight sharding does here (issue 48); None when no stage shards its weights."""
    n = weight_sharded(plan.pipelines)
    if not n:
        return None
    stages = [s for p in plan.pipelines for s in p.stages]
    kept, total = sum(shard_cell(s) == "weights, kept gathered" for s in stages), len(stages)
    which = "every stage holds" if n == total else f"{n} of {total} stages (shard) hold"
    line = (
        f"Shard weights: {which} 1/{len(plan.pipelines)} of their weights, gradients "
        "and optimizer state, one slice per pipeline holding the same layers, and gather "
        "the weights before each micro-batch's forward and again before its backward"
    )
    if kept:
        line += (
            f"; {kept} of them (kept gathered) keep the gathered weights from the forward "
            "to the backward: one gather per micro-batch, for more memory"
        )
    assumed = sorted(
        {
            s.host
            for p in plan.pipelines
            for s in p.stages
            if s.shard == "weights" and s.tensor_parallel > 1 and cluster.host(s.host).nics is None
        }
    )
    if assumed and len(plan.hosts()) > 1:
        line += (
            f"; the gathers of TP ranks across hosts count on a NIC per GPU on {len(assumed)} "
            "host(s) whose cluster entry does not say `nics:` (the default): where their GPUs "
            "share fewer, say `nics: N` and plan again"
        )
    return line


def zero1_line(plan: Plan) -> str | None:
    """What ZeRO-1 does in this plan; None without it."""
    if not plan.training.zero1:
        return None
    if len(plan.pipelines) < 2:
        return "ZeRO-1: on, but one pipeline holds every layer, so nothing is sharded"
    return (
        f"ZeRO-1: the {len(plan.pipelines)} pipelines shard the optimizer state of each "
        "segment they hold at one TP degree (reduce-scatter, each steps its slice, "
        "all-gather; tied weights stay replicated)"
    )
