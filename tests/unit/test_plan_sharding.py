"""Sharded stages in the plan artifact (issue 48, item 5): ``shard`` and
``reshard_after_forward`` written only where set, read strictly, validated against
the other holders of a stage's layers, shown by --explain; the launcher and the
worker refuse weight-sharded stages with TP > 1, and a sharded run's validation
losses and --compile on (not built yet; tests/dist/test_fsdp_exact.py
runs the rest)."""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from typing import Any

import pytest
import yaml

from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import AutohetError, PlanError
from autohet_cli.models import get_model
from autohet_cli.plan import Plan, plan_from_dict, plan_to_dict
from autohet_cli.planner.api import make_plan, training_for
from autohet_cli.planner.explain import explain_text, summary_json
from autohet_cli.yamlio import dump_yaml
from tests.bruteforce import tiny_cluster
from tests.unit.test_costmodel import make_cluster, toy_tables

WHERE = "s.yaml"


def _stage(start: int, end: int, gpu: int, **extra: Any) -> dict[str, Any]:
    return {
        "layers": [start, end],
        "gpu_type": "A100-40",
        "devices": [{"host": "h0", "gpu": gpu}],
        **extra,
    }


def _plan_dict(first: dict[str, Any] | None = None, **training: Any) -> dict[str, Any]:
    """Two pipelines cut alike ([0, 2), [2, 4)) on h0's GPUs 0-3; ``first``: keys added
    to the first stage of both pipelines."""
    first = first or {}
    return {
        "schema": "autohet.plan/v1",
        "name": "sh",
        "version": 1,
        "model": {"name": "toy-4", "num_layers": 4},
        "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 128, **training},
        "tensor_parallel": 1,
        "pipelines": [
            {"num_microbatches": 3, "stages": [_stage(0, 2, 0, **first), _stage(2, 4, 1)]},
            {"num_microbatches": 1, "stages": [_stage(0, 2, 2, **first), _stage(2, 4, 3)]},
        ],
    }


WEIGHTS = {"shard": "weights"}
KEPT = {"shard": "weights", "reshard_after_forward": False}


# --- the YAML form ---------------------------------------------------------------------------


@pytest.mark.parametrize("first", [WEIGHTS, KEPT, {"shard": "optimizer"}])
def test_shard_fields_round_trip_and_are_written_only_where_set(first: dict[str, Any]) -> None:
    zero1 = {"zero1": True} if first["shard"] == "optimizer" else {}
    plan = plan_from_dict(_plan_dict(first, **zero1), WHERE)
    s0, s1 = plan.pipelines[1].stages
    assert (s0.shard, s0.reshard_after_forward) == (
        first["shard"],
        "reshard_after_forward" not in first,
    )
    assert (s1.shard, s1.reshard_after_forward) == ("none", True)
    out = plan_to_dict(plan)
    written = out["pipelines"][1]["stages"]
    assert {k: written[0][k] for k in first} == first
    assert "shard" not in written[1] and "reshard_after_forward" not in written[1]
    text = dump_yaml(out)
    again = plan_from_dict(yaml.safe_load(text), WHERE)
    assert again == plan and dump_yaml(plan_to_dict(again)) == text


def test_plans_without_sharding_keep_their_bytes() -> None:
    # A plan the planner makes now (no sharding) and a hand-written one: no new key in
    # their text, and read back and written again, the same bytes.
    model = get_model("gpt-tiny")
    training = training_for(8, 64, "bf16", "adam")
    cluster = tiny_cluster((("a0", "A100-40", 2, None),))
    fresh = make_plan(
        name="fresh",
        cluster=cluster,
        model=model,
        tables=CostTables(model, None, training),
        global_batch_size=training.global_batch_size,
        time_limit_s=5.0,
    ).plan
    for plan in (replace(fresh, version=1), plan_from_dict(_plan_dict(), WHERE)):
        out = plan_to_dict(plan)
        keys = {k for p in out["pipelines"] for s in p["stages"] for k in s}
        assert not keys & {"shard", "reshard_after_forward"}
        text = dump_yaml(out)
        again = plan_from_dict(yaml.safe_load(text), WHERE)  # its floats written rounded
        assert dump_yaml(plan_to_dict(again)) == text


def _refused(d: dict[str, Any]) -> str:
    with pytest.raises(AutohetError) as caught:
        plan_from_dict(d, WHERE)
    return str(caught.value)


def test_a_shard_that_is_no_mode_is_named() -> None:
    d = _plan_dict()
    d["pipelines"][1]["stages"][0]["shard"] = "zero3"
    assert _refused(d) == (
        "s.yaml: pipelines[1].stages[0].shard: 'zero3' is not one of none, optimizer, weights"
    )
    d["pipelines"][1]["stages"][0]["shard"] = "none"
    d["pipelines"][1]["stages"][0]["reshard_after_forward"] = "no"
    assert "pipelines[1].stages[0].reshard_after_forward" in _refused(d)


# --- validation: each refusal names the field and says what to do ----------------------------


def _set(d: dict[str, Any], pipeline: int, stage: int, **keys: Any) -> dict[str, Any]:
    d = copy.deepcopy(d)
    d["pipelines"][pipeline]["stages"][stage].update(keys)
    return d


def _one_pipeline() -> dict[str, Any]:
    d = _plan_dict(WEIGHTS)
    d["pipelines"] = d["pipelines"][:1]
    d["pipelines"][0]["num_microbatches"] = 4
    return d


def _cut_differently() -> dict[str, Any]:
    d = _plan_dict(WEIGHTS)
    d["pipelines"][1]["stages"] = [_stage(0, 3, 2), _stage(3, 4, 3)]
    return d


def _other_tp() -> dict[str, Any]:
    d = _plan_dict(WEIGHTS, **{})
    d["tensor_parallel"] = 2
    d["pipelines"][1]["stages"][0]["devices"] = [{"host": "h0", "gpu": 2}, {"host": "h0", "gpu": 4}]
    return d


REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "nothing to shard over": (
        _one_pipeline(),
        "s.yaml: pipelines[0].stages[0].shard: weights: no other pipeline holds layers "
        "[0, 2), so there is nothing to shard them over; set shard: none",
    ),
    "a holder cut differently": (
        _cut_differently(),
        "s.yaml: pipelines[0].stages[0].shard: weights: pipelines[1] cuts layers [0, 2) as "
        "[0, 3); every holder of a weight-sharded stage's layers needs the same cut",
    ),
    "a holder at another TP degree": (
        _other_tp(),
        "pipelines[1].stages[0] holds layers [0, 2) at tensor_parallel 2, this stage at 1; "
        "weight-sharded holders need one TP degree",
    ),
    "a holder that does not shard": (
        _set(_plan_dict(), 1, 0, shard="weights"),
        "s.yaml: pipelines[1].stages[0].shard: weights: pipelines[0].stages[0] holds layers "
        "[0, 2) with shard: none; every holder",
    ),
    "holders that gather differently": (
        _set(_plan_dict(WEIGHTS), 1, 0, reshard_after_forward=False),
        "pipelines[1].stages[0] holds layers [0, 2) with reshard_after_forward: false; "
        "every holder of a weight-sharded stage's layers shards them alike",
    ),
    "holders that recompute differently": (
        _set(_plan_dict(WEIGHTS), 1, 0, recompute=1),
        "pipelines[1].stages[0] holds layers [0, 2) recomputing 1 of its layers, this stage "
        "0; weight-sharded holders recompute alike",
    ),
    "kept weights on a replicated stage": (
        _set(_plan_dict(), 0, 1, reshard_after_forward=False),
        "s.yaml: pipelines[0].stages[1].reshard_after_forward: false keeps gathered weights, "
        "which only a weight-sharded stage has (shard: weights), and this one is shard: none",
    ),
    "optimizer without zero1": (
        _plan_dict({"shard": "optimizer"}),
        "s.yaml: pipelines[0].stages[0].shard: optimizer restates training.zero1, which is "
        "off; set training.zero1: true or remove shard from the stage",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_sharding_refusals_name_the_field(case: str) -> None:
    d, message = REFUSALS[case]
    with pytest.raises(PlanError, match=re.escape(message)):
        plan_from_dict(d, WHERE)


def test_holders_may_differ_in_gpu_type_and_micro_batches() -> None:
    d = _plan_dict(WEIGHTS)
    d["pipelines"][1]["stages"][0]["gpu_type"] = "V100-16"  # 3 and 1 micro-batches too
    assert plan_from_dict(d, WHERE).pipelines[1].stages[0].shard == "weights"
    # with zero1 on, a stage may restate it, say nothing, or shard its weights
    assert plan_from_dict(_set(_plan_dict(WEIGHTS, zero1=True), 0, 1, shard="optimizer"), WHERE)


# --- explain, and the refusal of the runtime --------------------------------------------------


def _sharded_plan(first: dict[str, Any]) -> Plan:
    return plan_from_dict(_plan_dict(first), WHERE)


@pytest.mark.parametrize(
    ("first", "cell"), [(WEIGHTS, "weights"), (KEPT, "weights, kept gathered")]
)
def test_explain_shows_sharded_stages(first: dict[str, Any], cell: str) -> None:
    plan = _sharded_plan(first)
    cluster = make_cluster([("h0", 4)])
    ev = evaluate(plan.pipelines, cluster, toy_tables(), 1)
    text = explain_text(plan, ev, cluster)
    assert summary_json(plan, ev, cluster, None)["weight_sharded_stages"] == 2  # --json
    assert "Shard weights: 2 of 4 stages (shard) hold 1/2 of their weights" in text
    assert ("keep the gathered weights from the forward" in text) == (cell != "weights")
    rows = [r.rstrip() for r in text.splitlines() if r.strip().startswith("0 ")]
    assert rows and all(r.endswith(cell) for r in rows)
    plain = plan_from_dict(_plan_dict(), WHERE)
    text = explain_text(plain, evaluate(plain.pipelines, cluster, toy_tables(), 1), cluster)
    assert "shard" not in text.lower()


def test_fsdp_gathers_in_the_compute_dtype_and_reduces_in_fp32() -> None:
    """What the cost and memory models count for a sharded stage on a GPU: 16-bit
    gathers (``costmodel.sharding.compute_bytes``), fp32 reduce-scatters."""
    import torch

    from autohet_cli.runtime.fsdp_stage import mixed_precision

    bf16 = mixed_precision(torch.bfloat16)
    assert bf16.param_dtype == torch.bfloat16 and bf16.reduce_dtype == torch.float32
    assert mixed_precision(torch.float16).param_dtype == torch.float16
    fp32 = mixed_precision(torch.float32)  # a CPU: nothing cast
    assert fp32.param_dtype is None and fp32.reduce_dtype == torch.float32


def test_explain_says_what_tp_gathers_across_hosts_assume_of_the_nics() -> None:
    """The planner counts on a NIC per GPU unless the cluster says ``nics:``; where
    TP ranks of sharded holders gather across hosts, explain says so and what to
    write if the hosts share fewer NICs."""
    from dataclasses import replace as _replace

    from autohet_cli.plan import Pipeline
    from tests.unit.test_costmodel import stage as a100_stage

    holders = [
        Pipeline(num_microbatches=2, stages=(a100_stage(0, 4, h, 0, 1, shard="weights"),))
        for h in ("h0", "h1")
    ]
    base = plan_from_dict(_plan_dict(), WHERE)
    plan = _replace(base, tensor_parallel=2, pipelines=tuple(holders))
    for nics, says in ((None, True), (1, False)):
        cluster = make_cluster([("h0", 2), ("h1", 2)], nics=nics)
        text = explain_text(plan, evaluate(plan.pipelines, cluster, toy_tables(), 1), cluster)
        hint = "count on a NIC per GPU on 2 host(s) whose cluster entry does not say `nics:`"
        assert (hint in text) == says, text
