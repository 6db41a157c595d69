"""Recomputation times as measured: the profile fields, the cost model, calibration.

On a fast GPU, checkpoint's per-call work runs on the CPU and starves it
(GPT-1.3B, H100, micro-batch 2: the recomputing forward took 1.9x the plain one),
so a recompute stage is costed from the probe's own timing of checkpointed
layers, and a run of a recompute plan refits those times, never the plain ones.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from autohet_cli.cluster import load_cluster
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.defaults import resolve_cluster_path
from autohet_cli.errors import ConfigError
from autohet_cli.launch.compare import compare
from autohet_cli.plan import Plan
from autohet_cli.profiling.calibrate import calibrate, spread
from autohet_cli.profiling.runshapes import predicted
from autohet_cli.profiling.schema import (
    LayerTiming,
    Profile,
    profile_from_dict,
    profile_to_dict,
)
from tests.unit.test_costmodel import entry, toy_layers, toy_tables
from tests.unit.test_prediction_check import MODEL, TRAINING, _plan, _report


def _measured(fwd: float = 1.8, bwd: float = 5.5) -> tuple[LayerTiming, ...]:
    return tuple(replace(lt, recompute_fwd_ms=fwd, recompute_bwd_ms=bwd) for lt in toy_layers())


def test_a_recompute_stage_costs_what_the_profile_measured_under_recomputation() -> None:
    table = toy_tables(entry("A100-40", _measured())).table("A100-40", 1, 1, 8.0)
    plain, again = table.stage(1, 4), table.stage(1, 4, recompute=True)
    assert (plain.fwd_ms, plain.bwd_ms) == (3.0, 6.0)  # the plain times are untouched
    assert (again.fwd_ms, again.bwd_ms) == pytest.approx((3 * 1.8, 3 * 5.5))
    assert table.compute_ms(1, 4, recompute=True) == pytest.approx(3 * (1.8 + 5.5))
    # without the measurement: the forward, then backward + forward (what the GPU computes)
    derived = toy_tables().table("A100-40", 1, 1, 8.0).stage(1, 4, recompute=True)
    assert (derived.fwd_ms, derived.bwd_ms) == (3.0, 9.0)


def test_recomputation_times_round_trip_and_are_written_only_when_measured() -> None:
    profile = Profile(entries={e.key: e for e in [entry("A100-40", _measured())]})
    doc = profile_to_dict(profile)
    layer = doc["entries"][0]["layers"][0]
    assert (layer["recompute_fwd_ms"], layer["recompute_bwd_ms"]) == (1.8, 5.5)
    assert profile_from_dict(doc, "p.yaml") == profile
    plain = profile_to_dict(Profile(entries={e.key: e for e in [entry("A100-40", toy_layers())]}))
    assert "recompute_fwd_ms" not in plain["entries"][0]["layers"][0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"recompute_bwd_ms": None}, r"layers\[0\]: recompute_fwd_ms without recompute_bwd_ms"),
        ({"recompute_fwd_ms": -1.0}, r"layers\[0\]\.recompute_fwd_ms: must not be negative"),
        ({"recompute_bwd_ms": "fast"}, r"layers\[0\]\.recompute_bwd_ms"),
    ],
)
def test_bad_recomputation_times_name_the_field(change: dict[str, Any], message: str) -> None:
    doc = profile_to_dict(Profile(entries={e.key: e for e in [entry("A100-40", _measured())]}))
    layer = doc["entries"][0]["layers"][0]
    for key, value in change.items():
        if value is None:
            del layer[key]
        else:
            layer[key] = value
    with pytest.raises(ConfigError, match=message):
        profile_from_dict(doc, "p.yaml")


def _recomputing(plan: Plan, profile: Profile, flag: bool = True) -> Plan:
    """``plan`` with every stage recomputing (or none), predicted from ``profile``."""
    flagged = replace(
        plan,
        pipelines=tuple(
            replace(p, stages=tuple(replace(s, recompute=flag) for s in p.stages))
            for p in plan.pipelines
        ),
    )
    cluster = load_cluster(resolve_cluster_path(None))
    return predicted(flagged, cluster, profile, MODEL)


def test_a_recompute_run_refits_the_recomputation_times_not_the_plain_ones() -> None:
    plain = _plan()
    rc_plan = _recomputing(plain, Profile())
    check = compare(rc_plan, _report(rc_plan, 2.0, mem_bytes=1 << 20, step_extra_ms=0.0), None)
    assert all(st["recompute"] for st in check["stages"])
    refit, rows = calibrate(Profile(), check, MODEL, run_id="rc", global_batch_size=8)
    assert rows and all(r["recompute"] and r["fwd_x"] == pytest.approx(2.0) for r in rows)
    before, after = CostTables(MODEL, None, TRAINING), CostTables(MODEL, refit, TRAINING)
    for p in rc_plan.pipelines:
        for s in p.stages:
            a, b, tp = s.layer_start, s.layer_end, s.tensor_parallel
            old, new = before.table("cpu", tp, 2, 80.0), after.table("cpu", tp, 2, 80.0)
            # the plain times stay as they were: a plain plan is not made slower
            assert new.stage(a, b).fwd_ms == pytest.approx(old.stage(a, b).fwd_ms)
            assert new.stage(a, b).bwd_ms == pytest.approx(old.stage(a, b).bwd_ms)
            rc_old, rc_new = old.stage(a, b, recompute=True), new.stage(a, b, recompute=True)
            assert rc_new.fwd_ms == pytest.approx(2 * rc_old.fwd_ms)
            assert rc_new.bwd_ms == pytest.approx(2 * rc_old.bwd_ms)
    # the same plan, predicted again from the refit, matches what it measured
    again = _recomputing(plain, refit)
    for p_old, p_new in zip(rc_plan.pipelines, again.pipelines, strict=True):
        for s_old, s_new in zip(p_old.stages, p_new.stages, strict=True):
            assert s_old.predicted is not None and s_new.predicted is not None
            assert s_new.predicted.fwd_ms == pytest.approx(2 * s_old.predicted.fwd_ms)
            assert s_new.predicted.bwd_ms == pytest.approx(2 * s_old.predicted.bwd_ms)


def test_a_plain_run_leaves_recomputation_times_a_recompute_run_fitted() -> None:
    """Recomputation times a recompute run fitted stay as it measured them; a later
    plain run refits the plain times only (and merging keeps the mark)."""
    rc_plan = _recomputing(_plan(), Profile())
    rc_check = compare(rc_plan, _report(rc_plan, 1.5, mem_bytes=1 << 20, step_extra_ms=0.0), None)
    first, _ = calibrate(Profile(), rc_check, MODEL, run_id="rc", global_batch_size=8)
    assert first.meta["recompute_calibrated"]
    plan = _recomputing(_plan(), first, flag=False)
    check = compare(plan, _report(plan, 3.0, mem_bytes=1 << 20, step_extra_ms=0.0), None)
    refit, rows = calibrate(first, check, MODEL, run_id="plain", global_batch_size=8)
    assert rows and not any(r["recompute"] for r in rows)
    assert refit.meta["recompute_calibrated"] == first.meta["recompute_calibrated"]
    for key, e in refit.entries.items():
        was = first.entries[key]
        for lt, old in zip(e.layers, was.layers, strict=True):
            assert lt.fwd_ms == pytest.approx(3 * old.fwd_ms)
            assert lt.recompute_fwd_ms == pytest.approx(old.rc_fwd_ms)
            assert lt.recompute_bwd_ms == pytest.approx(old.rc_bwd_ms)
    assert (
        first.merged_with(refit).meta["recompute_calibrated"] == refit.meta["recompute_calibrated"]
    )
    # a fresh probe of the same entries voids the mark
    assert "recompute_calibrated" not in refit.merged_with(Profile(entries=refit.entries)).meta


def test_a_plain_run_scales_the_probes_recomputation_times() -> None:
    """Times the probe measured (no recompute run yet) follow the plain run's
    evidence of the card's speed; derived ones stay derived."""
    tp, mbs = _plan().tensor_parallel, _plan().training.micro_batch_size
    probed = CostTables(MODEL, None, TRAINING).entry("cpu", tp, mbs)
    measured = replace(
        probed,
        source="measured",
        dtype="fp32",
        layers=tuple(
            replace(lt, recompute_fwd_ms=2 * lt.fwd_ms, recompute_bwd_ms=4 * lt.bwd_ms)
            for lt in probed.layers
        ),
    )
    profile = Profile(entries={measured.key: measured})
    plan = _recomputing(_plan(), profile, flag=False)
    check = compare(plan, _report(plan, 3.0, mem_bytes=1 << 20, step_extra_ms=0.0), None)
    refit, _ = calibrate(profile, check, MODEL, run_id="plain", global_batch_size=8)
    e = refit.entries[measured.key]
    for lt, old in zip(e.layers, measured.layers, strict=True):
        assert lt.recompute_fwd_ms == pytest.approx(3 * old.rc_fwd_ms)
    derived, _ = calibrate(Profile(), check, MODEL, run_id="plain", global_batch_size=8)
    assert derived.entries
    assert all(lt.recompute_fwd_ms is None for e in derived.entries.values() for lt in e.layers)


def test_spread_carries_the_recomputation_ratio_to_probed_sizes() -> None:
    probed = {
        m: replace(entry("A100-40", _measured(), mbs=m), dtype="bf16", source="measured")
        for m in (1, 2)
    }
    original = Profile(entries={e.key: e for e in probed.values()})
    one = probed[1]
    refit_layers = tuple(
        replace(lt, recompute_fwd_ms=lt.rc_fwd_ms * 2, recompute_bwd_ms=lt.rc_bwd_ms * 3)
        for lt in one.layers
    )
    refit = original.with_entries([replace(one, layers=refit_layers, source="calibrated")])
    spreaded = spread(refit, original).entries[probed[2].key]
    assert spreaded.source == "calibrated"
    for lt, base in zip(spreaded.layers, probed[2].layers, strict=True):
        assert lt.fwd_ms == pytest.approx(base.fwd_ms)  # the plain ratio is 1
        assert lt.recompute_fwd_ms == pytest.approx(2 * base.rc_fwd_ms)
        assert lt.recompute_bwd_ms == pytest.approx(3 * base.rc_bwd_ms)
