"""GPT-Neo-2.7B on 8 A100-40 + 8 V100-16 against the Metis plan (issue 15).

Two hosts of 4x A100-40 and two of 4x V100-16, 100 Gbit/s between hosts, global
batch 128, sequence 2048, Sailor's measured profiles. Metis plans micro-batch 1,
two pipelines of 64 micro-batches, each: V100 pairs at TP 2 for layers [0, 5),
single A100s for the rest. Printed: the iteration time the simulator predicts for
that plan, for ours (make_plan, TP degree per GPU type), and for ours with one TP
degree for every stage (what the planner could express before).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.inputs import Inputs, load_inputs, tables_for
from autohet_cli.plan import Pipeline, Plan
from autohet_cli.planner import enumeration
from autohet_cli.planner.api import PlanOutcome, make_plan, training_for
from benchmarks._common import describe
from tests.planting import stage

ROOT = Path(__file__).resolve().parents[1]  # tests import this from any directory
CLUSTER = str(ROOT / "profiles/clusters/neo-a100-v100.yaml")
PROFILE = str(ROOT / "profiles/sailor/GPT-Neo-2.7B.yaml")
BATCH = 128
SEQ_LEN = 2048


def metis_plan(like: Plan) -> Plan:
    """The Metis plan as ours would write it, with ``like``'s model and training."""
    pipelines = tuple(
        Pipeline(
            num_microbatches=64,
            stages=(
                stage(0, 3, "v100-0", 2 * j, 2 * j + 1, gpu_type="V100-16"),
                stage(3, 5, "v100-1", 2 * j, 2 * j + 1, gpu_type="V100-16"),
                stage(5, 12, "a100-0", j, gpu_type="A100-40"),
                stage(12, 19, "a100-0", 2 + j, gpu_type="A100-40"),
                stage(19, 26, "a100-1", j, gpu_type="A100-40"),
                stage(26, 34, "a100-1", 2 + j, gpu_type="A100-40"),
            ),
        )
        for j in (0, 1)
    )
    return replace(
        like,
        name="metis-neo",
        version=1,
        training=replace(like.training, micro_batch_size=1),
        tensor_parallel=2,
        pipelines=pipelines,
        prediction=None,
        solver=None,
        baselines={},
        idle=(),
        notes=(),
        contingency={},
    )


def neo_inputs() -> tuple[Inputs, CostTables]:
    """The case's cluster, model and profile, and its cost tables."""
    inputs = load_inputs(CLUSTER, "GPT-Neo-2.7B", [PROFILE])
    return inputs, tables_for(inputs, training_for(BATCH, SEQ_LEN, "bf16", "adam"))


def plan_neo(*, one_degree: bool = False, shard_weights: bool | None = None) -> PlanOutcome:
    """make_plan on the case; ``one_degree``: one TP degree for every stage;
    ``shard_weights``: make_plan's (None: the planner decides)."""
    inputs, tables = neo_inputs()
    with mock.patch.object(
        enumeration,
        "ranked_combos",
        (lambda _req, _mbs: ([], False)) if one_degree else enumeration.ranked_combos,
    ):
        return make_plan(
            name="neo",
            cluster=inputs.cluster,
            model=inputs.model,
            tables=tables,
            global_batch_size=BATCH,
            time_limit_s=60.0,
            shard_weights=shard_weights,
        )


def main() -> None:
    inputs, tables = neo_inputs()
    start = time.perf_counter()
    ours = plan_neo()
    took = time.perf_counter() - start
    uniform = plan_neo(one_degree=True)
    metis = metis_plan(ours.plan)
    ev = evaluate(list(metis.pipelines), inputs.cluster, tables, 1)
    rows = [
        ("Metis (issue 15)", ev.iteration_ms, metis),
        ("ours, TP per GPU type", ours.eval.iteration_ms, ours.plan),
        ("ours, one TP degree", uniform.eval.iteration_ms, uniform.plan),
    ]
    print(
        f"{Path(CLUSTER).name}, GPT-Neo-2.7B, global batch {BATCH}, seq {SEQ_LEN}, "
        f"{Path(PROFILE).name}"
    )
    print(f"make_plan took {took:.1f} s\n")
    for label, ms, plan in rows:
        print(f"{label:24s} {ms / 1e3:8.3f} s/iteration  ({ms / ev.iteration_ms:.3f}x Metis)")
        print(f"  {describe(list(plan.pipelines))}")
