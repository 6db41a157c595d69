"""Rank mapping, segments, sync groups, batch shares and the 1F1B order (pure, no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autohet_cli.plan import Device, Pipeline, Plan, Stage
from autohet_cli.runtime.topology import BACKWARD, FORWARD, Topology, one_f_one_b
from autohet_cli.settings import TrainingSettings


def stage(a: int, b: int, *gpus: int, host: str = "localhost") -> Stage:
    return Stage(
        layer_start=a,
        layer_end=b,
        gpu_type="cpu",
        tensor_parallel=len(gpus),
        devices=tuple(Device(host=host, gpu=g) for g in gpus),
    )


def make_plan(*pipes: tuple[int, list[Stage]], tp: int = 1, mbs: int = 2) -> Plan:
    total = sum(m for m, _ in pipes)
    plan = Plan(
        name="t",
        version=1,
        model_name="gpt-tiny",
        num_layers=6,
        training=TrainingSettings(global_batch_size=total * mbs, micro_batch_size=mbs, seq_len=8),
        tensor_parallel=tp,
        pipelines=tuple(Pipeline(num_microbatches=m, stages=tuple(s)) for m, s in pipes),
    )
    plan.validate()
    return plan


# Pipeline 0: one stage, TP 2. Pipeline 1: [0,2) and [2,6), TP 2 each.
MIXED = make_plan(
    (3, [stage(0, 6, 0, 1)]),
    (5, [stage(0, 2, 2, 3), stage(2, 6, 4, 5)]),
    tp=2,
)


def test_ranks_enumerate_pipelines_then_stages_then_tp_ranks() -> None:
    topo = Topology(MIXED)
    got = [(i.pipeline, i.stage, i.tp_rank) for i in topo.ranks]
    assert got == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [i.device for i in topo.ranks] == MIXED.devices()
    assert topo.rank_of(1, 1, 0) == 4
    assert topo.ranks[4].layer_start == 2 and topo.ranks[4].num_microbatches == 5


def test_tp_groups_and_pipeline_neighbours() -> None:
    topo = Topology(MIXED)
    assert topo.tp_groups() == [(0, 1), (2, 3), (4, 5)]
    assert [topo.prev_rank(r) for r in range(6)] == [None, None, None, None, 2, 3]
    assert [topo.next_rank(r) for r in range(6)] == [None, None, 4, 5, None, None]


def test_segments_cut_at_every_boundary_of_every_pipeline() -> None:
    plan = make_plan(
        (1, [stage(0, 6, 0)]),
        (1, [stage(0, 2, 1), stage(2, 6, 2)]),
        (1, [stage(0, 3, 3), stage(3, 4, 4), stage(4, 6, 5)]),
    )
    assert Topology(plan).segments() == ((0, 2), (2, 3), (3, 4), (4, 6))


def test_sync_groups_one_stage_per_pipeline_matched_by_tp_rank() -> None:
    groups = Topology(MIXED).sync_groups()
    got = {(g.key, g.tp_rank): g.ranks for g in groups}
    assert got == {
        ("segment:0-2", 0): (0, 2),
        ("segment:0-2", 1): (1, 3),
        ("segment:2-6", 0): (0, 4),
        ("segment:2-6", 1): (1, 5),
    }


def test_tied_parameter_syncs_over_every_holder_of_any_tied_layer() -> None:
    groups = Topology(MIXED).sync_groups([("layers.0.wte.weight", (0, 5))])
    tied = {g.tp_rank: g.ranks for g in groups if g.key.startswith("tied:")}
    # Pipeline 0 holds both layers on one stage: it contributes its one copy once.
    assert tied == {0: (0, 2, 4), 1: (1, 3, 5)}


# TP per stage. Pipeline 0: [0,3) TP 2 (ranks 0,1), [3,6) TP 1 (rank 2).
# Pipeline 1: [0,2) TP 1 (rank 3), [2,4) TP 2 (ranks 4,5), [4,6) TP 1 (rank 6).
PER_STAGE = make_plan(
    (3, [stage(0, 3, 0, 1), stage(3, 6, 2)]),
    (5, [stage(0, 2, 3), stage(2, 4, 4, 5), stage(4, 6, 6)]),
    tp=2,
)


def test_neighbours_of_different_tp_degrees_map_rank_k_to_k_mod_degree() -> None:
    topo = Topology(PER_STAGE)
    # Activations: a receiver takes them from TP rank k mod (sender's degree) ...
    assert [topo.prev_rank(r) for r in range(7)] == [None, None, 0, None, 3, 3, 4]
    # ... and every sender sends to exactly the receivers that take from it.
    assert [topo.send_next(r) for r in range(7)] == [(2,), (), (), (4, 5), (6,), (), ()]
    # Gradients go back the same way.
    assert [topo.next_rank(r) for r in range(7)] == [2, 2, None, 4, 6, 6, None]
    assert [topo.send_prev(r) for r in range(7)] == [(), (), (0, 1), (), (3,), (), (4, 5)]
    for r in range(7):
        assert all(topo.prev_rank(t) == r for t in topo.send_next(r))
        assert all(topo.next_rank(t) == r for t in topo.send_prev(r))


def test_equal_degrees_keep_rank_to_rank_neighbours() -> None:
    topo = Topology(MIXED)
    assert [topo.send_next(r) for r in range(6)] == [(), (), (4,), (5,), (), ()]
    assert [topo.send_prev(r) for r in range(6)] == [(), (), (), (), (2,), (3,)]


def test_segments_held_at_different_degrees_sync_through_the_full_gradient() -> None:
    groups = Topology(PER_STAGE).sync_groups([("layers.0.wte.weight", (0, 5))])
    got = {(g.key, g.tp_rank): (g.full, g.ranks, g.members) for g in groups}
    assert got == {
        # TP 2 and TP 1: reduced by each stage's TP rank 0, gathered/broadcast by all.
        ("segment:0-2", 0): (True, (0, 3), (0, 1, 3)),
        # TP 2 in both pipelines: shards line up, rank k with rank k.
        ("segment:2-3", 0): (False, (0, 4), (0, 4)),
        ("segment:2-3", 1): (False, (1, 5), (1, 5)),
        ("segment:3-4", 0): (True, (2, 4), (2, 4, 5)),
        ("segment:4-6", 0): (False, (2, 6), (2, 6)),
        # Every stage holding layer 0 or 5 contributes its copy once.
        ("tied:layers.0.wte.weight", 0): (True, (0, 2, 3, 6), (0, 1, 2, 3, 6)),
    }


def test_checkpoint_writes_one_layout_per_name() -> None:
    topo = Topology(PER_STAGE)

    def writers(*layers: int) -> list[int]:
        return [r for r in range(7) if topo.writes_layout(r, layers)]

    assert writers(0) == [0, 1]  # TP 2 (first holder) and TP 1: the TP-2 halves only
    assert writers(2) == [0, 1, 4, 5]  # TP 2 in both pipelines: every replica
    assert writers(3) == [2]  # TP 1 first, beside TP 2
    assert writers(4) == [2, 6]
    assert writers(0, 5) == [0, 1]  # a tied group: its first holder's degree


def test_keep_written_filters_model_and_optimizer_entries_by_name() -> None:
    from autohet_cli.ckpt.state import keep_written

    state = {
        "model": {"layers.0.wte.weight": 1, "layers.5.lm_head.weight": 2, "layers.3.b": 3},
        "optimizer": {
            "state.layers.0.wte.weight.exp_avg": 4,
            "param_groups.layers.0.wte.weight.lr": 5,
            "state.layers.3.b.exp_avg": 6,
        },
        "step": 7,
    }
    tied = [("layers.0.wte.weight", "layers.5.lm_head.weight")]
    # A rank writing layers 3 and 5 only, not 0: the head's own model entry stays,
    # the tied optimizer state (filed under layer 0's name) goes with layer 0.
    kept = keep_written(state, lambda layers: 0 not in layers, tied)
    assert kept["model"] == {"layers.5.lm_head.weight": 2, "layers.3.b": 3}
    assert kept["optimizer"] == {"state.layers.3.b.exp_avg": 6}
    assert kept["step"] == 7


def test_sample_ranges_are_contiguous_in_plan_order() -> None:
    plan = make_plan((1, [stage(0, 6, 0)]), (2, [stage(0, 6, 1)]), (5, [stage(0, 6, 2)]), mbs=3)
    topo = Topology(plan)
    assert [topo.sample_range(p) for p in range(3)] == [(0, 3), (3, 9), (9, 24)]


def test_slot_for_host_follows_plan_order_on_that_host() -> None:
    # Plan order interleaves hosts; torchrun per host numbers a's workers first.
    plan = make_plan(
        (1, [stage(0, 3, 0, host="a"), stage(3, 6, 0, host="b")]),
        (1, [stage(0, 3, 1, host="a"), stage(3, 6, 1, host="b")]),
    )
    topo = Topology(plan)
    assert [topo.slot_for_host("a", k) for k in range(2)] == [0, 2]
    assert [topo.slot_for_host("b", k) for k in range(2)] == [1, 3]
    with pytest.raises(ValueError, match="LOCAL_RANK 2 on host 'a'"):
        topo.slot_for_host("a", 2)
    with pytest.raises(ValueError, match="host 'c' holds no device"):
        topo.slot_for_host("c", 0)


@pytest.mark.parametrize(
    ("num_stages", "stage_index", "m", "expected"),
    [
        (1, 0, 3, "F0 B0 F1 B1 F2 B2"),
        (2, 0, 3, "F0 F1 B0 F2 B1 B2"),
        (2, 1, 3, "F0 B0 F1 B1 F2 B2"),
        (3, 0, 1, "F0 B0"),  # fewer micro-batches than stages
        (4, 0, 2, "F0 F1 B0 B1"),
    ],
)
def test_one_f_one_b_by_hand(num_stages: int, stage_index: int, m: int, expected: str) -> None:
    got = " ".join(f"{k}{i}" for k, i in one_f_one_b(num_stages, stage_index, m))
    assert got == expected


@settings(deadline=None, max_examples=200, derandomize=True)
@given(st.integers(1, 8), st.data())
def test_one_f_one_b_is_a_valid_schedule(num_stages: int, data: st.DataObject) -> None:
    stage_index = data.draw(st.integers(0, num_stages - 1))
    m = data.draw(st.integers(1, 12))
    order = one_f_one_b(num_stages, stage_index, m)
    fwd = [i for k, i in order if k == FORWARD]
    bwd = [i for k, i in order if k == BACKWARD]
    assert fwd == list(range(m)) and bwd == list(range(m))
    in_flight = 0
    for kind, i in order:
        in_flight += 1 if kind == FORWARD else -1
        assert 0 <= in_flight <= num_stages - stage_index  # 1F1B's memory bound
        if kind == BACKWARD:
            assert (FORWARD, i) in order[: order.index((kind, i))]
