"""The plan artifact ``autohet.plan/v1``: schema, validation, versioned read/write (pure).

A plan says, for every data-parallel replica (pipeline), how many micro-batches
it takes and which devices hold which half-open layer range at which TP
degree. Each stage has its own TP degree (a V100 stage may need TP 2 where an
A100 stage runs alone); the plan-level ``tensor_parallel`` is the largest of
them, kept so that readers of plans written before per-stage degrees still find
the number they used. It is immutable once written as ``plans/<name>.v<N>.yaml``: a new plan
(a re-plan, a recovery) is a new version, and ``parent`` links it to the old.
Loading validates everything the launcher and runtime rely on, so a
hand-edited plan fails here with the field named, not later on a GPU.

One name to import from; the parts, by responsibility: ``schema`` (the types and
their invariants), ``yamlform`` (to and from plain data), ``files`` (versioned
files on disk).
"""

from __future__ import annotations

from autohet_cli.plan.files import default_plan_name, load_plan, next_version, write_plan
from autohet_cli.plan.schema import (
    SCHEMA,
    Device,
    Pipeline,
    Plan,
    Prediction,
    SolverInfo,
    Stage,
    StagePrediction,
    check_against_cluster,
    validate_name,
    weight_sharded,
)
from autohet_cli.plan.yamlform import (
    pipeline_from_dict,
    pipelines_entry,
    plan_from_dict,
    plan_to_dict,
)

__all__ = [
    "SCHEMA",
    "Device",
    "Pipeline",
    "Plan",
    "Prediction",
    "SolverInfo",
    "Stage",
    "StagePrediction",
    "check_against_cluster",
    "default_plan_name",
    "load_plan",
    "next_version",
    "pipeline_from_dict",
    "pipelines_entry",
    "plan_from_dict",
    "plan_to_dict",
    "validate_name",
    "weight_sharded",
    "write_plan",
]
