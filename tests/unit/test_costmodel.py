"""The cost model: hand-computed plans, monotonicity properties, cost tables, analytic profiles."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autohet_cli import catalog
from autohet_cli.cluster import Cluster, cluster_from_dict
from autohet_cli.costmodel.evaluate import PlanEval, evaluate, ring_allreduce_ms
from autohet_cli.costmodel.fixed import TP_COLLECTIVES
from autohet_cli.costmodel.pipeline import closed_form_1f1b, simulate_1f1b
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.models import ModelSpec, get_model
from autohet_cli.plan import Pipeline, Stage
from autohet_cli.profiling.analytic import analytic_entry
from autohet_cli.profiling.schema import (
    EntryKey,
    LayerTiming,
    Profile,
    ProfileEntry,
    load_profile,
)
from autohet_cli.settings import TrainingSettings
from tests import planting
from tests.bruteforce import tiny_model

ROOT = Path(__file__).resolve().parents[2]
PROPERTY = settings(deadline=None, max_examples=60, derandomize=True)
GIB = catalog.GIB

# A 4-layer model (embedding, two blocks, head) whose measured profile we write by hand.
TOY = tiny_model(2)
TRAINING = TrainingSettings(global_batch_size=4, micro_batch_size=1, seq_len=128)

# Per layer: fwd 1 ms, bwd 2 ms; the rest differs per layer so that a wrong range shows.
UPDATE_MS = (0.5, 0.5, 1.0, 1.0)
PARAMS = (100_000, 200_000, 300_000, 400_000)
ACT_BYTES = (1e6, 2e6, 3e6, 4e6)
OUT_BYTES = (1e6, 1e6, 1e6, 5e5)
# Under bf16 on a GPU, autocast's 16-bit copy of each layer's weights, 2 bytes per
# parameter (none for the embedding), held once per step by a plain stage; a
# recompute stage's working layer holds its activations and its copy (ACT_RUN).
CAST = (0.0, 4e5, 6e5, 8e5)
ACT_RUN = tuple(a + c for a, c in zip(ACT_BYTES, CAST, strict=True))

# 8 Gbit/s = 1e9 B/s inside a host (1e6 B take 1 ms); 0.8 Gbit/s = 1e8 B/s between hosts.
INTRA_GBPS = 8.0
INTER_GBPS = 0.8


def toy_layers(
    fwd_ms: Sequence[float] = (1.0,) * 4, bwd_ms: Sequence[float] = (2.0,) * 4
) -> tuple[LayerTiming, ...]:
    return tuple(
        LayerTiming(
            fwd_ms=f,
            bwd_ms=b,
            update_ms=u,
            num_params=n,
            act_bytes=a,
            output_bytes=o,
        )
        for f, b, u, n, a, o in zip(
            fwd_ms, bwd_ms, UPDATE_MS, PARAMS, ACT_BYTES, OUT_BYTES, strict=True
        )
    )


def entry(
    gpu_type: str,
    layers: tuple[LayerTiming, ...],
    *,
    tp: int = 1,
    mbs: int = 1,
    model: ModelSpec = TOY,
    seq_len: int = TRAINING.seq_len,
    source: str = "measured",
) -> ProfileEntry:
    names = {"model": model.name, "seq_len": seq_len}
    key = EntryKey(gpu_type=gpu_type, tensor_parallel=tp, micro_batch_size=mbs, **names)
    return ProfileEntry(key=key, source=source, dtype="bf16", layers=layers)


# The hand-computed plans count measured times and bytes only: their GPU types carry
# no fixed costs (per op, message and step; test_costmodel_fixed covers those).
NO_FIXED = replace(
    catalog.GPU_FIXED, op_us=0.0, tp_op_us=0.0, hop_us=0.0, step_us=0.0, optimizer_ops_per_tensor=0
)
UNFIXED = {name: replace(spec, fixed=NO_FIXED) for name, spec in catalog.CATALOG.items()}


def toy_tables(*entries: ProfileEntry) -> CostTables:
    found = entries or (entry("A100-40", toy_layers()), entry("A100-40", toy_layers(), tp=2))
    return CostTables(TOY, Profile(entries={e.key: e for e in found}), TRAINING, gpu_specs=UNFIXED)


def make_cluster(
    hosts: Sequence[tuple[str, int]],
    *,
    gpu_type: str = "A100-40",
    inter: float = INTER_GBPS,
    intra: float = INTRA_GBPS,
    pairs: Sequence[tuple[str, str, float]] = (),
    nics: int | None = None,
) -> Cluster:
    return cluster_from_dict(
        {
            "schema": "autohet.cluster/v1",
            "name": "toy",
            "network": {
                "inter_node_gbps": inter,
                "pairs": [{"hosts": [a, b], "gbps": g} for a, b, g in pairs],
            },
            "hosts": [
                {"name": n, "gpus": {"type": gpu_type, "count": c}, "intra_node_gbps": intra}
                | ({} if nics is None else {"nics": nics})
                for n, c in hosts
            ],
        },
        "test-cluster",
    )


stage = functools.partial(planting.stage, gpu_type="A100-40")


def pipe(m: int, *stages: Stage) -> Pipeline:
    return Pipeline(num_microbatches=m, stages=stages)


def state_bytes(num_params: int) -> float:
    return num_params * TRAINING.state_bytes_per_param


RESERVE = catalog.CATALOG["A100-40"].runtime_reserve_bytes
CAPACITY = catalog.CATALOG["A100-40"].mem_bytes


# --- hand-computed plans --------------------------------------------------------------------


def test_one_pipeline_two_stages_by_hand() -> None:
    cluster = make_cluster([("h0", 2)])
    plan = [pipe(4, stage(0, 2, "h0", 0), stage(2, 4, "h0", 1))]
    ev = evaluate(plan, cluster, toy_tables(), 1)

    # f = 2, b = 4 per stage; the 1e6-byte activation crosses the 1e9 B/s link in 1 ms.
    # Stage 1: F0 3-5, B0 5-9, F1 9-11, B1 11-15, F2 17-19 (F(0, 2) ended at 16), B2 19-23,
    # F3 23-25, B3 25-29; then B(0, 3) after the 1 ms send: 30-34.
    assert ev.pipelines[0].stages[0].send_ms == pytest.approx(1.0)
    assert ev.pipelines[0].stages[1].send_ms == 0.0
    assert ev.pipeline_ms == pytest.approx(34.0)
    assert ev.pipeline_ms == pytest.approx(simulate_1f1b([2, 2], [4, 4], 4, [1.0]).makespan_ms)
    # (m - 1) * (max(c + h) + max h) + sum(c) + 2 * send = 3 * (6.5 + 0.5) + 12 + 2
    assert ev.pipelines[0].closed_form_ms == pytest.approx(35.0)
    assert ev.grad_sync_ms == 0.0  # a single replica has nobody to sync with
    assert ev.optimizer_ms == pytest.approx(2.0)  # stage 1: 1.0 + 1.0
    assert ev.iteration_ms == pytest.approx(36.0)
    assert ev.closed_form_iteration_ms == pytest.approx(37.0)
    assert ev.tokens_per_s == pytest.approx(1 * 4 * 128 / 0.036)

    s0, s1 = ev.pipelines[0].stages
    # stage 0 of 2: 2 micro-batches in flight; buffers twice layer 1's output.
    mem0 = state_bytes(300_000) + sum(ACT_BYTES[:2]) * 2 + sum(CAST[:2]) + 2 * 1e6 + RESERVE
    # stage 1: 1 in flight; buffers twice the head's 5e5-byte output.
    mem1 = state_bytes(700_000) + sum(ACT_BYTES[2:]) * 1 + sum(CAST[2:]) + 2 * 5e5 + RESERVE
    assert s0.mem_bytes == int(mem0)
    assert s1.mem_bytes == int(mem1)
    assert s1.mem_fraction == pytest.approx(mem1 / CAPACITY)
    assert ev.memory_peak_fraction == pytest.approx(mem1 / CAPACITY)
    assert (s0.cost.num_params, s1.cost.num_params) == (300_000, 700_000)
    assert (s0.cost.update_ms, s1.cost.update_ms) == (1.0, 2.0)


def test_in_flight_microbatches_are_capped_by_their_number() -> None:
    cluster = make_cluster([("h0", 4)])
    plan = [pipe(2, *(stage(i, i + 1, "h0", i) for i in range(4)))]
    ev = evaluate(plan, cluster, toy_tables(), 1)
    # stage s of 4 holds min(4 - s, 2) micro-batches: 2, 2, 2, 1
    for s, (in_flight, st_eval) in enumerate(
        zip((2, 2, 2, 1), ev.pipelines[0].stages, strict=True)
    ):
        expect = (
            state_bytes(PARAMS[s]) + ACT_BYTES[s] * in_flight + CAST[s] + 2 * OUT_BYTES[s] + RESERVE
        )
        assert st_eval.mem_bytes == int(expect), s


def test_memory_follows_the_training_settings() -> None:
    sgd = TrainingSettings(global_batch_size=4, micro_batch_size=1, seq_len=128, optimizer="sgd")
    e = entry("A100-40", toy_layers())
    tables = CostTables(TOY, Profile(entries={e.key: e}), sgd)
    cluster = make_cluster([("h0", 1)])
    ev = evaluate([pipe(4, stage(0, 4, "h0", 0))], cluster, tables, 1)
    expect = 1_000_000 * 12 + sum(ACT_BYTES) * 1 + sum(CAST) + 2 * 5e5 + RESERVE
    assert ev.pipelines[0].stages[0].mem_bytes == int(expect)


def test_autocast_weight_copies_count_under_16_bits_on_a_gpu_only() -> None:
    """The runtime keeps fp32 master weights and casts them under autocast once per
    step (test_runtime_model); fp32 runs and CPUs (which compute in fp32 whatever the
    plan says) make no copies."""
    layers = toy_layers()
    on_gpu = toy_tables().table("A100-40", 1, 1, INTRA_GBPS).stage(0, 4)
    assert on_gpu.act_bytes == sum(ACT_BYTES) and on_gpu.cast_bytes == 2 * sum(PARAMS[1:])
    fp32 = replace(TRAINING, precision="fp32")
    for gpu, training in (("A100-40", fp32), ("cpu", TRAINING)):
        e = replace(entry(gpu, layers), dtype=training.precision)
        tables = CostTables(TOY, Profile(entries={e.key: e}), training)
        cost = tables.table(gpu, 1, 1, INTRA_GBPS).stage(0, 4)
        assert (cost.act_bytes, cost.cast_bytes) == (sum(ACT_BYTES), 0.0)


def test_two_pipelines_with_different_boundaries_by_hand() -> None:
    cluster = make_cluster([("h0", 2), ("h1", 2)])
    a = pipe(3, stage(0, 1, "h0", 0), stage(1, 4, "h0", 1))
    b = pipe(1, stage(0, 3, "h1", 0), stage(3, 4, "h1", 1))
    ev = evaluate([a, b], cluster, toy_tables(), 1)

    # Cuts {0, 1, 3, 4}: segments [0,1) [1,3) [3,4) hold 1e5, 5e5, 4e5 params, i.e.
    # 4e5, 2e6, 1.6e6 gradient bytes (fp32 all-reduce, settings.GRAD_REDUCE_BYTES). Ring
    # of 2 over the 1e8 B/s link: 2(D-1)/D = 1, so 4, 20 and 16 ms. Each stage syncs its
    # segments one after the other.
    per_stage = [[4.0, 36.0], [24.0, 16.0]]
    for pe, expect in zip(ev.pipelines, per_stage, strict=True):
        assert [s.grad_sync_ms for s in pe.stages] == pytest.approx(expect)
    assert ev.grad_sync_ms == pytest.approx(36.0)

    sim_a = simulate_1f1b([1, 3], [2, 6], 3, [1.0]).makespan_ms
    # b by hand: F 0-3, send, F 4-5, B 5-7, send, B 8-14
    assert ev.pipelines[1].time_ms == pytest.approx(14.0)
    assert ev.pipelines[0].time_ms == pytest.approx(sim_a)
    assert ev.pipeline_ms == pytest.approx(max(sim_a, 14.0))
    assert ev.optimizer_ms == pytest.approx(2.5)  # a's stage 1: 0.5 + 1 + 1
    assert ev.iteration_ms == pytest.approx(max(sim_a, 14.0) + 36.0 + 2.5)
    assert ev.tokens_per_s == pytest.approx((3 + 1) * 128 / (ev.iteration_ms / 1e3))
    # stage 0 of a holds min(2, 3) = 2 micro-batches, stage 0 of b only its m = 1
    b0 = ev.pipelines[1].stages[0]
    b0_mem = state_bytes(600_000) + sum(ACT_BYTES[:3]) * 1 + sum(CAST[:3]) + 2 * 1e6 + RESERVE
    assert b0.mem_bytes == int(b0_mem)


def test_grad_sync_inside_one_host_uses_the_intra_node_link() -> None:
    cluster = make_cluster([("h0", 2)])
    plan = [pipe(2, stage(0, 4, "h0", 0)), pipe(2, stage(0, 4, "h0", 1))]
    ev = evaluate(plan, cluster, toy_tables(), 1)
    # 1e6 params * 4 bytes (fp32 gradients), ring of 2, at 1e9 B/s
    assert ev.grad_sync_ms == pytest.approx(4.0)


def test_grad_sync_waits_for_the_slowest_link_of_the_ring() -> None:
    cluster = make_cluster([("h0", 1), ("h1", 1), ("h2", 1)], pairs=[("h1", "h2", 0.4)])
    plan = [pipe(1, stage(0, 4, h, 0)) for h in ("h0", "h1", "h2")]
    tables = toy_tables()
    ev = evaluate(plan, cluster, tables, 1)
    # 2 * (3-1)/3 * 4e6 B (1e6 fp32 gradients) / 5e7 B/s
    assert ev.grad_sync_ms == pytest.approx(2 * 2 / 3 * 4e6 / 5e7 * 1e3)
    assert ev.grad_sync_ms == pytest.approx(ring_allreduce_ms(4e6, 3, 0.4))
    faster = make_cluster([("h0", 1), ("h1", 1), ("h2", 1)])
    assert evaluate(plan, faster, tables, 1).grad_sync_ms == pytest.approx(
        ring_allreduce_ms(4e6, 3, INTER_GBPS)
    )


def test_tp_groups_across_hosts_add_up_on_a_nic_they_share() -> None:
    plan = [pipe(2, stage(0, 4, "h0", 0, 1)), pipe(2, stage(0, 4, "h1", 0, 1))]
    # each GPU holds 1e6 params (the tp=2 entry is per GPU) of 4-byte fp32 gradients
    one_nic = make_cluster([("h0", 2), ("h1", 2)], nics=1)
    ev = evaluate(plan, one_nic, toy_tables(), 1)
    # both ranks' rings cross the host's one NIC
    assert ev.grad_sync_ms == pytest.approx(1e6 * 4 * 2 / 1e8 * 1e3)
    # the measured tp=2 entry already contains TP communication: nothing is added
    assert ev.pipelines[0].stages[0].cost.fwd_ms == pytest.approx(4.0)
    # a NIC per GPU (the default, and nics: 2): each ring has its own
    for nics in (None, 2):
        cluster = make_cluster([("h0", 2), ("h1", 2)], nics=nics)
        assert evaluate(plan, cluster, toy_tables(), 1).grad_sync_ms == pytest.approx(
            1e6 * 4 / 1e8 * 1e3
        )
    # 4 GPUs on 2 NICs: two GPUs per NIC, so a TP-2 group's two ranks share one
    four = [pipe(2, stage(0, 4, "h0", 0, 1)), pipe(2, stage(0, 4, "h1", 0, 1))]
    two_per_nic = make_cluster([("h0", 4), ("h1", 4)], nics=2)
    assert evaluate(four, two_per_nic, toy_tables(), 1).grad_sync_ms == pytest.approx(
        1e6 * 4 * 2 / 1e8 * 1e3
    )


def test_segment_held_at_two_tp_degrees_syncs_through_the_full_gradient() -> None:
    cluster = make_cluster([("h0", 2), ("h1", 2)])
    plan = [pipe(2, stage(0, 4, "h0", 0, 1)), pipe(2, stage(0, 4, "h1", 0))]
    ev = evaluate(plan, cluster, toy_tables(), 1)
    full = 1e6 * 4 * 2  # the TP-2 stage's 1e6 params per GPU, gathered, in fp32
    # gather (t-1)/t and broadcast the whole inside h0 (1e9 B/s), then one ring of the
    # full gradient between the hosts' TP rank 0 (1e8 B/s)
    inside = (full / 2 + full) / 1e9 * 1e3
    assert ev.grad_sync_ms == pytest.approx(inside + ring_allreduce_ms(full, 2, INTER_GBPS))
    assert [s.grad_sync_ms for p in ev.pipelines for s in p.stages] == [ev.grad_sync_ms] * 2


def test_sends_between_degrees_count_the_copies_one_rank_sends() -> None:
    cluster = make_cluster([("h0", 3)])
    tables = toy_tables()
    widening = [pipe(2, stage(0, 2, "h0", 0), stage(2, 4, "h0", 1, 2))]
    narrowing = [pipe(2, stage(0, 2, "h0", 0, 1), stage(2, 4, "h0", 2))]
    wide = evaluate(widening, cluster, tables, 1).pipelines[0].stages[0].send_ms
    narrow = evaluate(narrowing, cluster, tables, 1).pipelines[0].stages[0].send_ms
    # layer 1's 1e6 output bytes at 1e9 B/s, two copies one after the other: forward
    # to the wider stage, or backward to the wider one; charged alike both ways
    assert wide == pytest.approx(narrow)
    uniform = [pipe(2, stage(0, 2, "h0", 0), stage(2, 4, "h0", 1))]
    one = evaluate(uniform, cluster, tables, 1).pipelines[0].stages[0].send_ms
    assert wide - one == pytest.approx(1.0)


def test_zero1_shards_the_optimizer_state_of_untied_layers_over_the_replicas() -> None:
    cluster = make_cluster([("h0", 1), ("h1", 1)])
    plan = [pipe(2, stage(0, 4, "h0", 0)), pipe(2, stage(0, 4, "h1", 0))]
    plain = evaluate(plan, cluster, toy_tables(), 1)
    zero = CostTables(TOY, toy_tables().profile, replace(TRAINING, zero1=True), gpu_specs=UNFIXED)
    ev = evaluate(plan, cluster, zero, 1)
    # layers 1 and 2 (500k parameters; the tied embedding and head stay replicated):
    # half of their Adam moments (8 bytes a parameter) leave each GPU, and half of
    # their update
    assert plain.pipelines[0].stages[0].mem_bytes - ev.pipelines[0].stages[0].mem_bytes == (
        250_000 * 8
    )
    assert ev.pipelines[0].stages[0].cost.update_ms == pytest.approx(3.0 * (1 - 0.25))
    assert ev.grad_sync_ms == pytest.approx(plain.grad_sync_ms)  # RS + AG = all-reduce
    alone = [pipe(4, stage(0, 4, "h0", 0))]
    assert evaluate(alone, cluster, zero, 1) == evaluate(alone, cluster, toy_tables(), 1)


def test_closed_form_bounds_the_simulator_with_uneven_forward_shares() -> None:
    # The pipeline.py docstring's counter-example: S = m = 6, f = (0,1,0,0,0,0),
    # b = (1,0,0,0,0,0); the simulator takes 11 ms, a single-share closed form says 7.
    model = replace(TOY, name="toy-6", num_blocks=4)
    zero = LayerTiming(
        fwd_ms=0.0, bwd_ms=0.0, update_ms=0.0, num_params=1, act_bytes=0.0, output_bytes=0.0
    )
    layers = [zero] * 6
    layers[0] = LayerTiming(
        fwd_ms=0.0, bwd_ms=1.0, update_ms=0.0, num_params=1, act_bytes=0.0, output_bytes=0.0
    )
    layers[1] = LayerTiming(
        fwd_ms=1.0, bwd_ms=0.0, update_ms=0.0, num_params=1, act_bytes=0.0, output_bytes=0.0
    )
    e = entry("A100-40", tuple(layers), model=model)
    tables = CostTables(model, Profile(entries={e.key: e}), TRAINING, gpu_specs=UNFIXED)
    cluster = make_cluster([("h0", 6)])
    ev = evaluate([pipe(6, *(stage(i, i + 1, "h0", i) for i in range(6)))], cluster, tables, 1)
    assert ev.pipeline_ms == pytest.approx(11.0)
    assert ev.closed_form_iteration_ms >= ev.iteration_ms


# --- properties over random small plans on random small clusters -----------------------------

MODEL = get_model("GPT-1.3B")
PROP_TRAINING = TrainingSettings(global_batch_size=64, micro_batch_size=1, seq_len=1024)
NUM_LAYERS = MODEL.num_layers


@dataclass(frozen=True)
class Shape:
    """A plan without GPU types: materialised against a cluster spec."""

    tp: int
    mbs: int
    # per pipeline: (num_microbatches, ((host index, first gpu, start, end), ...))
    pipelines: tuple[tuple[int, tuple[tuple[int, int, int, int], ...]], ...]


@dataclass(frozen=True)
class ClusterSpec:
    hosts: tuple[tuple[str, int, float], ...]  # (gpu type, count, intra Gbit/s)
    inter_gbps: float
    pair_gbps: float | None  # override between host 0 and host 1

    def build(self, *, inter_scale: float = 1.0, intra_scale: float = 1.0) -> Cluster:
        pairs = []
        if self.pair_gbps is not None:
            pairs = [{"hosts": ["h0", "h1"], "gbps": self.pair_gbps * inter_scale}]
        hosts = [
            {
                "name": f"h{i}",
                # memory pinned, so that swapping the GPU type keeps each host's memory
                "gpus": {"type": t, "count": c, "mem_gb": 16},
                "intra_node_gbps": intra * intra_scale,
            }
            for i, (t, c, intra) in enumerate(self.hosts)
        ]
        return cluster_from_dict(
            {
                "schema": "autohet.cluster/v1",
                "name": "random",
                "network": {"inter_node_gbps": self.inter_gbps * inter_scale, "pairs": pairs},
                "hosts": hosts,
            },
            "random-cluster",
        )


def materialise(shape: Shape, spec: ClusterSpec) -> list[Pipeline]:
    out = []
    for m, stages in shape.pipelines:
        built = []
        for h, g, start, end in stages:
            gpus = range(g, g + shape.tp)
            built.append(stage(start, end, f"h{h}", *gpus, gpu_type=spec.hosts[h][0]))
        out.append(pipe(m, *built))
    return out


GPU_TYPES = ("V100-16", "A100-40", "RTX-3090")


@st.composite
def cluster_specs(draw: st.DrawFn, types: Sequence[str] = GPU_TYPES) -> ClusterSpec:
    num_hosts = draw(st.integers(2, 3))
    hosts = tuple(
        (
            draw(st.sampled_from(types)),
            draw(st.sampled_from((2, 4))),
            draw(st.sampled_from((64.0, 256.0, 1200.0, 2400.0))),
        )
        for _ in range(num_hosts)
    )
    inter = draw(st.sampled_from((10.0, 25.0, 100.0)))
    pair = draw(st.none() | st.sampled_from((5.0, 50.0)))
    return ClusterSpec(hosts=hosts, inter_gbps=inter, pair_gbps=pair)


@st.composite
def shapes(draw: st.DrawFn, spec: ClusterSpec, tps: Sequence[int] = (1, 2)) -> Shape:
    tp = draw(st.sampled_from(tps))
    groups = [(h, g) for h, (_, count, _) in enumerate(spec.hosts) for g in range(0, count, tp)]
    groups = draw(st.permutations(groups))
    num_pipelines = draw(st.integers(1, min(3, len(groups))))
    pipelines = []
    for p in range(num_pipelines):
        left = len(groups) - (num_pipelines - p - 1)
        num_stages = draw(st.integers(1, min(3, left)))
        mine, groups = groups[:num_stages], groups[num_stages:]
        cuts = draw(
            st.lists(
                st.integers(1, NUM_LAYERS - 1),
                min_size=num_stages - 1,
                max_size=num_stages - 1,
                unique=True,
            )
        )
        bounds = [0, *sorted(cuts), NUM_LAYERS]
        stages = tuple((h, g, bounds[i], bounds[i + 1]) for i, (h, g) in enumerate(mine))
        pipelines.append((draw(st.integers(1, 8)), stages))
    return Shape(tp=tp, mbs=draw(st.sampled_from((1, 2))), pipelines=tuple(pipelines))


@st.composite
def scenarios(
    draw: st.DrawFn, types: Sequence[str] = GPU_TYPES, tps: Sequence[int] = (1, 2)
) -> tuple[ClusterSpec, Shape]:
    spec = draw(cluster_specs(types))
    return spec, draw(shapes(spec, tps))


def run(spec: ClusterSpec, shape: Shape, **scale: float) -> PlanEval:
    tables = CostTables(MODEL, None, PROP_TRAINING)
    return evaluate(materialise(shape, spec), spec.build(**scale), tables, shape.mbs)


def at_most(a: float, b: float) -> bool:
    return a <= b * (1 + 1e-9) + 1e-12


@PROPERTY
@given(scenarios())
def test_closed_form_never_below_the_simulator(case: tuple[ClusterSpec, Shape]) -> None:
    spec, shape = case
    ev = run(spec, shape)
    assert at_most(ev.iteration_ms, ev.closed_form_iteration_ms)
    for pe in ev.pipelines:
        assert at_most(pe.time_ms, pe.closed_form_ms)


@PROPERTY
@given(scenarios())
def test_pipeline_time_is_the_simulator_and_the_closed_form_bounds_it(
    case: tuple[ClusterSpec, Shape],
) -> None:
    spec, shape = case
    ev = run(spec, shape)
    for pe, (m, _) in zip(ev.pipelines, shape.pipelines, strict=True):
        fwd = [s.cost.fwd_ms for s in pe.stages]
        bwd = [s.cost.bwd_ms for s in pe.stages]
        sends = [s.send_ms for s in pe.stages[:-1]]
        assert pe.time_ms == pytest.approx(simulate_1f1b(fwd, bwd, m, sends).makespan_ms)
        exact = closed_form_1f1b(
            [f + b for f, b in zip(fwd, bwd, strict=True)], m, sends, fwd_ms=fwd
        )
        assert at_most(pe.time_ms, exact)
    assert ev.iteration_ms == pytest.approx(ev.pipeline_ms + ev.grad_sync_ms + ev.optimizer_ms)


@PROPERTY
@given(scenarios(), st.sampled_from((1.5, 2.0, 10.0)), st.booleans())
def test_more_bandwidth_never_slows_an_iteration(
    case: tuple[ClusterSpec, Shape], factor: float, inter: bool
) -> None:
    spec, shape = case
    base = run(spec, shape)
    faster = run(spec, shape, **{"inter_scale" if inter else "intra_scale": factor})
    assert at_most(faster.iteration_ms, base.iteration_ms)
    assert at_most(faster.grad_sync_ms, base.grad_sync_ms)
    assert at_most(faster.pipeline_ms, base.pipeline_ms)


@PROPERTY
@given(scenarios(types=("V100-16",)), st.data())
def test_a_faster_gpu_never_slows_an_iteration(
    case: tuple[ClusterSpec, Shape], data: st.DataObject
) -> None:
    spec, shape = case
    upgrade = data.draw(
        st.lists(st.integers(0, len(spec.hosts) - 1), min_size=1, unique=True), label="upgrade"
    )
    hosts = tuple(
        ("A100-40", c, intra) if i in upgrade else (t, c, intra)
        for i, (t, c, intra) in enumerate(spec.hosts)
    )
    better = ClusterSpec(hosts=hosts, inter_gbps=spec.inter_gbps, pair_gbps=spec.pair_gbps)
    base, fast = run(spec, shape), run(better, shape)
    assert at_most(fast.iteration_ms, base.iteration_ms)
    assert fast.memory_peak_fraction == pytest.approx(base.memory_peak_fraction)


@PROPERTY
@given(scenarios(), st.data())
def test_more_microbatches_never_shorten_a_pipeline(
    case: tuple[ClusterSpec, Shape], data: st.DataObject
) -> None:
    spec, shape = case
    i = data.draw(st.integers(0, len(shape.pipelines) - 1), label="pipeline")
    extra = data.draw(st.integers(1, 4), label="extra")
    pipelines = list(shape.pipelines)
    m, stages = pipelines[i]
    pipelines[i] = (m + extra, stages)
    more = Shape(tp=shape.tp, mbs=shape.mbs, pipelines=tuple(pipelines))
    base, longer = run(spec, shape), run(spec, more)
    assert longer.pipelines[i].time_ms >= base.pipelines[i].time_ms
    assert longer.iteration_ms >= base.iteration_ms * (1 - 1e-12)


# --- cost tables: measured, analytic, calibrated ----------------------------------------------


def test_a_measured_entry_is_used_as_is() -> None:
    tables = toy_tables()
    table = tables.table("A100-40", 1, 1, INTRA_GBPS)
    assert table.source == "measured"
    assert tables.is_measured("A100-40", 1, 1)
    cost = table.stage(1, 3)
    assert (cost.fwd_ms, cost.bwd_ms, cost.update_ms) == (2.0, 4.0, 1.5)
    assert (cost.num_params, cost.act_bytes, cost.output_bytes) == (500_000, 5e6, 1e6)
    assert cost.cast_bytes == 1e6  # 2 bytes per parameter, held once
    # measured TP entries already contain their all-reduces
    assert tables.table("A100-40", 2, 1, 1.0).compute_ms(0, 4) == pytest.approx(12.0)


def test_analytic_fills_what_was_not_measured() -> None:
    tables = toy_tables()
    assert not tables.is_measured("V100-16", 1, 1)
    got = tables.entry("V100-16", 1, 1)
    want = analytic_entry(
        TOY,
        tables.spec("V100-16"),
        tp=1,
        micro_batch_size=1,
        seq_len=TRAINING.seq_len,
        precision="bf16",
        optimizer="adam",
    )
    assert got == want
    table = tables.table("V100-16", 1, 1, INTRA_GBPS)
    assert table.compute_ms(0, 4) == pytest.approx(sum(x.fwd_ms + x.bwd_ms for x in want.layers))


@pytest.mark.parametrize("tp", [2, 4])
def test_analytic_tp_tables_include_the_all_reduces(tp: int) -> None:
    training = TrainingSettings(global_batch_size=8, micro_batch_size=2, seq_len=512)
    tables = CostTables(MODEL, None, training)
    gbps = 400.0
    raw = tables.entry("A100-40", tp, 2)
    table = tables.table("A100-40", tp, 2, gbps)
    # two all-reduces of the block's output (s * b * h * 2 bytes) per block and pass,
    # and every TP collective's 2(t-1) messages (the mean of the layer's two passes)
    nbytes = 512 * 2 * MODEL.hidden_size * 2
    one = 2 * (tp - 1) / tp * nbytes / (gbps * 1e9 / 8) * 1e3
    hop = catalog.GPU_FIXED.hop_us / 1e3
    for i, layer in enumerate(MODEL.layers()):
        latency = sum(TP_COLLECTIVES[layer.kind]) / 2 * 2 * (tp - 1) * hop
        comm = (2 * one if layer.kind == "block" else 0.0) + latency
        cost = table.stage(i, i + 1)
        assert cost.fwd_ms == pytest.approx(raw.layers[i].fwd_ms + comm), i
        assert cost.bwd_ms == pytest.approx(raw.layers[i].bwd_ms + comm), i
    serial = tables.table("A100-40", 1, 2, gbps).compute_ms(0, NUM_LAYERS)
    assert table.compute_ms(0, NUM_LAYERS) > serial / tp
    # and a slower link costs more
    slow = tables.table("A100-40", tp, 2, gbps / 4).compute_ms(0, NUM_LAYERS)
    assert slow > table.compute_ms(0, NUM_LAYERS)


def test_calibration_scales_the_estimate_by_the_nearest_measurement() -> None:
    spec = UNFIXED["V100-16"]

    def analytic(tp: int, mbs: int) -> ProfileEntry:
        return analytic_entry(
            TOY,
            spec,
            tp=tp,
            micro_batch_size=mbs,
            seq_len=TRAINING.seq_len,
            precision="bf16",
            optimizer="adam",
        )

    def scaled(e: ProfileEntry, k: float) -> ProfileEntry:
        assert all(x.recompute_fwd_ms is x.recompute_bwd_ms is None for x in e.layers)
        layers = tuple(
            replace(x, fwd_ms=x.fwd_ms * k, bwd_ms=x.bwd_ms * k, update_ms=x.update_ms * k)
            for x in e.layers
        )
        return entry("V100-16", layers, tp=e.key.tensor_parallel, mbs=e.key.micro_batch_size)

    near = scaled(analytic(1, 1), 3.0)  # same TP, one mbs doubling away
    far = scaled(analytic(4, 2), 5.0)  # same mbs, but two TP doublings away
    tables = toy_tables(near, far)
    got = tables.entry("V100-16", 1, 2)
    assert got.source == "calibrated"
    for g, want in zip(got.layers, analytic(1, 2).layers, strict=True):
        assert g.fwd_ms == pytest.approx(3.0 * want.fwd_ms)
        assert g.bwd_ms == pytest.approx(3.0 * want.bwd_ms)
        assert g.update_ms == pytest.approx(3.0 * want.update_ms)
        assert g.num_params == want.num_params
    # another GPU type's measurements never calibrate this one
    other = analytic_entry(
        TOY,
        UNFIXED["A100-40"],
        tp=1,
        micro_batch_size=2,
        seq_len=TRAINING.seq_len,
        precision="bf16",
        optimizer="adam",
    )
    assert tables.entry("A100-40", 1, 2) == other


def test_calibration_against_a_perfect_tp_measurement_changes_nothing() -> None:
    # A measurement that agrees exactly with the analytic table (compute + all-reduces)
    # must leave the analytic table of a neighbouring micro-batch size unchanged.
    plain = CostTables(TOY, None, TRAINING, gpu_specs=UNFIXED)
    # The measurement was taken on a host with the catalog's NVLink bandwidth.
    gbps = catalog.CATALOG["V100-16"].intra_node_gbps
    t = plain.table("V100-16", 2, 1, gbps)
    layers = []
    for i in range(TOY.num_layers):
        c = t.stage(i, i + 1)
        layers.append(
            LayerTiming(
                fwd_ms=c.fwd_ms,
                bwd_ms=c.bwd_ms,
                update_ms=c.update_ms,
                num_params=c.num_params,
                act_bytes=c.act_bytes,
                output_bytes=c.output_bytes,
            )
        )
    measured = toy_tables(entry("V100-16", tuple(layers), tp=2, mbs=1))
    assert measured.table("V100-16", 2, 1, gbps).compute_ms(0, 4) == pytest.approx(
        t.compute_ms(0, 4)
    )
    assert measured.table("V100-16", 2, 2, gbps).compute_ms(0, 4) == pytest.approx(
        plain.table("V100-16", 2, 2, gbps).compute_ms(0, 4)
    )


def test_calibration_on_the_real_opt_350m_profile() -> None:
    profile = load_profile(ROOT / "profiles" / "sailor" / "OPT-350M.yaml")
    training = TrainingSettings(global_batch_size=64, micro_batch_size=8, seq_len=2048)
    tables = CostTables(get_model("OPT-350M"), profile, training)
    assert tables.is_measured("V100-16", 1, 4)
    assert not tables.is_measured("V100-16", 1, 8)  # ran out of memory in Sailor's runs
    layers = get_model("OPT-350M").num_layers
    measured_4 = tables.table("V100-16", 1, 4, 1200.0).compute_ms(0, layers)
    calibrated_8 = tables.table("V100-16", 1, 8, 1200.0).compute_ms(0, layers)
    raw_8 = total_ms(analytic(get_model("OPT-350M"), "V100-16", mbs=8))
    assert measured_4 < calibrated_8
    assert calibrated_8 / 2 <= 2 * measured_4 <= 2 * calibrated_8
    # the raw catalog estimate would look several times faster than the real card
    assert not (2 * measured_4) / 2 <= raw_8 <= 2 * (2 * measured_4)


# --- analytic profiles ----------------------------------------------------------------------


def analytic(
    model: ModelSpec, gpu: str, *, tp: int = 1, mbs: int = 1, seq_len: int = 2048
) -> ProfileEntry:
    return analytic_entry(
        model,
        catalog.CATALOG[gpu],
        tp=tp,
        micro_batch_size=mbs,
        seq_len=seq_len,
        precision="bf16",
        optimizer="adam",
    )


def total_ms(e: ProfileEntry) -> float:
    return sum(x.fwd_ms + x.bwd_ms for x in e.layers)


@pytest.mark.parametrize("name", ["GPT-1.3B", "LLaMA-2-7B", "OPT-350M"])
def test_analytic_time_grows_about_linearly_with_the_micro_batch(name: str) -> None:
    model = get_model(name)
    one = total_ms(analytic(model, "A100-40", mbs=1))
    for mbs in (2, 4, 8):
        ratio = total_ms(analytic(model, "A100-40", mbs=mbs)) / one
        assert 0.85 * mbs <= ratio <= mbs * (1 + 1e-9), mbs


@pytest.mark.parametrize("name", ["GPT-1.3B", "LLaMA-2-7B"])
def test_analytic_time_falls_with_the_tp_degree(name: str) -> None:
    model = get_model(name)
    times = [total_ms(analytic(model, "A100-40", tp=tp)) for tp in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)
    assert len(set(times)) == len(times)
    assert times[1] > times[0] / 2  # activations kept whole on every rank: never superlinear


@pytest.mark.parametrize(("slow", "fast"), [("V100-16", "A100-40"), ("A100-40", "H100-80")])
def test_a_faster_gpu_has_lower_analytic_times(slow: str, fast: str) -> None:
    for tp in (1, 2):
        a, b = analytic(MODEL, slow, tp=tp), analytic(MODEL, fast, tp=tp)
        for layer, x, y in zip(MODEL.layers(), a.layers, b.layers, strict=True):
            # a small layer (a norm, an embedding's backward) may take its ops' launch
            # time on either card; a block is the cards' arithmetic
            assert y.fwd_ms <= x.fwd_ms and y.bwd_ms <= x.bwd_ms and y.update_ms <= x.update_ms
            if layer.kind == "block" and tp == 1:  # under TP, DTensor's host time may bind
                assert y.fwd_ms < x.fwd_ms and y.bwd_ms < x.bwd_ms
            assert (y.num_params, y.act_bytes) == (x.num_params, x.act_bytes)
        assert total_ms(b) < total_ms(a)
        assert sum(x.update_ms for x in b.layers) < sum(x.update_ms for x in a.layers)


@pytest.mark.parametrize("name", ["GPT-1.3B", "LLaMA-2-7B", "OPT-350M"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_analytic_parameters_per_gpu_sum_to_the_model_over_tp(name: str, tp: int) -> None:
    model = get_model(name)
    layers = model.layers()
    # a tied head keeps its own copy of the embedding
    # the layers hold the vocabulary padded to a multiple of 128 (ModelSpec.padded_vocab_size)
    held = model.num_params + model.num_padding_params + sum(x.shared_params for x in layers)
    replicated = sum(x.num_params for x in layers if x.kind == "norm")
    per_gpu = sum(x.num_params for x in analytic(model, "A100-40", tp=tp).layers)
    low = (held - replicated) / tp + replicated - len(layers)  # floor division per layer
    high = held / tp + replicated
    assert low <= per_gpu <= high
    if tp == 1:
        assert per_gpu == held
