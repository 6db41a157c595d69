"""The recovery report: the contract keys of ``autohet recover --json`` and phase timing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from autohet_cli.recovery.replan import Candidate, Replan, Stability
from autohet_cli.recovery.report import PHASES, PhaseClock, RecoveryReport, build_report
from autohet_cli.recovery.transfer import Source, TransferItem, TransferPlan
from tests.planting import plan_of, stage

CONTRACT = {"new_plan_path", "bytes_from_peers", "bytes_from_remote", "phases", "resumed_step"}


def test_report_json_has_the_contract_keys() -> None:
    report = RecoveryReport(
        new_plan_path="plans/lab.v2.yaml",
        old_plan_path="plans/lab.v1.yaml",
        resumed_step=40,
        bytes_from_peers=3_000_000,
        bytes_from_remote=1_000,
        phases={"detect": 1.5, "replan": 0.01, "transfer": 2.25, "relaunch": 4.0},
        lost_hosts=("v100-0",),
        chosen="contingency",
        kept_in_place_fraction=0.8333333,
    )
    data: dict[str, Any] = json.loads(report.to_json())
    assert CONTRACT <= data.keys()
    assert data["new_plan_path"] == "plans/lab.v2.yaml"
    assert data["resumed_step"] == 40
    assert data["bytes_from_peers"] == 3_000_000
    assert data["bytes_from_remote"] == 1_000
    assert list(data["phases"]) == ["detect", "replan", "transfer", "relaunch"]  # order kept
    assert data["phases"]["transfer"] == 2.25
    assert data["total_s"] == pytest.approx(7.76)
    assert data["lost_hosts"] == ["v100-0"]
    assert data["kept_in_place_fraction"] == 0.833333
    assert data["iteration_time_s"] is None
    assert isinstance(data["bytes_from_peers"], int)


def test_phase_clock_times_and_adds_up_repeated_phases() -> None:
    ticks = iter([0.0, 1.0, 1.0, 3.5, 10.0, 10.25])
    clock = PhaseClock(now=lambda: next(ticks))
    with clock.phase("detect"):
        pass
    with pytest.raises(RuntimeError), clock.phase("transfer"):
        raise RuntimeError("copy failed")  # a failed phase is still timed
    with clock.phase("detect"):
        pass
    assert clock.phases == {"detect": 1.25, "transfer": 2.5}
    assert PHASES[0] == "detect" and "transfer" in PHASES


def test_build_report_from_replan_and_transfer() -> None:
    plan = plan_of(
        [stage(0, 4, "a100-0", gpu_type="A100-40")],
        version=0,
        num_layers=4,
        notes=("recovered from the loss of v100-0",),
    )
    st = Stability(kept_placements=3, total_placements=4, kept_state_bytes=0, total_state_bytes=0)
    rp = Replan(
        plan=plan,
        chosen="kept",
        candidates=(Candidate(kind="kept", plan=plan, iteration_time_s=2.0, stability=st),),
        solved=False,
        lost=("v100-0",),
        added=(),
    )
    peer = Source(kind="peer", host="a100-0", path="/ck/a/x", gbps=100.0)
    remote = Source(kind="remote", host=None, path="/tmp/r/x", gbps=10.0)
    items = tuple(
        TransferItem(
            file=f,
            dest_host="b",
            dest_path=f"/ck/b/{f}",
            source=src,
            num_bytes=n,
            sha256="0" * 64,
            predicted_s=0.5,
        )
        for f, src, n in (
            ("__0_0.distcp", peer, 700),
            ("__1_0.distcp", remote, 300),
            (".metadata", peer, 5),
        )
    )
    tp = TransferPlan(
        plan_name="lab",
        step=40,
        rule="layers",
        rule_reason="the manifest records the layers of every data file",
        needs={},
        items=items,
        in_place=(),
        finalize_hosts=("b",),
        predicted_s_by_source={"a100-0": 1.0, "remote": 0.5},
        skipped=(("b", "__2_0.distcp"),),
        bytes_skipped=900,
    )
    report = build_report(
        replan=rp,
        transfer=tp,
        new_plan_path="plans/lab.v2.yaml",
        old_plan_path="plans/lab.v1.yaml",
        phases={"transfer": 1.2},
    )
    assert (report.bytes_from_peers, report.bytes_from_remote) == (705, 300)
    assert report.resumed_step == 40
    assert report.kept_in_place_fraction == 0.75
    assert report.predicted_transfer_s == 1.0
    assert report.chosen == "kept" and report.lost_hosts == ("v100-0",)
    assert report.notes == ("recovered from the loss of v100-0",)
    assert CONTRACT <= report.to_dict().keys()
    data = report.to_dict()
    assert (data["transfer_rule"], data["bytes_skipped"]) == ("layers", 900)
    assert data["transfer_rule_reason"] == "the manifest records the layers of every data file"
    # What really moved (a copy that fell back to remote storage) beats the plan.
    moved = build_report(
        replan=rp, transfer=tp, new_plan_path="p", old_plan_path="o", phases={}, moved=(5, 1000)
    )
    assert (moved.bytes_from_peers, moved.bytes_from_remote) == (5, 1000)
    assert (
        build_report(
            replan=rp, transfer=tp, new_plan_path="p", old_plan_path="o", phases={}, resumed_step=41
        ).resumed_step
        == 41
    )
