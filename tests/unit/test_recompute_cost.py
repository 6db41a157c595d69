"""Activation recomputation: the plan field, its time and memory, the planner's --recompute."""

from __future__ import annotations

import copy
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.pipeline import simulate_1f1b
from autohet_cli.costmodel.tables import (
    RESIDUAL_BYTES,
    TOKEN_ID_BYTES,
    CostTables,
    LayerTable,
)
from autohet_cli.errors import ConfigError, InfeasibleError, PlanError
from autohet_cli.models import get_model
from autohet_cli.plan import Pipeline, Plan, plan_from_dict, plan_to_dict
from autohet_cli.planner.api import make_plan, training_for
from autohet_cli.planner.explain import explain_text, summary_json
from autohet_cli.planner.groups import block_range, block_stats
from autohet_cli.profiling.schema import EntryKey, LayerTiming, ProfileEntry
from autohet_cli.yamlio import dump_yaml
from tests.bruteforce import tiny_cluster
from tests.cli import autohet
from tests.unit.test_costmodel import (
    ACT_BYTES,
    ACT_RUN,
    CAST,
    OUT_BYTES,
    PARAMS,
    RESERVE,
    TOY,
    TRAINING,
    make_cluster,
    pipe,
    stage,
    state_bytes,
    toy_tables,
)

SEQ = TRAINING.seq_len  # 128 tokens, micro-batch 1
# What a recompute stage keeps per layer: token ids into the embedding, then fp32
# hidden states of TOY's width 64.
IDS = SEQ * TOKEN_ID_BYTES
HIDDEN = SEQ * TOY.hidden_size * RESIDUAL_BYTES
INPUTS = (IDS, HIDDEN, HIDDEN, HIDDEN)


def rc(s: Any) -> Any:
    return replace(s, recompute=True)


# --- cost numbers ----------------------------------------------------------------------------


def test_layer_inputs_are_token_ids_then_fp32_hidden_states() -> None:
    assert toy_tables().input_bytes(1) == [float(x) for x in INPUTS]
    assert (IDS, HIDDEN) == (1024, 32768)
    assert toy_tables().input_bytes(4)[1] == 4 * HIDDEN


def test_backward_of_a_recompute_stage_includes_its_forward() -> None:
    table = toy_tables().table("A100-40", 1, 1, 8.0)
    plain, again = table.stage(1, 4), table.stage(1, 4, recompute=True)
    assert (again.fwd_ms, again.bwd_ms) == (3.0, 6.0 + 3.0)
    assert again.update_ms == plain.update_ms and again.num_params == plain.num_params
    assert again.output_bytes == plain.output_bytes
    assert table.compute_ms(1, 4, recompute=True) == 12.0
    assert table.compute_ms(1, 4) == 9.0


def test_tp_communication_of_the_forward_repeats_in_the_backward() -> None:
    model = get_model("gpt-small")
    tables = CostTables(model, None, training_for(8, 256, "bf16", "adam"))
    table = tables.table("A100-40", 2, 1, 2400.0)
    a, b = block_range(model)
    plain, again = table.stage(a, b), table.stage(a, b, recompute=True)
    hop = tables.hop_ms("A100-40")  # each all-reduce's messages (costmodel.fixed)
    comm = sum(tables._tp_comm_ms(i, 2, 1, 2400.0, hop) for i in range(a, b))
    compute = sum(lt.fwd_ms for lt in tables.entry("A100-40", 2, 1).layers[a:b])
    assert comm > 0 and plain.fwd_ms == pytest.approx(compute + comm)
    assert again.bwd_ms == pytest.approx(plain.bwd_ms + compute + comm)


def test_memory_keeps_inputs_per_microbatch_plus_one_layer_at_work() -> None:
    cluster = make_cluster([("h0", 2)])
    plain = [pipe(4, stage(0, 2, "h0", 0), stage(2, 4, "h0", 1))]
    mixed = [pipe(4, rc(stage(0, 2, "h0", 0)), stage(2, 4, "h0", 1))]
    ev_plain = evaluate(plain, cluster, toy_tables(), 1)
    ev = evaluate(mixed, cluster, toy_tables(), 1)
    s0, s1 = ev.pipelines[0].stages
    # Stage 0 of 2 holds 2 micro-batches: their inputs to layers 0 and 1, plus layer 1's
    # 2e6 activation bytes and 16-bit weight copy (the larger layer) during one backward.
    expect0 = state_bytes(300_000) + (IDS + HIDDEN) * 2 + max(ACT_RUN[:2]) + 2 * 1e6 + RESERVE
    assert s0.mem_bytes == int(expect0)
    assert s0.cost.act_bytes == IDS + HIDDEN and s0.cost.transient_bytes == ACT_RUN[1]
    assert s0.mem_bytes < ev_plain.pipelines[0].stages[0].mem_bytes
    # The plain stage beside it is costed exactly as before.
    assert s1 == ev_plain.pipelines[0].stages[1]
    s1_mem = state_bytes(700_000) + sum(ACT_BYTES[2:]) + sum(CAST[2:]) + 2 * OUT_BYTES[3] + RESERVE
    assert s1.mem_bytes == int(s1_mem)
    # Time: stage 0's backward grew by its forward (4 + 2), and the simulator sees it.
    assert (s0.cost.fwd_ms, s0.cost.bwd_ms) == (2.0, 6.0)
    sim = simulate_1f1b([2, 2], [6, 4], 4, [1.0]).makespan_ms
    assert ev.pipeline_ms == pytest.approx(sim)
    assert ev.pipeline_ms > ev_plain.pipeline_ms


def test_last_stage_works_on_the_head_and_each_pipeline_follows_its_flags() -> None:
    cluster = make_cluster([("h0", 1), ("h1", 1)])
    plan = [pipe(2, stage(0, 4, "h0", 0)), pipe(2, rc(stage(0, 4, "h1", 0)))]
    ev = evaluate(plan, cluster, toy_tables(), 1)
    a, b = ev.pipelines[0].stages[0], ev.pipelines[1].stages[0]
    assert b.mem_bytes == int(
        state_bytes(sum(PARAMS)) + sum(INPUTS) + ACT_RUN[3] + 5e5 * 2 + RESERVE
    )
    assert a.mem_bytes == int(
        state_bytes(sum(PARAMS)) + sum(ACT_BYTES) + sum(CAST) + 5e5 * 2 + RESERVE
    )
    assert (a.cost.bwd_ms, b.cost.bwd_ms) == (8.0, 12.0)
    assert ev.pipelines[1].time_ms > ev.pipelines[0].time_ms


def test_largest_layer_of_any_range_matches_a_scan() -> None:
    rng = random.Random(7)
    acts = [rng.uniform(0, 1e9) for _ in range(13)]
    layers = tuple(
        LayerTiming(
            fwd_ms=1.0, bwd_ms=2.0, update_ms=0.0, num_params=1, act_bytes=a, output_bytes=1.0
        )
        for a in acts
    )
    key = EntryKey(model="m", gpu_type="A100-40", tensor_parallel=1, micro_batch_size=1, seq_len=1)
    table = LayerTable(
        ProfileEntry(key=key, source="measured", dtype="bf16", layers=layers),
        [0.0] * 13,
        [1.0] * 13,
    )
    for start in range(13):
        for end in range(start + 1, 14):
            assert table.max_act_bytes(start, end) == max(acts[start:end]), (start, end)
            assert table.stage(start, end, recompute=True).transient_bytes == max(acts[start:end])


def test_block_stats_for_recompute_carry_inputs_and_the_working_layer() -> None:
    model = get_model("gpt-small")
    table = CostTables(model, None, training_for(8, 256, "bf16", "adam")).table(
        "A100-40", 1, 1, 2400.0
    )
    plain, again = block_stats(table, model), block_stats(table, model, recompute=True)
    assert again.block_act == 256 * model.hidden_size * RESIDUAL_BYTES < plain.block_act
    # the working layer: its activations and, under bf16, its weights' 16-bit copy
    assert plain.block_cast == 2 * table.params(1, 2) > 0 and again.block_cast == 0.0
    assert again.block_work_bytes == plain.block_act + plain.block_cast
    assert again.tail_work_bytes == plain.tail_act + plain.tail_cast  # the head's logits
    assert again.block_ms == pytest.approx(plain.block_ms + plain.block_fwd_ms)
    assert plain.work_bytes(head=True, tail=True) == 0.0


# --- the plan schema -------------------------------------------------------------------------


def _plan_dict(recompute: tuple[bool, ...]) -> dict[str, Any]:
    stages = []
    bounds = [0, 2, 4]
    for j, flag in enumerate(recompute):
        s: dict[str, Any] = {
            "layers": [bounds[j], bounds[j + 1]],
            "gpu_type": "A100-40",
            "devices": [{"host": "h0", "gpu": j}],
        }
        if flag:
            s["recompute"] = True
        stages.append(s)
    return {
        "schema": "autohet.plan/v1",
        "name": "rc",
        "version": 1,
        "model": {"name": "toy-4", "num_layers": 4},
        "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 128},
        "tensor_parallel": 1,
        "pipelines": [{"num_microbatches": 4, "stages": stages}],
    }


def test_recompute_is_written_only_when_true_and_round_trips() -> None:
    plan = plan_from_dict(_plan_dict((True, False)), "rc.yaml")
    assert [s.recompute for s in plan.pipelines[0].stages] == [True, False]
    out = plan_to_dict(plan)
    stages = out["pipelines"][0]["stages"]
    assert stages[0]["recompute"] is True and "recompute" not in stages[1]
    again = plan_from_dict(yaml.safe_load(dump_yaml(out)), "again")
    assert again == plan
    none = plan_from_dict(_plan_dict((False, False)), "plain.yaml")
    assert "recompute" not in dump_yaml(plan_to_dict(none))


@pytest.mark.parametrize("value", ["yes", -1, 2.0, None, [True]])
def test_a_non_bool_recompute_is_rejected_with_the_field_named(value: Any) -> None:
    d = _plan_dict((False, False))
    d["pipelines"][0]["stages"][1]["recompute"] = value
    with pytest.raises(ConfigError, match=r"rc\.yaml: pipelines\[0\]\.stages\[1\]\.recompute"):
        plan_from_dict(d, "rc.yaml")


def test_recompute_n_recomputes_the_stages_first_n_layers_and_round_trips() -> None:
    """``recompute: N`` (issue 48): the stage's first N layers; 0 is none, the stage's
    layer count is every layer. More than the stage has, or both fields set, is
    refused naming the field."""
    d = _plan_dict((False, False))
    d["pipelines"][0]["stages"][0]["recompute"] = 1
    plan = plan_from_dict(d, "rc.yaml")
    first, second = plan.pipelines[0].stages
    assert (first.recompute, first.recompute_layers, first.recomputed) == (False, 1, 1)
    assert second.recomputed == 0
    out = plan_to_dict(plan)
    assert out["pipelines"][0]["stages"][0]["recompute"] == 1
    assert plan_from_dict(yaml.safe_load(dump_yaml(out)), "again") == plan
    d["pipelines"][0]["stages"][0]["recompute"] = 0
    assert "recompute" not in dump_yaml(plan_to_dict(plan_from_dict(d, "rc.yaml")))
    d["pipelines"][0]["stages"][0]["recompute"] = 2  # all of its two layers
    assert plan_from_dict(d, "rc.yaml").pipelines[0].stages[0].recomputed == 2
    d["pipelines"][0]["stages"][0]["recompute"] = 3
    with pytest.raises(PlanError, match=r"stages\[0\]\.recompute: 3 layers, but the stage has 2"):
        plan_from_dict(d, "rc.yaml").validate("rc.yaml")
    both = replace(first, recompute=True)
    with pytest.raises(PlanError, match="true or a layer count, not both"):
        replace(plan, pipelines=(replace(plan.pipelines[0], stages=(both, second)),)).validate()


def test_a_partial_stage_costs_its_recomputed_layers_as_recomputed_and_the_rest_plain() -> None:
    """Stage [0, 4) recomputing its first 2 layers: the time of layers 0-1 recomputed
    plus layers 2-3 plain; it keeps the inputs of 0-1 and the activations of 2-3 per
    micro-batch in flight, layer 0-1's largest working set once, and 2-3's copies."""
    cluster = make_cluster([("h0", 1)])
    tables = toy_tables()
    table = tables.table("A100-40", 1, 1, cluster.host("h0").intra_node_gbps)
    part = table.stage(0, 4, recompute_first=2)
    r, k = table.stage(0, 2, recompute=True), table.stage(2, 4)
    assert (part.fwd_ms, part.bwd_ms) == (r.fwd_ms + k.fwd_ms, r.bwd_ms + k.bwd_ms)
    assert part.act_bytes == IDS + HIDDEN + sum(ACT_BYTES[2:])
    assert part.transient_bytes == max(ACT_RUN[:2]) and part.cast_bytes == sum(CAST[2:])
    # the ends: none and every layer are the plain and the recompute stage
    assert table.stage(0, 4, recompute_first=0) == table.stage(0, 4)
    assert table.stage(0, 4, recompute_first=4) == table.stage(0, 4, recompute=True)
    # time and memory between the two, on the whole plan
    costs = []
    for n in range(5):
        s = replace(stage(0, 4, "h0", 0), recompute_layers=n)
        pe = evaluate([pipe(4, s)], cluster, tables, 1).pipelines[0].stages[0]
        costs.append((pe.cost.bwd_ms, pe.mem_bytes))
    assert [c[0] for c in costs] == sorted(c[0] for c in costs)  # more re-run forward
    # memory falls with every recomputed layer after the first, which adds the one
    # layer at work (here more than its activations less its input: one micro-batch)
    mem = [c[1] for c in costs]
    assert mem[1:] == sorted(mem[1:], reverse=True) and mem[4] < mem[2] < mem[0]


def test_a_partial_stage_keeps_its_plain_layers_copies_per_microbatch_in_flight() -> None:
    """The runtime runs a stage that recomputes any layer without autocast's weight
    cache (``runtime.pipeline.autocast_contexts``), so each micro-batch's forward
    through its plain layers casts their weights anew and keeps the copies for its
    backward: stage 0 of 2, recomputing layer 0 of [0, 3), holds 2 micro-batches and
    two copies of layers 1-2's weights (a plain stage shares one through the cache)."""
    cluster = make_cluster([("h0", 2)])
    first = replace(stage(0, 3, "h0", 0), recompute_layers=1)
    ev = evaluate([pipe(4, first, stage(3, 4, "h0", 1))], cluster, toy_tables(), 1)
    held = IDS + ACT_BYTES[1] + ACT_BYTES[2] + CAST[1] + CAST[2]  # per micro-batch
    expect = state_bytes(600_000) + 2 * held + ACT_RUN[0] + 2 * OUT_BYTES[2] + RESERVE
    assert ev.pipelines[0].stages[0].mem_bytes == int(expect)


def test_a_misspelt_recompute_key_is_still_rejected() -> None:
    d = _plan_dict((False, False))
    d["pipelines"][0]["stages"][0]["recomputed"] = True
    with pytest.raises(ConfigError, match=r"stages\[0\]: unknown key 'recomputed'.*'recompute'"):
        plan_from_dict(d, "rc.yaml")


# --- explain and estimate --------------------------------------------------------------------


def _toy_plan(flags: tuple[bool, bool]) -> Plan:
    return plan_from_dict(_plan_dict(flags), "toy")


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        ((True, False), "Recompute: 1 of 2 stages (marked R)"),
        ((True, True), "Recompute: every stage"),
        ((False, False), None),
    ],
)
def test_explain_marks_recompute_stages(flags: tuple[bool, bool], line: str | None) -> None:
    plan = _toy_plan(flags)
    cluster = make_cluster([("h0", 2)])
    ev = evaluate(plan.pipelines, cluster, toy_tables(), 1)
    text = explain_text(plan, ev, cluster, solved_now=False)
    assert summary_json(plan, ev, cluster, None)["recompute_stages"] == sum(flags)
    if line is None:
        assert "recompute" not in text.lower()
        return
    assert line in text
    rows = [r for r in text.splitlines() if r.strip().startswith(("0 ", "1 "))]
    assert [r.rstrip().endswith(" R") for r in rows] == list(flags)


# --- the planner -----------------------------------------------------------------------------

# Two V100-16 on one host, GPT-1.3B at 4096 tokens: weights and Adam state (21 GB) fit
# the pair, but no TP degree, micro-batch size or depth leaves room for the activations
# of a single micro-batch; kept as layer inputs only, they fit.
V100_PAIR = (("v0", "V100-16", 2, None),)


def _plan_tight(recompute: bool | None) -> Any:
    model = get_model("GPT-1.3B")
    training = training_for(4, 4096, "bf16", "adam")
    cluster = tiny_cluster(V100_PAIR, name="v100-pair")
    return make_plan(
        name="tight",
        cluster=cluster,
        model=model,
        tables=CostTables(model, None, training),
        global_batch_size=training.global_batch_size,
        time_limit_s=10.0,
        recompute=recompute,
    ), cluster


def test_plain_planning_runs_out_of_memory_and_suggests_recompute() -> None:
    with pytest.raises(InfeasibleError, match="activations.*--recompute"):
        _plan_tight(False)


def test_recompute_plan_fits_where_plain_planning_does_not() -> None:
    out, cluster = _plan_tight(True)
    stages = [s for p in out.plan.pipelines for s in p.stages]
    assert stages and all(s.recompute for s in stages)
    assert out.eval.fits
    # Scored as recompute stages: without the flag the same layout does not fit.
    tables = CostTables(get_model("GPT-1.3B"), None, out.plan.training)
    mbs = out.plan.training.micro_batch_size
    plain = [
        replace(p, stages=tuple(replace(s, recompute=False) for s in p.stages))
        for p in out.plan.pipelines
    ]
    assert not evaluate(plain, cluster, tables, mbs).fits
    again = evaluate(list(out.plan.pipelines), cluster, tables, mbs)
    assert again.iteration_ms == pytest.approx(out.eval.iteration_ms)
    # The baselines recompute too, so the comparison stays fair.
    for name, cand in out.baselines.items():
        assert cand is not None, name
        assert all(s.recompute for p in cand.pipelines for s in p.stages), name
    written = plan_to_dict(replace(out.plan, version=1))
    assert all(s["recompute"] is True for p in written["pipelines"] for s in p["stages"])


def test_by_default_the_planner_recomputes_only_the_stages_that_need_it() -> None:
    auto, cluster = _plan_tight(None)  # type: ignore[arg-type]
    full, _ = _plan_tight(True)
    assert auto.eval.fits
    assert auto.eval.iteration_ms <= full.eval.iteration_ms * (1 + 1e-9)
    tables = CostTables(get_model("GPT-1.3B"), None, auto.plan.training)
    mbs = auto.plan.training.micro_batch_size
    pipelines = list(auto.plan.pipelines)
    flagged = [(pi, si) for pi, p in enumerate(pipelines) for si, s in enumerate(p.stages)]
    flagged = [(pi, si) for pi, si in flagged if pipelines[pi].stages[si].recomputed]
    assert flagged  # memory binds here: without any recomputation nothing fits
    # ... one stage of 26 layers, recomputing the first 25 (recompute: N, issue 48)
    assert [(s.recompute, s.recomputed) for p in pipelines for s in p.stages] == [(False, 25)]
    assert auto.eval.iteration_ms < full.eval.iteration_ms
    for pi, si in flagged:  # ... and each stage needs every layer it recomputes to fit
        stages = list(pipelines[pi].stages)
        fewer = stages[si].recomputed - 1
        stages[si] = replace(stages[si], recompute=False, recompute_layers=fewer)
        edited = [
            *pipelines[:pi],
            replace(pipelines[pi], stages=tuple(stages)),
            *pipelines[pi + 1 :],
        ]
        ev = evaluate(edited, cluster, tables, mbs)
        assert ev.pipelines[pi].stages[si].mem_fraction > 1.0


def test_where_memory_does_not_bind_nothing_recomputes() -> None:
    model = get_model("gpt-tiny")
    training = training_for(8, 64, "fp32", "adam")
    cluster = tiny_cluster((("c0", "V100-16", 2, None),), name="roomy")
    out = make_plan(
        name="roomy", cluster=cluster, model=model, tables=CostTables(model, None, training),
        global_batch_size=8, time_limit_s=5.0,
    )  # fmt: skip
    assert out.eval.memory_peak_fraction < 0.8
    assert not any(s.recompute for p in out.plan.pipelines for s in p.stages)


def test_relax_keeps_recomputation_only_where_a_stage_would_not_fit() -> None:
    from autohet_cli.planner.recompute import relax
    from autohet_cli.planner.search import Candidate, SearchRequest, scorer

    full, cluster = _plan_tight(True)
    model = get_model("GPT-1.3B")
    tables = CostTables(model, None, full.plan.training)
    req = SearchRequest(cluster=cluster, model=model, tables=tables, global_batch_size=4)
    mbs = full.plan.training.micro_batch_size
    # one more pipeline-free stage that fits plainly: a roomy copy of the plan's cluster
    roomy = tiny_cluster((("v0", "A100-80", 2, None),), name="v100-pair")
    loose = SearchRequest(cluster=roomy, model=model, tables=tables, global_batch_size=4)
    pipelines = [
        replace(p, stages=tuple(replace(s, gpu_type="A100-80") for s in p.stages))
        for p in full.plan.pipelines
    ]
    ev = evaluate(pipelines, roomy, tables, mbs)
    cand = Candidate(
        pipelines=pipelines, tp=full.plan.tensor_parallel, mbs=mbs, eval=ev, score=ev.iteration_ms
    )
    relaxed = relax(cand, loose, scorer(roomy, "time"))
    assert not any(s.recompute for p in relaxed.pipelines for s in p.stages)  # all fit plainly
    assert relaxed.score < cand.score
    # On the tight pair nothing can be relaxed without running out of memory.
    ev = evaluate(list(full.plan.pipelines), cluster, tables, mbs)
    tight = Candidate(
        pipelines=list(full.plan.pipelines),
        tp=full.plan.tensor_parallel,
        mbs=mbs,
        eval=ev,
        score=ev.iteration_ms,
    )
    again = relax(tight, req, scorer(cluster, "time"))
    assert again.eval.fits and again.score <= tight.score


def test_the_holders_of_a_sharded_stage_keep_one_recompute_count() -> None:
    """FSDP's backward gathers come in one order on every holder of a weight-sharded
    stage (Plan.validate refuses holders that recompute differently): relax and
    fewest_layers decide per column of holders, the count that fits them all. Here
    GPT-1.3B whole on two V100s of 18 and 24 GB: the smaller needs some of its 26
    layers recomputed, the larger none; both must recompute as many."""
    from autohet_cli.planner.recompute import relax
    from autohet_cli.planner.search import Candidate, SearchRequest, scorer
    from tests import planting

    model = get_model("GPT-1.3B")
    tables = CostTables(model, None, training_for(8, 2048, "fp16", "adam"))
    cluster = tiny_cluster((("a", "V100-16", 1, 18), ("b", "V100-16", 1, 24)), name="uneven")
    whole = [planting.stage(0, 26, h, 0, gpu_type="V100-16", shard="weights") for h in "ab"]
    pipes = [Pipeline(num_microbatches=4, stages=(replace(s, recompute=True),)) for s in whole]
    ev = evaluate(pipes, cluster, tables, 1)
    score = scorer(cluster, "time")
    cand = Candidate(pipelines=pipes, tp=1, mbs=1, eval=ev, score=score(pipes, ev))
    req = SearchRequest(cluster=cluster, model=model, tables=tables, global_batch_size=8)
    out = relax(cand, req, score)
    counts = [s.recomputed for p in out.pipelines for s in p.stages]
    assert counts[0] == counts[1] and 0 < counts[0] < 26 and out.eval.fits
    # ... the least that fits the smaller: one fewer does not
    fewer = [
        replace(p, stages=(replace(p.stages[0], recompute_layers=counts[0] - 1),)) for p in pipes
    ]
    fewer = [replace(p, stages=(replace(p.stages[0], recompute=False),)) for p in fewer]
    assert evaluate(fewer, cluster, tables, 1).pipelines[0].stages[0].mem_fraction > 1.0
    Plan(
        name="uneven", version=1, model_name=model.name, num_layers=26,
        training=tables.training, tensor_parallel=1, pipelines=tuple(out.pipelines),
    ).validate()  # fmt: skip


def test_refinement_moving_a_cut_keeps_a_partial_count_within_the_stage() -> None:
    """A stage [0, 3) recomputing its first 3 layers as ``recompute: 3`` (a recovery
    seeds the search with the old plan's stages): refinement moves its cut to 2, and
    the stage must not claim 3 recomputed layers of its 2 (Plan.validate refuses it)."""
    from autohet_cli.planner.build import refine

    cluster = make_cluster([("h0", 2)])
    first = replace(stage(0, 3, "h0", 0), recompute_layers=3)
    pipes = [pipe(4, first, stage(3, 4, "h0", 1))]
    out, ev = refine(pipes, cluster, toy_tables(), 1, lambda e: e.iteration_ms, deadline=1e18)
    moved = out[0].stages[0]
    assert (moved.layer_end, moved.recomputed) == (2, 2)
    assert moved.recompute_layers <= moved.num_layers
    Plan(
        name="r", version=1, model_name=TOY.name, num_layers=4, training=TRAINING,
        tensor_parallel=1, pipelines=tuple(out),
    ).validate()  # fmt: skip
    assert ev.iteration_ms == evaluate(out, cluster, toy_tables(), 1).iteration_ms


def test_cli_plan_recompute_then_estimate_a_hand_edited_plan(tmp_path: Path) -> None:
    cluster = {
        "schema": "autohet.cluster/v1",
        "name": "v100-pair",
        "network": {"inter_node_gbps": 100},
        "hosts": [{"name": "v0", "address": "127.0.0.1", "gpus": {"type": "V100-16", "count": 2}}],
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    common = ("--cluster", "c.yaml", "--model", "GPT-1.3B", "--global-batch-size", "4")
    args = ("plan", *common, "--seq-len", "4096", "--time-limit", "10", "--out-dir", "out")
    res = autohet(*args, "--no-recompute", "--json", cwd=tmp_path)
    assert res.returncode == 1 and "--recompute" in res.stderr
    res = autohet(*args, "--recompute", "--explain", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "Recompute: every stage" in res.stdout
    path = tmp_path / "out" / "v100-pair-GPT-1.3B.v1.yaml"
    res = autohet("estimate", str(path), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    est = json.loads(res.stdout)
    assert est["recompute_stages"] >= 1 and est["memory_peak_fraction"] <= 1.0
    # Hand-edit: recomputation off on every stage; estimate says it no longer fits.
    raw = yaml.safe_load(path.read_text())
    edited = copy.deepcopy(raw)
    for p in edited["pipelines"]:
        for s in p["stages"]:
            del s["recompute"]
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(edited))
    res = autohet("estimate", "edited.yaml", "--cluster", "c.yaml", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "runs out of memory" in res.stderr and "Recompute" not in res.stdout


def test_explain_shows_how_many_layers_a_partial_stage_recomputes() -> None:
    d = _plan_dict((True, False))
    d["pipelines"][0]["stages"][1]["recompute"] = 1
    plan = plan_from_dict(d, "rc.yaml")
    cluster = make_cluster([("h0", 2)])
    ev = evaluate(plan.pipelines, cluster, toy_tables(), 1)
    text = explain_text(plan, ev, cluster, solved_now=False)
    assert summary_json(plan, ev, cluster, None)["recompute_stages"] == 2
    rows = [r.rstrip() for r in text.splitlines() if r.strip().startswith(("0 ", "1 "))]
    assert rows[0].endswith(" R") and rows[1].endswith(" R 1/2")
    assert "1 of them only for their first layers (R k/n: k of its n)" in text
