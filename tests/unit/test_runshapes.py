"""The runtime runs ``profile run`` chooses, and spreading a run's refit (pure)."""

from __future__ import annotations

from dataclasses import replace

from autohet_cli.cluster import Cluster, Host
from autohet_cli.models import get_model
from autohet_cli.plan import plan_to_dict
from autohet_cli.profiling.calibrate import spread
from autohet_cli.profiling.runcheck import choose_mbs
from autohet_cli.profiling.runshapes import fits, predicted, shape_plan, shapes_for
from autohet_cli.profiling.schema import EntryKey, LayerTiming, Profile, ProfileEntry

TINY = get_model("gpt-tiny")
HOST = Host(
    name="h", address="localhost", gpu_type="cpu", num_gpus=4, gpu_mem_bytes=8 << 30,
    intra_node_gbps=100.0,
)  # fmt: skip
CLUSTER = Cluster(name="c", hosts=(HOST,), inter_node_gbps=10.0)


def _entry(tp: int, mbs: int, ms: float, source: str = "measured") -> ProfileEntry:
    key = EntryKey(
        model=TINY.name, gpu_type="cpu", tensor_parallel=tp, micro_batch_size=mbs, seq_len=64
    )
    layer = LayerTiming(
        fwd_ms=ms, bwd_ms=2 * ms, update_ms=0.5, num_params=1000, act_bytes=1e6, output_bytes=1e4
    )
    return ProfileEntry(key=key, source=source, dtype="fp32", layers=(layer,) * TINY.num_layers)


def _profile(*entries: ProfileEntry) -> Profile:
    return Profile(entries={e.key: e for e in entries})


def test_shapes_isolate_each_term_in_calibration_order() -> None:
    names = [s.name for s in shapes_for(6, 4, [1, 2, 4, 8])]
    assert names == ["data-parallel-2", "tp-2", "tp-4", "two-stages"]
    # a one-GPU host: no data parallelism, no stages, no TP
    assert [s.name for s in shapes_for(6, 1, [1, 2])] == ["one-device"]
    # a one-layer model cannot be cut in two
    assert [s.name for s in shapes_for(1, 2, [1])] == ["data-parallel-2"]


def test_shape_plans_are_valid_and_use_the_hosts_first_devices() -> None:
    for shape in shapes_for(TINY.num_layers, 4, [1, 2, 4]):
        plan = shape_plan(shape, TINY, HOST, mbs=2, seq_len=64, precision="fp32")
        devices = [d.gpu for d in plan.devices()]
        assert sorted(devices) == list(range(shape.devices)), shape.name
        assert plan.training.global_batch_size == 2 * 8
        plan_to_dict(plan)  # serialisable as a plan file


def test_fits_refuses_over_memory_and_over_budget() -> None:
    prof = _profile(_entry(1, 1, 10.0), _entry(1, 4, 40.0))
    shape = shapes_for(TINY.num_layers, 2, [1])[0]
    plan = predicted(
        shape_plan(shape, TINY, HOST, mbs=4, seq_len=64, precision="fp32"), CLUSTER, prof, TINY
    )
    assert fits(plan, steps=8, budget_s=1e6) is None
    over = fits(plan, steps=8, budget_s=1e-3)
    assert over is not None and "budget" in over
    stage = plan.pipelines[0].stages[0]
    assert stage.predicted is not None
    full = replace(stage, predicted=replace(stage.predicted, mem_fraction=1.2))
    pipeline = replace(plan.pipelines[0], stages=(full,))
    why = fits(replace(plan, pipelines=(pipeline, *plan.pipelines[1:])), steps=8, budget_s=1e6)
    assert why is not None and "120% of a device's memory" in why


def test_the_largest_micro_batch_within_the_budget_is_chosen() -> None:
    shape = shapes_for(TINY.num_layers, 2, [1])[0]
    ok = object()  # stands for a predicted plan: only a string refuses
    refuse = {4: "too slow"}
    mbs, why = choose_mbs(shape, lambda _s, m: refuse.get(m, ok), [1, 2, 4])  # type: ignore[arg-type]
    assert (mbs, why) == (2, "")
    mbs, why = choose_mbs(shape, lambda _s, m: f"slow {m}", [1, 2])
    assert mbs is None and "micro-batch 2: slow 2" in why and "micro-batch 1: slow 1" in why


def test_a_run_refit_spreads_to_the_probed_sizes_of_that_tp_only() -> None:
    probe = _profile(_entry(1, 1, 10.0), _entry(1, 2, 20.0), _entry(2, 2, 12.0))
    refit_entry = replace(
        _entry(1, 2, 30.0), source="calibrated"
    )  # the run found TP 1 at mbs 2 1.5x slower
    refit = probe.with_entries([refit_entry])
    out = spread(refit, probe)
    e1 = out.entries[_entry(1, 1, 0).key]
    assert e1.source == "calibrated"
    assert abs(e1.layers[0].fwd_ms - 15.0) < 1e-9 and abs(e1.layers[0].bwd_ms - 30.0) < 1e-9
    assert out.entries[_entry(2, 2, 0).key].source == "measured"  # another TP: untouched
    assert out.entries[refit_entry.key] is refit_entry
