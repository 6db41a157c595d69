"""make_plan as tests and benchmarks call it (``plan_tables``, ``plan_inputs``), and
GPT-1.3B planned on small clusters: what the planner decision tests (ZeRO-1, the
bound, the parallel planner) share."""

from __future__ import annotations

from typing import Any

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.inputs import Inputs, tables_for
from autohet_cli.models import get_model
from autohet_cli.planner.api import PlanOutcome, make_plan, training_for
from autohet_cli.settings import TrainingSettings
from tests.bruteforce import tiny_cluster

GPT13 = get_model("GPT-1.3B")
# Four V100-16 in one host, GPT-1.3B, batch 16: without ZeRO-1 the best plan is two
# TP-2 pipelines at micro-batch 1 and 94% memory; sharding Adam's moments over the
# two leaves room for micro-batch 2, which is faster.
V100_QUAD = tiny_cluster((("v0", "V100-16", 4, None),), name="v100-quad")


def plan_tables(cluster: Cluster, tables: CostTables, *, name: str = "p", **kw: Any) -> PlanOutcome:
    """make_plan for the model of ``tables`` on ``cluster``, at the global batch of
    their training; ``kw``: make_plan's other options."""
    batch = tables.training.global_batch_size
    parts: dict[str, Any] = {"cluster": cluster, "model": tables.model, "tables": tables}
    return make_plan(name=name, global_batch_size=batch, **parts, **kw)


def plan_inputs(
    inputs: Inputs, training: TrainingSettings, *, name: str = "p", **kw: Any
) -> PlanOutcome:
    """make_plan on loaded inputs (cluster, model, profile) for ``training``."""
    return plan_tables(inputs.cluster, tables_for(inputs, training), name=name, **kw)


def plan_gpt13(cluster: Any, batch: int, *, time_limit_s: float = 20.0, **kw: Any) -> PlanOutcome:
    """make_plan for GPT-1.3B (seq 1024, bf16, Adam) at global batch ``batch``;
    ``kw``: make_plan's other options."""
    training = training_for(batch, 1024, "bf16", "adam")
    tables = CostTables(GPT13, None, training)
    return plan_tables(cluster, tables, time_limit_s=time_limit_s, **kw)
