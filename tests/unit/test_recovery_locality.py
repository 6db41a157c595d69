"""Recover puts the new plan's stages on the survivors that hold their files
(recovery.locality): alike hosts are permuted, the predicted time is kept."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from test_recovery_transfer import MB, cluster, plan
from test_recovery_transfer_layers import manifest

from autohet_cli.plan import Plan
from autohet_cli.recovery.locality import bytes_to_move, place_near_copies, rename_hosts

# The writer: one pipeline of 3 stages on a, b, c; rank 0 (a) holds the shared entries.
WRITER = (
    ("a", 40 * MB, (0, 1, 2), True),
    ("b", 40 * MB, (3, 4, 5), False),
    ("c", 20 * MB, (6, 7), False),
)
M = manifest(WRITER)
# c is lost. Each host's partner copy (--replicas 1, ring a->b->c->a): b keeps a's
# file, a keeps c's; c kept b's, lost with it.
HOLDERS: Mapping[str, Sequence[str]] = {
    "__0_0.distcp": ("a", "b"),
    "__1_0.distcp": ("b",),
    "__2_0.distcp": ("a",),
    ".metadata": ("a", "b"),
}
SURVIVORS = cluster(["a", "b"])
# What a planner that sees GPUs, not files, may well return: a first, b second.
SOLVED = plan("lab", 2, [[("a", 0, 4), ("b", 4, 8)]])


def flat(_: Plan) -> float:
    return 1.0


def test_the_lost_hosts_layers_go_to_the_partner_that_holds_its_file() -> None:
    # as solved: a needs b's file (layer 3), b needs a's (0-2: held) and c's (6, 7)
    assert bytes_to_move(M, SOLVED, HOLDERS) == {"a": 40 * MB, "b": 20 * MB}
    placed = place_near_copies(SOLVED, SURVIVORS, M, HOLDERS, flat)
    assert placed.renamed == {"a": "b", "b": "a"}
    stages = [(s.host, s.layer_start, s.layer_end) for s in placed.plan.pipelines[0].stages]
    assert stages == [("b", 0, 4), ("a", 4, 8)]
    # b holds a's and its own file: nothing; a holds c's, needs b's for layers 4, 5
    assert bytes_to_move(M, placed.plan, HOLDERS) == {"b": 0, "a": 40 * MB}
    assert (placed.bytes_before, placed.bytes_after) == (60 * MB, 40 * MB)


def test_a_permutation_that_changes_the_predicted_time_is_not_taken() -> None:
    def slower_if_swapped(p: Plan) -> float:
        return 1.0 if p.pipelines[0].stages[0].host == "a" else 1.01

    placed = place_near_copies(SOLVED, SURVIVORS, M, HOLDERS, slower_if_swapped)
    assert placed.plan is SOLVED and placed.renamed == {}


def test_hosts_the_cost_model_tells_apart_are_not_swapped() -> None:
    mixed = cluster(["a", "b"])
    hosts = tuple(replace(h, num_gpus=8) if h.name == "b" else h for h in mixed.hosts)
    placed = place_near_copies(SOLVED, replace(mixed, hosts=hosts), M, HOLDERS, flat)
    assert placed.renamed == {} and placed.plan is SOLVED


def test_an_idle_survivor_holding_the_files_takes_the_role() -> None:
    # three survivors, the plan uses two; d (alike, idle) holds everything
    holders = {p: (*hs, "d") for p, hs in HOLDERS.items()} | {"__1_0.distcp": ("b", "d")}
    placed = place_near_copies(SOLVED, cluster(["a", "b", "d"]), M, holders, flat)
    assert placed.bytes_after < placed.bytes_before
    assert "d" in placed.plan.hosts()
    assert sum(bytes_to_move(M, placed.plan, holders).values()) == placed.bytes_after


def test_renaming_reaches_the_contingency_entries() -> None:
    with_cont = rename_hosts(plan("lab", 2, [[("a", 0, 4), ("b", 4, 8)]]), {"a": "b", "b": "a"})
    assert [s.host for s in with_cont.pipelines[0].stages] == ["b", "a"]
    cont = replace(SOLVED, contingency={"a": {"pipelines": [{"stages": [{"host": "b"}]}]}})
    out = rename_hosts(cont, {"a": "b", "b": "a"})
    assert out.contingency == {"b": {"pipelines": [{"stages": [{"host": "a"}]}]}}


def test_replan_runs_the_solved_plan_on_the_hosts_holding_its_files() -> None:
    """Through ``replan``: the planner's plan (a first, b second) comes back swapped,
    with the same predicted time and a note saying what it saves."""
    from typing import Any, cast

    from autohet_cli.costmodel.evaluate import evaluate
    from autohet_cli.costmodel.tables import CostTables
    from autohet_cli.models import get_model
    from autohet_cli.planner.api import PlanOutcome, training_for, with_predictions
    from autohet_cli.recovery.replan import CopyHolders, replan

    model = get_model("gpt-tiny")  # 6 layers, as the manifest below records them
    training = training_for(2, 64, "fp32", "adam")
    tables = CostTables(model, None, training)
    m = manifest(
        (("a", 40 * MB, (0, 1), True), ("b", 40 * MB, (2, 3), False), ("c", 20 * MB, (4, 5), False))
    )
    three = cluster(["a", "b", "c"])  # one GPU each: no spare to keep c's stage on
    everyone = replace(three, hosts=tuple(replace(h, num_gpus=1) for h in three.hosts))
    old = replace(
        plan("lab", 1, [[("a", 0, 2), ("b", 2, 4), ("c", 4, 6)]]), num_layers=6, training=training
    )
    solved = replace(plan("lab", 2, [[("a", 0, 3), ("b", 3, 6)]]), num_layers=6, training=training)

    def planner(**kw: Any) -> PlanOutcome:
        ev = evaluate(solved.pipelines, kw["cluster"], kw["tables"], 1)
        return PlanOutcome(
            plan=with_predictions(solved, ev), eval=ev, result=cast(Any, None), baselines={}
        )

    copies = CopyHolders(manifest=m, holders=HOLDERS)
    r = replan(
        old,
        everyone,
        ["c"],
        old_path="plans/lab.v1.yaml",
        tables=tables,
        planner=planner,
        copies=copies,
    )
    plain = replan(
        old, everyone, ["c"], old_path="plans/lab.v1.yaml", tables=tables, planner=planner
    )
    assert [s.host for s in plain.plan.pipelines[0].stages] == ["a", "b"]
    assert [s.host for s in r.plan.pipelines[0].stages] == ["b", "a"]
    assert r.plan.prediction == plain.plan.prediction  # alike hosts: the same prediction
    moved = sum(bytes_to_move(m, r.plan, HOLDERS).values())
    assert moved < sum(bytes_to_move(m, plain.plan, HOLDERS).values())
    [note] = [n for n in r.plan.notes if "hold their checkpoint files" in n]
    assert "(a -> b, b -> a)" in note and "40.00 MB to move instead of 60.00 MB" in note, note


def test_an_idle_host_taking_a_role_leaves_its_name_to_the_host_it_freed() -> None:
    """The renaming is a whole permutation: a plan's contingency entries that name the
    idle host now name the host that became idle."""
    holders = dict.fromkeys(HOLDERS, ("d",))  # d (idle, alike) holds every file
    cont = replace(
        SOLVED,
        contingency={"a": {"pipelines": [{"host": "d"}]}, "b": {"pipelines": [{"host": "a"}]}},
    )
    placed = place_near_copies(cont, cluster(["a", "b", "d"]), M, holders, flat)
    assert len(set(placed.renamed.values())) == len(placed.renamed)  # a bijection
    assert set(placed.renamed) == set(placed.renamed.values())  # on the same hosts
    assert "d" in placed.plan.hosts() and "d" in placed.renamed
    name = placed.renamed.get  # every name, in keys and inside the entries alike
    assert placed.plan.contingency == {
        name("a", "a"): {"pipelines": [{"host": name("d", "d")}]},
        name("b", "b"): {"pipelines": [{"host": name("a", "a")}]},
    }
    assert name("d", "d") != "d"  # the entry that used the idle host uses its successor
