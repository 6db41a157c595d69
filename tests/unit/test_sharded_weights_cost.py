"""Weight-sharded stages (ZeRO-3 / FSDP, issue 48) in the cost and memory model:
hand-computed figures against ``costmodel.sharding``'s formulas, and ``autohet
estimate`` scoring such a plan."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from autohet_cli import catalog
from autohet_cli.cli import estimate as estimate_cli
from autohet_cli.cluster import Cluster, cluster_from_dict
from autohet_cli.costmodel.evaluate import evaluate, ring_allreduce_ms
from autohet_cli.costmodel.sharding import exposed_ms
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.plan import Pipeline, load_plan, plan_to_dict
from autohet_cli.profiling.schema import EntryKey, LayerTiming, Profile, ProfileEntry
from autohet_cli.settings import TrainingSettings
from tests import planting
from tests.bruteforce import tiny_model

# A 4-layer model (embedding, two blocks, head) with a hand-written measured profile:
# forward 1 ms and backward 2 ms per layer, parameters 1e5..4e5 (1e6 in all).
# Untied (its head its own weights): every layer sharded, as the hand formulas assume;
# a tied embedding and head: test_a_tied_embedding_and_head_stay_whole.
TOY = replace(tiny_model(2), tied_embeddings=False)
TRAINING = TrainingSettings(global_batch_size=4, micro_batch_size=1, seq_len=128)
PARAMS = (100_000, 200_000, 300_000, 400_000)
ACT_BYTES = (1e6, 2e6, 3e6, 4e6)
UPDATE_MS = (0.5, 0.5, 1.0, 1.0)
HEAD_OUT = 5e5
NO_FIXED = replace(
    catalog.GPU_FIXED, op_us=0.0, tp_op_us=0.0, hop_us=0.0, step_us=0.0, optimizer_ops_per_tensor=0
)
UNFIXED = {name: replace(spec, fixed=NO_FIXED) for name, spec in catalog.CATALOG.items()}
RESERVE = catalog.CATALOG["A100-40"].runtime_reserve_bytes
C16 = 2  # bf16 on a GPU: a gathered weight's bytes
REDUCE = 4  # fp32 gradients in the reduce-scatter (settings.GRAD_REDUCE_BYTES)

stage = functools.partial(planting.stage, gpu_type="A100-40")


def tables() -> CostTables:
    layers = tuple(
        LayerTiming(fwd_ms=1.0, bwd_ms=2.0, update_ms=u, num_params=n, act_bytes=a, output_bytes=o)
        for u, n, a, o in zip(UPDATE_MS, PARAMS, ACT_BYTES, (1e6, 1e6, 1e6, HEAD_OUT), strict=True)
    )
    entries = {}
    for tp in (1, 2):  # the same per-GPU figures at TP 2: only the NIC's sharing differs
        key = EntryKey(
            model=TOY.name, gpu_type="A100-40", tensor_parallel=tp, micro_batch_size=1, seq_len=128
        )
        entries[key] = ProfileEntry(key=key, source="measured", dtype="bf16", layers=layers)
    return CostTables(TOY, Profile(entries=entries), TRAINING, gpu_specs=UNFIXED)


def cluster(
    hosts: Sequence[tuple[str, int]],
    pairs: Sequence[tuple[str, str, float]] = (),
    nics: int | None = None,
) -> Cluster:
    """8 Gbit/s (1e9 B/s) inside a host, 0.8 Gbit/s (1e8 B/s) between hosts (per NIC;
    ``nics``: the hosts' inter-node NICs, None for one per GPU)."""
    return cluster_from_dict(
        {
            "schema": "autohet.cluster/v1",
            "name": "toy",
            "network": {
                "inter_node_gbps": 0.8,
                "pairs": [{"hosts": [a, b], "gbps": g} for a, b, g in pairs],
            },
            "hosts": [
                {"name": n, "gpus": {"type": "A100-40", "count": c}, "intra_node_gbps": 8.0}
                | ({} if nics is None else {"nics": nics})
                for n, c in hosts
            ],
        },
        "test-cluster",
    )


def whole_model_replicas(
    hosts: Sequence[str], m: int = 2, shard: str = "weights", reshard: bool = True
) -> list[Pipeline]:
    """One single-stage pipeline per host, each holding the whole model."""
    return [
        Pipeline(
            num_microbatches=m,
            stages=(stage(0, 4, h, 0, shard=shard, reshard_after_forward=reshard),),
        )
        for h in hosts
    ]


def sharded_mem(holders: int, *, reshard: bool = True) -> int:
    """The memory formula of ``costmodel.sharding`` for one whole-model stage, 1 in flight."""
    state = sum(PARAMS) * TRAINING.state_bytes_per_param / holders
    # the layer at work and the next (prefetch): at most the last block and the head
    gathered = C16 * ((300_000 + 400_000) if reshard else sum(PARAMS))
    grad_buffer = max(PARAMS) * (REDUCE + C16)
    return int(state + gathered + grad_buffer + sum(ACT_BYTES) + 2 * HEAD_OUT + RESERVE)


def test_the_memory_of_a_sharded_stage_falls_with_its_holders_as_the_formula_says() -> None:
    hosts = [f"h{i}" for i in range(4)]
    c = cluster([(h, 1) for h in hosts])
    t = tables()
    two = evaluate(whole_model_replicas(hosts[:2]), c, t, 1)
    four = evaluate(whole_model_replicas(hosts), c, t, 1)
    for ev, P in ((two, 2), (four, 4)):
        for pe in ev.pipelines:
            assert pe.stages[0].mem_bytes == sharded_mem(P), P
    # 1e6 parameters of 16 bytes of state: half of them on each of 2, a quarter on each of 4
    drop = two.pipelines[0].stages[0].mem_bytes - four.pipelines[0].stages[0].mem_bytes
    assert drop == pytest.approx(1e6 * 16 * (1 / 2 - 1 / 4), abs=1)
    # the replicated stage holds all of it, and autocast's copies (none for the embedding)
    plain = evaluate(whole_model_replicas(hosts[:2], shard="none"), c, t, 1)
    cast = C16 * sum(PARAMS[1:])
    assert plain.pipelines[0].stages[0].mem_bytes == int(
        1e6 * 16 + sum(ACT_BYTES) + cast + 2 * HEAD_OUT + RESERVE
    )


def test_gathers_and_reduce_scatters_by_hand_across_hosts() -> None:
    """Two holders on two hosts (1e8 B/s): a ring of 2 moves half the bytes, so the
    gathers of the 16-bit layers take (1, 2, 3, 4) ms and the fp32 reduce-scatters
    (2, 4, 6, 8) ms, against a forward of 1 ms and a backward of 2 ms per layer."""
    c = cluster([("h0", 1), ("h1", 1)])
    ev = evaluate(whole_model_replicas(["h0", "h1"]), c, tables(), 1)
    # forward: g0 + (g1 - f0) + (g2 - f1) + (g3 - f2) = 1 + 1 + 2 + 3
    # backward (layer 3 first): g3 + r0, then per layer max(0, g_{i-1} + r_{i+1} - b_i):
    # layer 0: r1 - 2 = 2, layer 1: g0 + r2 - 2 = 5, layer 2: g1 + r3 - 2 = 8, layer 3: g2 - 2 = 1
    assert exposed_ms(
        [1.0] * 4, [2.0] * 4, [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0], reshard_after_forward=True
    ) == pytest.approx((7.0, 22.0))
    for pe in ev.pipelines:
        cost = pe.stages[0].cost
        assert (cost.fwd_ms, cost.bwd_ms) == pytest.approx((4.0 + 7.0, 8.0 + 22.0))
        assert cost.update_ms == pytest.approx(sum(UPDATE_MS) / 2)  # 1/P of the state
        assert pe.stages[0].grad_sync_ms == 0.0  # the reduce-scatters replaced it
    assert ev.grad_sync_ms == 0.0
    assert ev.pipeline_ms == pytest.approx(2 * (11.0 + 30.0))
    assert ev.optimizer_ms == pytest.approx(1.5)
    assert ev.iteration_ms == pytest.approx(82.0 + 1.5)


def test_the_ranks_of_a_tp_group_add_up_on_a_nic_they_share() -> None:
    """At TP 2 across hosts with one NIC each, both ranks' collectives cross it:
    twice the time of TP 1's, the gathers (2, 4, 6, 8) ms and the reduce-scatters
    (4, 8, 12, 16) ms. With a NIC per GPU (the default) each rank has its own."""
    plan = [
        Pipeline(num_microbatches=2, stages=(stage(0, 4, h, 0, 1, shard="weights"),))
        for h in ("h0", "h1")
    ]
    one_nic = cluster([("h0", 2), ("h1", 2)], nics=1)
    cost = evaluate(plan, one_nic, tables(), 1).pipelines[0].stages[0].cost
    # forward: 2 + (4 - 1) + (6 - 1) + (8 - 1); backward: g3 + r0 = 8 + 4, then
    # layer 0: r1 - 2 = 6, layer 1: g0 + r2 - 2 = 12, layer 2: g1 + r3 - 2 = 18, layer 3: g2 - 2 = 4
    assert (cost.fwd_ms, cost.bwd_ms) == pytest.approx((4.0 + 17.0, 8.0 + 52.0))
    own = evaluate(plan, cluster([("h0", 2), ("h1", 2)]), tables(), 1)
    # gathers (1, 2, 3, 4), reduce-scatters (2, 4, 6, 8) ms; forward 1 + 1 + 2 + 3;
    # backward g3 + r0 = 4 + 2, then layer 0: r1 - 2 = 2, layer 1: g0 + r2 - 2 = 5,
    # layer 2: g1 + r3 - 2 = 8, layer 3: g2 - 2 = 1
    assert (own.pipelines[0].stages[0].cost.fwd_ms, own.pipelines[0].stages[0].cost.bwd_ms) == (
        pytest.approx((4.0 + 7.0, 8.0 + 22.0))
    )


def test_a_slower_link_among_the_holders_costs_more_time() -> None:
    hosts = ["h0", "h1", "h2"]
    fast = evaluate(whole_model_replicas(hosts), cluster([(h, 1) for h in hosts]), tables(), 1)
    slow_cluster = cluster([(h, 1) for h in hosts], pairs=[("h1", "h2", 0.2)])
    slow = evaluate(whole_model_replicas(hosts), slow_cluster, tables(), 1)
    assert slow.iteration_ms > fast.iteration_ms
    # every holder waits for the slowest link of the ring, not only h1 and h2
    assert slow.pipelines[0].stages[0].cost.bwd_ms > fast.pipelines[0].stages[0].cost.bwd_ms
    # memory does not depend on the link
    assert [pe.stages[0].mem_bytes for pe in slow.pipelines] == [
        pe.stages[0].mem_bytes for pe in fast.pipelines
    ]


def test_keeping_the_weights_from_forward_to_backward_saves_a_gather_and_costs_memory() -> None:
    c = cluster([("h0", 1), ("h1", 1)])
    resharded = evaluate(whole_model_replicas(["h0", "h1"]), c, tables(), 1)
    kept = evaluate(whole_model_replicas(["h0", "h1"], reshard=False), c, tables(), 1)
    r, k = resharded.pipelines[0].stages[0], kept.pipelines[0].stages[0]
    assert k.cost.fwd_ms == r.cost.fwd_ms  # the forward still gathers
    # backward without its gathers: r0 + (r1 - 2) + (r2 - 2) + (r3 - 2) = 2 + 2 + 4 + 6
    assert k.cost.bwd_ms == pytest.approx(8.0 + 14.0)
    assert kept.iteration_ms < resharded.iteration_ms
    assert (r.mem_bytes, k.mem_bytes) == (sharded_mem(2), sharded_mem(2, reshard=False))
    assert k.mem_bytes > r.mem_bytes


def test_communication_is_hidden_when_the_compute_dominates() -> None:
    """Two holders on one host (1e9 B/s): gathers of (0.1 .. 0.4) ms and reduce-scatters
    of (0.2 .. 0.8) ms all fit in the 1 ms forwards and 2 ms backwards, but for the
    first gather of each pass and the last reduce-scatter."""
    c = cluster([("h0", 2)])
    plan = [
        Pipeline(num_microbatches=2, stages=(stage(0, 4, "h0", g, shard="weights"),))
        for g in (0, 1)
    ]
    ev = evaluate(plan, c, tables(), 1)
    cost = ev.pipelines[0].stages[0].cost
    assert cost.fwd_ms == pytest.approx(4.0 + 0.1)  # g0
    assert cost.bwd_ms == pytest.approx(8.0 + 0.4 + 0.2)  # g3 + r0


def test_plans_without_sharded_weights_keep_their_figures() -> None:
    """shard "none" and "optimizer" are costed as before, and a pipeline's stages that
    do not shard their weights keep their figures beside a stage that does."""
    c = cluster([("h0", 2), ("h1", 2)])
    t = tables()

    def plan(first: str) -> list[Pipeline]:
        return [
            Pipeline(
                num_microbatches=2,
                stages=(stage(0, 2, h, 0, shard=first), stage(2, 4, h, 1)),
            )
            for h in ("h0", "h1")
        ]

    none, optimizer = evaluate(plan("none"), c, t, 1), evaluate(plan("optimizer"), c, t, 1)
    assert none == optimizer
    mixed = evaluate(plan("weights"), c, t, 1)
    for pn, pm in zip(none.pipelines, mixed.pipelines, strict=True):
        assert pm.stages[1] == pn.stages[1]  # the unsharded stage: time, sync, memory
        assert pm.stages[0].grad_sync_ms == 0.0 < pn.stages[0].grad_sync_ms
        assert pm.stages[0].mem_bytes < pn.stages[0].mem_bytes


def test_zero1_leaves_the_weight_sharded_stages_to_themselves() -> None:
    c = cluster([("h0", 1), ("h1", 1)])
    zero1 = tables().with_zero1(True)
    ev = evaluate(whole_model_replicas(["h0", "h1"]), c, zero1, 1)
    assert ev.pipelines[0].stages[0].mem_bytes == sharded_mem(2)
    assert ev.optimizer_ms == pytest.approx(sum(UPDATE_MS) / 2)


def test_estimate_scores_a_plan_with_sharded_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(
        yaml.safe_dump(
            {
                "schema": "autohet.cluster/v1",
                "name": "two",
                "network": {"inter_node_gbps": 100.0},
                "hosts": [
                    {"name": h, "gpus": {"type": "A100-40", "count": 2}} for h in ("h0", "h1")
                ],
            }
        )
    )
    pipes = [
        [stage(0, 3, h, 0, shard="weights"), stage(3, 6, h, 1, shard="weights")]
        for h in ("h0", "h1")
    ]
    plan = planting.plan_of(*pipes, microbatches=4, seq_len=128, model="gpt-tiny")
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(plan_to_dict(plan)))
    if load_plan(plan_file).pipelines[0].stages[0].shard != "weights":
        # the YAML form does not carry ``shard`` yet: hand estimate the plan itself
        monkeypatch.setattr(estimate_cli, "load_plan", lambda _path: plan)
    app = typer.Typer()
    app.callback()(lambda: None)
    estimate_cli.register(app)
    args = ["estimate", str(plan_file), "--cluster", str(cluster_file), "--model", "gpt-tiny"]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    sharded = json.loads(res.stdout)
    assert sharded["iteration_time_s"] > 0
    text = CliRunner().invoke(app, args)
    assert text.exit_code == 0, text.output
    # the same plan replicated: more memory per GPU
    replicated = replace(
        plan,
        pipelines=tuple(
            replace(p, stages=tuple(replace(s, shard="none") for s in p.stages))
            for p in plan.pipelines
        ),
    )
    monkeypatch.setattr(estimate_cli, "load_plan", lambda _path: replicated)
    plain = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert plain["memory_peak_fraction"] > sharded["memory_peak_fraction"]


def test_a_tied_embedding_and_head_stay_whole() -> None:
    """The runtime leaves a tied embedding and head out of FSDP (runtime.fsdp_stage):
    they keep their whole state and are neither gathered nor reduce-scattered, but
    all-reduced over the holders at the end of the step, as replicated layers are.
    The same plan as test_gathers_and_reduce_scatters_by_hand_across_hosts, tied."""
    tied = replace(TOY, tied_embeddings=True)
    t = CostTables(tied, tables().profile, TRAINING, gpu_specs=UNFIXED)
    c = cluster([("h0", 1), ("h1", 1)])
    ev = evaluate(whole_model_replicas(["h0", "h1"]), c, t, 1)
    # gathers (0, 2, 3, 0) ms, reduce-scatters (0, 4, 6, 0): layers 0 and 3 are tied
    f, b = exposed_ms(
        [1.0] * 4, [2.0] * 4, [0, 2.0, 3.0, 0], [0, 4.0, 6.0, 0], reshard_after_forward=True
    )
    # forward g0 + (g1 - f0) + (g2 - f1) + 0; backward g3 + r0, then layer 0: r1 - 2,
    # layer 1: g0 + r2 - 2, layer 2: max(0, g1 + r3 - 2), layer 3: g2 - 2
    assert (f, b) == pytest.approx((0 + 1 + 2 + 0, 0 + 2 + 4 + 0 + 1))
    state = TRAINING.state_bytes_per_param
    for pe in ev.pipelines:
        se = pe.stages[0]
        assert (se.cost.fwd_ms, se.cost.bwd_ms) == pytest.approx((4.0 + f, 8.0 + b))
        # the update: half of the blocks' (0.5 + 1.0) / 2, all of the tied layers' (0.5 + 1.0)
        assert se.cost.update_ms == pytest.approx((0.5 + 1.0) / 2 + 0.5 + 1.0)
        # the tied layers' 5e5 parameters whole, the blocks' 5e5 halved; and their
        # autocast copies (the head's; the embedding's lookup casts nothing); FSDP
        # gathers and reduce-scatters the blocks only: the working set is blocks 1
        # and 2 (5e5, not block 2 and the head's 7e5), the gradient buffer block 2's
        # 3e5 (not the head's 4e5)
        untied = evaluate(whole_model_replicas(["h0", "h1"]), c, tables(), 1)
        extra = 500_000 * state / 2 + C16 * 400_000
        extra -= C16 * 200_000 + 100_000 * (REDUCE + C16)
        assert se.mem_bytes == untied.pipelines[0].stages[0].mem_bytes + int(extra)
        # the tied layers' all-reduce: 1e5 + 4e5 fp32 gradients over the two hosts
        assert se.grad_sync_ms == pytest.approx(
            ring_allreduce_ms(100_000 * 4, 2, 0.8) + ring_allreduce_ms(400_000 * 4, 2, 0.8)
        )


def test_a_pipeline_with_fewer_microbatches_is_costed_at_the_padded_count() -> None:
    """The runtime pads every pipeline of a weight-sharded plan to the most
    micro-batches (``fsdp_stage.padded_microbatches``: the holders' gathers pair up),
    so the pipeline of 1 runs 3 as its holder's does: the same time and activations
    in flight; the tokens stay the 4 real micro-batches."""
    c = cluster([("h0", 2), ("h1", 2)])

    def two(host: str, m: int) -> Pipeline:
        return Pipeline(
            num_microbatches=m,
            stages=(stage(0, 2, host, 0, shard="weights"), stage(2, 4, host, 1, shard="weights")),
        )

    ev = evaluate([two("h0", 3), two("h1", 1)], c, tables(), 1)
    three, one = ev.pipelines
    assert one.time_ms == three.time_ms
    assert [s.mem_bytes for s in one.stages] == [s.mem_bytes for s in three.stages]
    assert ev.tokens_per_s == pytest.approx(4 * TRAINING.seq_len / (ev.iteration_ms / 1e3))
