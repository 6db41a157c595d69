"""GPT-1.3B planned on small clusters: what the planner decision tests (ZeRO-1, the
bound, the parallel planner) share."""

from __future__ import annotations

from typing import Any

from autohet_cli.costmodel.tables import CostTables
from autohet_cli.models import get_model
from autohet_cli.planner.api import PlanOutcome, make_plan, training_for
from tests.bruteforce import tiny_cluster

GPT13 = get_model("GPT-1.3B")
# Four V100-16 in one host, GPT-1.3B, batch 16: without ZeRO-1 the best plan is two
# TP-2 pipelines at micro-batch 1 and 94% memory; sharding Adam's moments over the
# two leaves room for micro-batch 2, which is faster.
V100_QUAD = tiny_cluster((("v0", "V100-16", 4, None),), name="v100-quad")


def plan_gpt13(cluster: Any, batch: int, *, time_limit_s: float = 20.0, **kw: Any) -> PlanOutcome:
    """make_plan for GPT-1.3B (seq 1024, bf16, Adam) at global batch ``batch``;
    ``kw``: make_plan's other options."""
    training = training_for(batch, 1024, "bf16", "adam")
    return make_plan(
        name="p",
        cluster=cluster,
        model=GPT13,
        tables=CostTables(GPT13, None, training),
        global_batch_size=batch,
        time_limit_s=time_limit_s,
        **kw,
    )
