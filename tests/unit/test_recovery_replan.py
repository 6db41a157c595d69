"""Replanning after a loss: the contingency entry without solving, the planner on the
survivors otherwise, and the stability preference (keep layers in place when it costs
little), on the shipped small-mix cluster with Sailor's measured OPT-350M."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from autohet_cli.cluster import Cluster, cluster_from_dict, cluster_to_dict
from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import InfeasibleError
from autohet_cli.inputs import Inputs, load_inputs, tables_for
from autohet_cli.plan import (
    Device,
    Pipeline,
    Plan,
    Stage,
    check_against_cluster,
    load_plan,
    pipelines_entry,
    write_plan,
)
from autohet_cli.planner.api import PlanOutcome, make_plan, training_for
from autohet_cli.recovery.errors import RecoveryError
from autohet_cli.recovery.replan import (
    FIRST_SPACE_S,
    Candidate,
    Stability,
    align_devices,
    choose,
    keep_survivors,
    layer_state_bytes,
    replan,
    stability,
    tradeoff,
)

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "profiles" / "clusters" / "small-mix.yaml"
PROFILE = ROOT / "profiles" / "sailor" / "OPT-350M.yaml"
TYPES = {
    "a100-0": "A100-40",
    "a100-1": "A100-40",
    "v100-0": "V100-16",
    "v100-1": "V100-16",
    "rtx3090-0": "RTX-3090",
}
OLD_PATH = "plans/lab.v1.yaml"


@cache
def inputs() -> Inputs:
    return load_inputs(str(CLUSTER), "OPT-350M", [str(PROFILE)])


@cache
def tables() -> CostTables:
    inp = inputs()
    return tables_for(inp, training_for(32, inp.model.default_seq_len, "bf16", "adam"))


def pipe(m: int, *stages: tuple[str, int, int, int]) -> Pipeline:
    """A pipeline of one-GPU stages (host, gpu, layer start, layer end)."""
    return Pipeline(
        num_microbatches=m,
        stages=tuple(
            Stage(
                layer_start=a,
                layer_end=b,
                gpu_type=TYPES[h],
                tensor_parallel=1,
                devices=(Device(host=h, gpu=g),),
            )
            for h, g, a, b in stages
        ),
    )


def make_old(
    pipelines: list[Pipeline],
    contingency: dict[str, Any] | None = None,
    idle: tuple[dict[str, Any], ...] = (),
) -> Plan:
    plan = Plan(
        name="lab",
        version=1,
        model_name="OPT-350M",
        num_layers=26,
        training=tables().training,
        tensor_parallel=1,
        pipelines=tuple(pipelines),
        inputs={"cluster": {"path": str(CLUSTER), "sha256": "0" * 64}},
        contingency=contingency or {},
        idle=idle,
    )
    plan.validate()
    return plan


# The old plan: one V100 pipeline, two A100 replicas, two RTX 3090 pipelines.
OLD_PIPES = [
    pipe(4, ("v100-0", 0, 0, 13), ("v100-0", 1, 13, 26)),
    pipe(9, ("a100-0", 0, 0, 26)),
    pipe(9, ("a100-0", 1, 0, 26)),
    pipe(5, ("rtx3090-0", 0, 0, 13), ("rtx3090-0", 1, 13, 26)),
    pipe(5, ("rtx3090-0", 2, 0, 13), ("rtx3090-0", 3, 13, 26)),
]
# What `plan --contingency` found for losing v100-0: pure data parallelism.
V100_CONTINGENCY = [pipe(8, ("a100-0", 0, 0, 26)), pipe(8, ("a100-0", 1, 0, 26))] + [
    pipe(4, ("rtx3090-0", g, 0, 26)) for g in range(4)
]


def entry(pipelines: list[Pipeline], time_s: float = 1.9) -> dict[str, Any]:
    return {
        "feasible": True,
        "tensor_parallel": 1,
        "micro_batch_size": 1,
        "iteration_time_s": time_s,
        "pipelines": [pipelines_entry(p) for p in pipelines],
    }


def old_with_contingency() -> Plan:
    return make_old(
        OLD_PIPES,
        {
            "v100-0": entry(V100_CONTINGENCY),
            "rtx3090-0": {"feasible": False, "reason": "out of memory"},
        },
    )


def no_planner(**_: Any) -> PlanOutcome:
    raise AssertionError("the planner must not run when a contingency plan applies")


class Recording:
    """make_plan with a short time limit, recording its calls."""

    def __init__(self, raises: Exception | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.raises = raises

    def __call__(self, **kw: Any) -> PlanOutcome:
        self.calls.append(kw)
        if self.raises is not None:
            raise self.raises
        return make_plan(**{**kw, "time_limit_s": 3.0})


def layout(pipelines: Sequence[Pipeline]) -> list[tuple[tuple[int, int, Device], ...]]:
    """Layers and devices of each pipeline, in order (not the micro-batches)."""
    return [
        tuple((s.layer_start, s.layer_end, d) for s in p.stages for d in s.devices)
        for p in pipelines
    ]


def shape(plan: Plan) -> list[tuple[int, tuple[tuple[int, int, str, str], ...]]]:
    """Pipelines without GPU indices (what device relabelling leaves unchanged)."""
    return sorted(
        (
            p.num_microbatches,
            tuple((s.layer_start, s.layer_end, s.gpu_type, s.host) for s in p.stages),
        )
        for p in plan.pipelines
    )


# --------------------------------------------------------------------- contingency


def test_contingency_is_used_without_solving() -> None:
    old = old_with_contingency()
    r = replan(
        old, inputs().cluster, ["v100-0"], old_path=OLD_PATH, tables=tables(), planner=no_planner
    )
    assert r.solved is False
    assert r.chosen == "contingency"
    assert [c.kind for c in r.candidates] == ["contingency", "kept"]
    new = r.plan
    assert shape(new) == shape(replace(old, pipelines=tuple(V100_CONTINGENCY)))
    assert (new.name, new.version, new.parent) == ("lab", 0, OLD_PATH)
    assert new.training == old.training
    assert new.inputs == old.inputs
    assert new.contingency == {}  # entries were for the old cluster
    assert new.solver is not None and new.solver.status == "contingency"
    survivors = inputs().cluster.without({"v100-0"})
    again = evaluate(new.pipelines, survivors, tables(), 1)
    assert new.prediction is not None
    assert new.prediction.iteration_time_s == pytest.approx(again.iteration_ms / 1e3)
    assert all(s.predicted is not None for p in new.pipelines for s in p.stages)
    assert new.notes[0] == "recovered from the loss of v100-0"
    assert re.search(
        r"contingency plan: kept \d+% of layer state in place at \d+\.\d{3} "
        r"s/iteration; the kept plan would keep 100% in place but is \+\d+\.\d% "
        r"slower",
        new.notes[1],
    ), new.notes[1]
    check_against_cluster(new, {h.name: (h.gpu_type, h.num_gpus) for h in survivors.hosts}, "t")


def test_contingency_without_cost_tables_is_taken_as_recorded() -> None:
    old = old_with_contingency()
    r = replan(old, inputs().cluster, ["v100-0"], old_path=OLD_PATH, planner=no_planner)
    assert r.chosen == "contingency" and not r.solved
    assert [c.kind for c in r.candidates] == ["contingency"]
    assert r.candidates[0].iteration_time_s == 1.9
    assert r.plan.prediction is None
    # Without the model, stability counts placements: 2 A100 replicas x 26 layers kept.
    st = r.candidates[0].stability
    assert st.total_state_bytes == 0
    assert st.kept_placements == 52 + 2 * 26  # A100s, and the RTX GPUs' first 13 layers
    assert st.total_placements == 6 * 26
    assert "kept 67% of layer placements in place" in r.plan.notes[1]


def test_without_tables_and_without_contingency_it_cannot_solve() -> None:
    old = old_with_contingency()
    with pytest.raises(RecoveryError, match=r"infeasible: out of memory.*needs the plan.s inputs"):
        replan(old, inputs().cluster, ["rtx3090-0"], old_path=OLD_PATH, planner=no_planner)


@pytest.mark.parametrize(
    ("contingency", "lost", "note"),
    [
        (None, ["rtx3090-0"], "is infeasible: out of memory"),
        ({}, ["rtx3090-0"], "no contingency entry for rtx3090-0"),
        ({"v100-0": entry([pipe(32, ("a100-0", 7, 0, 26))])}, ["v100-0"], "does not apply"),
        (None, ["v100-0", "rtx3090-0"], "2 hosts lost"),
    ],
)
def test_contingency_that_does_not_apply_calls_the_planner(
    contingency: dict[str, Any] | None, lost: list[str], note: str
) -> None:
    old = old_with_contingency() if contingency is None else make_old(OLD_PIPES, contingency)
    rec = Recording(raises=InfeasibleError("stub: no plan"))
    r = replan(old, inputs().cluster, lost, old_path=OLD_PATH, tables=tables(), planner=rec)
    # the old plan's space first, then (nothing fit there) everything
    assert len(rec.calls) == 2
    assert rec.calls[0]["mbs_candidates"] == [old.training.micro_batch_size]
    assert "mbs_candidates" not in rec.calls[1] and rec.calls[1]["recompute"] is None
    assert r.chosen == "kept"  # the stub planner found nothing; what survived remains
    assert any(note in n for n in r.plan.notes), r.plan.notes
    assert any("no plan solved on the survivors: stub: no plan" in n for n in r.plan.notes)


def test_added_hosts_are_solved_for_instead_of_the_contingency() -> None:
    raw = cluster_to_dict(inputs().cluster)
    raw["hosts"].append({**raw["hosts"][0], "name": "a100-1", "address": "127.0.0.9"})
    bigger = cluster_from_dict(raw, "bigger.yaml")
    rec = Recording(raises=InfeasibleError("stub"))
    r = replan(
        old_with_contingency(), bigger, ["v100-0"], old_path=OLD_PATH, tables=tables(), planner=rec
    )
    assert r.added == ("a100-1",)
    assert len(rec.calls) == 2  # the old plan's space, then the full one
    assert {h.name for h in rec.calls[0]["cluster"].hosts} == {"a100-0", "rtx3090-0", "a100-1"}
    assert "hosts were added (a100-1): solved to use them" in r.plan.notes
    assert "(hosts added: a100-1)" in r.plan.notes[0]


# --------------------------------------------------------------------- solving


def test_replan_solves_on_the_survivors(tmp_path: Path) -> None:
    old = make_old(OLD_PIPES)  # planned without --contingency
    rec = Recording()
    r = replan(
        old,
        inputs().cluster,
        ["rtx3090-0"],
        old_path=str(tmp_path / "lab.v1.yaml"),
        tables=tables(),
        planner=rec,
    )
    assert r.solved and len(rec.calls) == 1
    call = rec.calls[0]
    # issue 32: a replan in the old plan's space, seeded with the survivors kept in
    # place, without baselines
    assert call["tp_candidates"] == sorted(
        {s.tensor_parallel for p in old.pipelines for s in p.stages}
    )
    assert call["mbs_candidates"] == [old.training.micro_batch_size]
    assert call["zero1"] is old.training.zero1 and call["with_baselines"] is False
    # anytime, seeded: seconds at most whatever the limit (a replan is recovery time)
    assert call["time_limit_s"] == FIRST_SPACE_S
    pipelines, mbs = call["incumbent"]
    assert mbs == old.training.micro_batch_size
    assert {s.host for p in pipelines for s in p.stages} <= {"a100-0", "v100-0"}
    assert {h.name for h in call["cluster"].hosts} == {"a100-0", "v100-0"}
    assert call["global_batch_size"] == 32
    assert call["model"].name == "OPT-350M"
    assert call["tables"] is tables()
    assert call["name"] == "lab"
    assert {c.kind for c in r.candidates} == {"solved", "kept"}
    new = r.plan
    assert "rtx3090-0" not in new.hosts()
    survivors = inputs().cluster.without({"rtx3090-0"})
    check_against_cluster(new, {h.name: (h.gpu_type, h.num_gpus) for h in survivors.hosts}, "t")
    assert new.parent == str(tmp_path / "lab.v1.yaml")
    # Written by the caller as the next version of the same name.
    write_plan(old, tmp_path)
    written, path = write_plan(new, tmp_path)
    assert path.name == "lab.v2.yaml" and written.version == 2
    loaded = load_plan(path)
    assert loaded.parent == str(tmp_path / "lab.v1.yaml")
    assert loaded.notes[0] == "recovered from the loss of rtx3090-0"


def test_nothing_fits_is_an_error() -> None:
    # One pipeline across both hosts: losing one leaves no whole pipeline to keep.
    old = make_old([pipe(32, ("v100-0", 0, 0, 6), ("a100-0", 0, 6, 26))])
    rec = Recording(raises=InfeasibleError("too small"))
    with pytest.raises(RecoveryError, match="no plan fits the survivors of v100-0: too small"):
        replan(old, inputs().cluster, ["v100-0"], old_path=OLD_PATH, tables=tables(), planner=rec)


def test_lost_hosts_are_checked() -> None:
    old = make_old(OLD_PIPES)
    c = inputs().cluster
    with pytest.raises(RecoveryError, match="nothing to recover"):
        replan(old, c, [], old_path=OLD_PATH, tables=tables(), planner=no_planner)
    with pytest.raises(RecoveryError, match="uses none of ghost"):
        replan(old, c, ["ghost"], old_path=OLD_PATH, tables=tables(), planner=no_planner)
    with pytest.raises(RecoveryError, match="every host"):
        replan(
            old,
            c,
            ["a100-0", "v100-0", "rtx3090-0"],
            old_path=OLD_PATH,
            tables=tables(),
            planner=no_planner,
        )
    shrunk = c.without({"a100-0"})  # the cluster file lost a host nobody reported
    with pytest.raises(RecoveryError, match="runs on a100-0, which the cluster file no longer"):
        replan(old, shrunk, ["v100-0"], old_path=OLD_PATH, tables=tables(), planner=no_planner)


# --------------------------------------------------------------------- stability


def test_stability_prefers_keeping_layers_within_the_tolerance() -> None:
    old = old_with_contingency()
    c = inputs().cluster
    fast = replan(
        old, c, ["v100-0"], old_path=OLD_PATH, tables=tables(), planner=no_planner, tolerance=0.0
    )
    cont, kept = fast.candidate("contingency"), fast.candidate("kept")
    assert cont is not None and kept is not None
    slower = kept.iteration_time_s / cont.iteration_time_s - 1.0
    assert 0.0 < slower < 0.2
    assert kept.stability.fraction == 1.0 > cont.stability.fraction
    assert fast.chosen == "contingency"
    stable = replan(
        old,
        c,
        ["v100-0"],
        old_path=OLD_PATH,
        tables=tables(),
        planner=no_planner,
        tolerance=slower + 0.01,
    )
    assert stable.chosen == "kept"
    assert layout(stable.plan.pipelines) == layout(OLD_PIPES[1:])
    note = stable.plan.notes[1]
    pct = f"{slower:+.1%}"
    assert note.startswith(
        f"kept plan: kept 100% of layer state in place at {pct} iteration time"
    ), note
    assert "for the contingency plan, which kept" in note
    # Just below the cost of keeping: the faster plan again.
    assert (
        replan(
            old,
            c,
            ["v100-0"],
            old_path=OLD_PATH,
            tables=tables(),
            planner=no_planner,
            tolerance=slower - 0.005,
        ).chosen
        == "contingency"
    )


def test_kept_plan_keeps_surviving_pipelines_and_reshares_the_batch() -> None:
    old = make_old(OLD_PIPES)
    survivors = inputs().cluster.without({"v100-0"})
    kept = keep_survivors(old, survivors, {"v100-0"}, tables())
    assert kept is not None
    assert layout(kept.pipelines) == layout(OLD_PIPES[1:])
    assert sum(p.num_microbatches for p in kept.pipelines) == 32
    # The faster A100 replicas take more of the batch than the RTX pipelines.
    ms = [p.num_microbatches for p in kept.pipelines]
    assert ms[0] == ms[1] > ms[2] == ms[3]
    assert stability(old, kept).fraction == 1.0
    ev = evaluate(kept.pipelines, survivors, tables(), 1)
    assert ev.fits
    assert kept.prediction is not None
    assert kept.prediction.iteration_time_s == pytest.approx(ev.iteration_ms / 1e3)
    # Water-filling is optimal: no single micro-batch move makes it faster.
    for i in range(len(ms)):
        for j in range(len(ms)):
            if i != j and ms[i] > 1:
                moved = list(kept.pipelines)
                moved[i] = replace(moved[i], num_microbatches=ms[i] - 1)
                moved[j] = replace(moved[j], num_microbatches=ms[j] + 1)
                other = evaluate(moved, survivors, tables(), 1)
                assert other.pipeline_ms >= ev.pipeline_ms - 1e-6


def test_kept_plan_takes_the_largest_degree_left() -> None:
    """The V100 pipeline ran at TP 2; losing its host leaves TP-1 stages only, and
    the kept plan's plan-level degree follows (it must equal the largest stage's)."""
    v100_tp2 = Pipeline(
        num_microbatches=4,
        stages=(
            Stage(
                layer_start=0,
                layer_end=26,
                gpu_type="V100-16",
                tensor_parallel=2,
                devices=(Device(host="v100-0", gpu=0), Device(host="v100-0", gpu=1)),
            ),
        ),
    )
    old = replace(make_old(OLD_PIPES), tensor_parallel=2, pipelines=(v100_tp2, *OLD_PIPES[1:]))
    old.validate()
    survivors = inputs().cluster.without({"v100-0"})
    kept = keep_survivors(old, survivors, {"v100-0"}, tables())
    assert kept is not None
    assert kept.tensor_parallel == 1
    kept.validate()


def spare_cluster() -> Cluster:
    host = {"gpus": {"type": "V100-16", "count": 2}, "spot": True}
    return cluster_from_dict(
        {
            "schema": "autohet.cluster/v1",
            "name": "spares",
            "network": {"inter_node_gbps": 100},
            "hosts": [
                {"name": "a100-0", "address": "127.0.0.2", "gpus": {"type": "A100-40", "count": 2}},
                {"name": "v100-0", "address": "127.0.0.3", **host},
                {"name": "v100-1", "address": "127.0.0.4", **host},
            ],
        },
        "spares.yaml",
    )


def test_lost_stages_move_to_spare_gpus_of_the_same_type() -> None:
    v100 = pipe(8, ("v100-0", 0, 0, 13), ("v100-0", 1, 13, 26))
    old = make_old(
        [v100, pipe(12, ("a100-0", 0, 0, 26)), pipe(12, ("a100-0", 1, 0, 26))],
        idle=({"host": "v100-1", "gpus": [0, 1], "reason": "spare"},),
    )
    c = spare_cluster()
    survivors = c.without({"v100-0"})
    kept = keep_survivors(old, survivors, {"v100-0"}, tables())
    assert kept is not None
    assert len(kept.pipelines) == 3
    moved = kept.pipelines[0]
    assert [s.devices for s in moved.stages] == [
        (Device(host="v100-1", gpu=0),),
        (Device(host="v100-1", gpu=1),),
    ]
    assert [(s.layer_start, s.layer_end) for s in moved.stages] == [(0, 13), (13, 26)]
    # Same GPUs and links as before, the batch re-shared optimally: no slower than before.
    before = evaluate(old.pipelines, c, tables(), 1)
    assert kept.prediction is not None
    assert kept.prediction.iteration_time_s <= before.iteration_ms / 1e3 + 1e-9
    st = stability(old, kept, layer_state_bytes(tables()))
    assert 0.0 < st.fraction < 1.0
    assert st.kept_placements == 2 * 26
    assert st.state_bytes_to_move == pytest.approx(sum(layer_state_bytes(tables())))
    assert kept.idle == ()
    # Through replan (no added hosts: v100-1 was listed idle), the kept plan is as
    # fast as anything, so it wins on stability against the solver's plan.
    r = replan(old, c, ["v100-0"], old_path=OLD_PATH, tables=tables(), planner=Recording())
    assert r.added == ()
    assert r.chosen in ("kept", "solved")
    best = r.candidate(r.chosen)
    assert best is not None
    assert best.stability.fraction >= max(
        c.stability.fraction
        for c in r.candidates
        if c.iteration_time_s <= best.iteration_time_s * 1.05
    )


def test_stability_counts_and_weights() -> None:
    old = make_old(OLD_PIPES)
    assert stability(old, old).fraction == 1.0
    weights = layer_state_bytes(tables())
    assert stability(old, old, weights).fraction == 1.0
    # Swap the RTX stages of the first RTX pipeline: 26 of its placements change.
    swapped = make_old(
        OLD_PIPES[:3] + [pipe(5, ("rtx3090-0", 1, 0, 13), ("rtx3090-0", 0, 13, 26)), OLD_PIPES[4]]
    )
    st = stability(old, swapped)
    assert (st.kept_placements, st.total_placements) == (4 * 26, 5 * 26)
    weighted = stability(old, swapped, weights)
    assert weighted.total_state_bytes == pytest.approx(5 * sum(weights))
    assert weighted.fraction == pytest.approx(4 / 5)
    # Relabelling GPUs within the host restores every placement, at the same time.
    aligned = align_devices(old, swapped, weights)
    assert stability(old, aligned).fraction == 1.0
    c = inputs().cluster
    assert evaluate(aligned.pipelines, c, tables(), 1).iteration_ms == pytest.approx(
        evaluate(swapped.pipelines, c, tables(), 1).iteration_ms
    )


def test_alignment_keeps_devices_valid_and_distinct() -> None:
    old = make_old(OLD_PIPES)
    # A new plan using the RTX host's GPUs in a scrambled order with new layer splits.
    new = make_old(
        OLD_PIPES[:3]
        + [
            pipe(5, ("rtx3090-0", 3, 0, 10), ("rtx3090-0", 2, 10, 26)),
            pipe(5, ("rtx3090-0", 1, 0, 16), ("rtx3090-0", 0, 16, 26)),
        ]
    )
    aligned = align_devices(old, new)
    aligned.validate()
    gpus = sorted(d.gpu for d in aligned.devices() if d.host == "rtx3090-0")
    assert gpus == [0, 1, 2, 3]
    assert stability(old, aligned).fraction > stability(old, new).fraction


def cand(kind: str, time_s: float, kept: int) -> Candidate:
    return Candidate(
        kind=kind,
        plan=make_old(OLD_PIPES),
        iteration_time_s=time_s,
        stability=Stability(
            kept_placements=kept, total_placements=100, kept_state_bytes=0.0, total_state_bytes=0.0
        ),
    )


def test_choose_and_tradeoff_text() -> None:
    solved, kept = cand("solved", 2.0, 40), cand("kept", 2.09, 100)
    assert choose([solved, kept], 0.05) is kept
    assert choose([solved, kept], 0.04) is solved
    assert tradeoff(kept, [solved, kept], 0.05) == (
        "kept plan: kept 100% of layer placements in place at +4.5% iteration time "
        "(2.090 s vs 2.000 s for the solved plan, which kept 40%; tolerance 5%)"
    )
    assert tradeoff(solved, [solved, kept], 0.04) == (
        "solved plan: kept 40% of layer placements in place at 2.000 s/iteration; the kept "
        "plan would keep 100% in place but is +4.5% slower (2.090 s; tolerance 4%)"
    )
    # Equal stability: the faster one; a faster and more stable plan always wins.
    twin = cand("kept", 2.01, 40)
    assert choose([twin, solved], 0.05) is solved
    better = cand("kept", 1.9, 90)
    assert choose([solved, better], 0.0) is better
    assert "is +0.5% slower and keeps no more in place" in tradeoff(solved, [solved, twin], 0.05)
    same = cand("kept", 2.0, 40)
    assert tradeoff(solved, [solved, same], 0.05).endswith(
        "the kept plan is as fast and keeps no more in place"
    )
    assert tradeoff(solved, [solved], 0.05) == (
        "solved plan: kept 40% of layer placements in place (2.000 s/iteration)"
    )


def test_negative_tolerance_is_rejected() -> None:
    with pytest.raises(RecoveryError, match="tolerance"):
        replan(
            old_with_contingency(),
            inputs().cluster,
            ["v100-0"],
            old_path=OLD_PATH,
            tables=tables(),
            planner=no_planner,
            tolerance=-0.1,
        )


_: Callable[..., PlanOutcome] = make_plan  # the planner protocol accepts make_plan itself


@pytest.mark.parametrize(("recompute", "asked"), [(False, None), (True, None)])
def test_the_planner_decides_recomputation_on_the_survivors(
    recompute: bool, asked: bool | None
) -> None:
    """Whatever the old plan recomputed (its flags were for other GPUs, maybe for one
    type only), the planner decides (None) per stage and type where memory binds on
    the survivors."""
    old = make_old(OLD_PIPES, None)
    old = replace(
        old,
        pipelines=tuple(
            replace(p, stages=tuple(replace(s, recompute=recompute) for s in p.stages))
            for p in old.pipelines
        ),
    )
    rec = Recording(raises=InfeasibleError("stub"))
    replan(old, inputs().cluster, ["v100-0"], old_path=OLD_PATH, tables=tables(), planner=rec)
    # in the old plan's space first (recomputation as the old plan had it: decided
    # where it had any, off where it had none), then decided anew
    assert rec.calls[0]["recompute"] is (None if recompute else False)
    assert rec.calls[-1]["recompute"] is asked


def test_the_short_first_search_needs_a_seed_and_falls_back_to_the_whole_limit() -> None:
    """Review of issue 32 item 5: the 1.5 s cap is safe only when the survivors could
    be kept (the seed); without one, or when the short search found nothing in time,
    the old plan's space gets the whole --time-limit."""
    from autohet_cli.errors import TimeLimitReached
    from autohet_cli.recovery.survivor_search import solve_on_survivors as _solve

    old = make_old(OLD_PIPES)
    calls: list[dict[str, Any]] = []

    def stub(fail_first: bool) -> Any:
        def planner(**kw: Any) -> Any:
            calls.append(kw)
            if fail_first and len(calls) == 1:
                raise TimeLimitReached("stub: nothing in time")
            return "outcome"

        return planner

    assert _solve(old, inputs().cluster, tables(), stub(False), 30.0, False, None) == "outcome"
    assert [c["time_limit_s"] for c in calls] == [30.0]  # unseeded: the whole limit
    calls.clear()
    assert _solve(old, inputs().cluster, tables(), stub(True), 30.0, False, old) == "outcome"
    assert [c["time_limit_s"] for c in calls] == [FIRST_SPACE_S, 30.0]
    assert calls[1]["mbs_candidates"] == [old.training.micro_batch_size]  # the same space
    assert calls[0]["incumbent"] is not None
