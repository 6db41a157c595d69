"""The runtime runs ``profile run`` chooses, and spreading a run's refit (pure)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from autohet_cli.cluster import Cluster
from autohet_cli.models import get_model
from autohet_cli.plan import plan_to_dict
from autohet_cli.profiling.calibrate import spread
from autohet_cli.profiling.runcheck import choose_mbs
from autohet_cli.profiling.runshapes import fits, predicted, shape_plan, shapes_for
from autohet_cli.profiling.schema import EntryKey, LayerTiming, Profile, ProfileEntry
from tests.planting import cpu_host

TINY = get_model("gpt-tiny")
HOST = cpu_host("h", num_gpus=4, gpu_mem_bytes=8 << 30, intra_node_gbps=100.0)
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
    found = shapes_for(6, 4, [1, 2, 4, 8])
    names = ["data-parallel-4", "tp-2", "tp-4", "two-stages", "sharded-weights-4"]
    assert [s.name for s in found] == names
    # every run fills the host, as plans do: replicas of the shape
    assert [s.devices for s in found] == [4, 4, 4, 4, 4]
    assert [len(s.layout) for s in found] == [4, 2, 1, 2, 4]
    assert all(m >= 2 for s in found for m, _ in s.layout)
    # the last shards run 1's replicas' weights over them, after the layer times are refit
    assert [s.shard for s in found] == ["none"] * 4 + ["weights"]
    assert found[-1].layout == found[0].layout
    assert [s.name for s in shapes_for(6, 2, [1, 2])] == [
        "data-parallel-2", "tp-2", "two-stages", "sharded-weights-2"
    ]  # fmt: skip
    assert [s.devices for s in shapes_for(6, 3, [2])] == [3, 2, 2, 3]  # what divides
    # a one-GPU host: no data parallelism, no stages, no TP, nothing to shard over
    assert [s.name for s in shapes_for(6, 1, [1, 2])] == ["one-device"]
    # a one-layer model cannot be cut in two
    assert [s.name for s in shapes_for(1, 2, [1])] == ["data-parallel-2", "sharded-weights-2"]


def test_shape_plans_are_valid_and_use_the_hosts_first_devices() -> None:
    for shape in shapes_for(TINY.num_layers, 4, [1, 2, 4]):
        plan = shape_plan(shape, TINY, HOST, mbs=2, seq_len=64, precision="fp32")
        plan.validate()  # the sharded shape's holders share their cut, as validate asks
        assert {s.shard for p in plan.pipelines for s in p.stages} == {shape.shard}
        devices = [d.gpu for d in plan.devices()]
        assert sorted(devices) == list(range(shape.devices)), shape.name
        assert plan.training.global_batch_size == 2 * sum(m for m, _ in shape.layout)
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


def test_the_micro_batch_size_running_the_most_shapes_is_chosen() -> None:
    dp, tp2 = shapes_for(TINY.num_layers, 2, [1, 2])[:2]
    ok = object()  # stands for a predicted plan: only a string refuses
    refuse = {(dp.name, 4): "too slow"}
    mbs, why = choose_mbs(
        [dp],
        lambda s, m: refuse.get((s.name, m), ok),
        [1, 2, 4],  # type: ignore[arg-type]
    )
    assert (mbs, why) == (2, "")
    # TP 1 out of memory at every size: the TP 2 run still goes ahead
    mbs, why = choose_mbs(
        [dp, tp2],
        lambda s, m: "oom" if s is dp else ok,
        [1, 2],  # type: ignore[arg-type]
    )
    assert (mbs, why) == (2, "")
    mbs, why = choose_mbs([dp], lambda _s, m: f"slow {m}", [1, 2])
    assert mbs is None and "micro-batch 2: slow 2" in why and "micro-batch 1: slow 1" in why
    assert choose_mbs([dp], lambda _s, m: "x", []) == (None, "no micro-batch size was measured")


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


def test_the_allreduce_fit_recovers_latency_and_rate() -> None:
    from autohet_cli.profiling.measure import allreduce_fit

    hop_ms, gbytes_s = 0.05, 4.0  # the truth: 2 processes, ring of 2 steps moving n bytes
    sizes = [4096, 1 << 16, 1 << 20, 1 << 24]
    times = {str(n): 2 * hop_ms + n / (gbytes_s * 1e9) * 1e3 for n in sizes}
    comm = {"2": {"method": "gloo_allreduce", "allreduce_ms": times}}
    fit = allreduce_fit(comm)
    assert fit is not None
    assert abs(fit[0] - hop_ms) < 1e-6 and abs(fit[1] - gbytes_s) < 1e-6
    # an estimate from copy bandwidth is not a measurement; one size fits nothing
    assert allreduce_fit({"2": {"method": "copy_bandwidth", "allreduce_ms": times}}) is None
    one = {"2": {"method": "nccl_allreduce", "allreduce_ms": {"4096": 0.1}}}
    assert allreduce_fit(one) is None
    # times that do not grow with size have no rate
    flat = {"2": {"method": "gloo_allreduce", "allreduce_ms": {"1": 1.0, "1000000": 1.0}}}
    assert allreduce_fit(flat) is None


def test_gradient_sync_on_one_host_uses_the_measured_allreduce(tmp_path: Path) -> None:
    from autohet_cli.costmodel.evaluate import evaluate
    from autohet_cli.costmodel.tables import CostTables
    from autohet_cli.profiling.schema import DeviceFacts, load_profile, save_profile
    from autohet_cli.settings import TrainingSettings

    shape = shapes_for(TINY.num_layers, 2, [1])[0]  # data parallel 2, one segment
    plan = shape_plan(shape, TINY, HOST, mbs=1, seq_len=64, precision="fp32")
    training = TrainingSettings(
        global_batch_size=8, micro_batch_size=1, seq_len=64, precision="fp32"
    )
    facts = DeviceFacts(
        gpu_type="cpu",
        mem_bytes=8 << 30,
        matmul_tflops=0.1,
        mem_bandwidth_gbytes_s=10.0,
        source="measured",
        allreduce_hop_ms=2.0,
        allreduce_gbytes_s=1.0,
    )
    prof = replace(_profile(_entry(1, 1, 10.0)), devices={"cpu": facts})
    save_profile(prof, tmp_path / "p.yaml")
    prof = load_profile(tmp_path / "p.yaml")  # the fit survives the file
    assert prof.devices["cpu"].allreduce_hop_ms == 2.0
    ev = evaluate(plan.pipelines, CLUSTER, CostTables(TINY, prof, training), 1)
    nbytes = sum(lt.num_params for lt in _entry(1, 1, 0).layers) * 4
    want = 2 * 2.0 + nbytes / 1e9 * 1e3  # 2 ring steps + n bytes at 1 GB/s
    assert abs(ev.grad_sync_ms - want) < 1e-6 * want
    plain = evaluate(
        plan.pipelines, CLUSTER, CostTables(TINY, _profile(_entry(1, 1, 10.0)), training), 1
    )
    # the link's nominal speed and the catalog's latency per message (costmodel.fixed)
    hop = CostTables(TINY, None, training).hop_ms("cpu")
    assert plain.grad_sync_ms - 2 * hop < want / 10 and plain.grad_sync_ms < want


def test_a_half_given_allreduce_fit_is_refused(tmp_path: Path) -> None:
    import pytest

    from autohet_cli.errors import ConfigError
    from autohet_cli.profiling.schema import load_profile

    bad = tmp_path / "p.yaml"
    bad.write_text(
        "schema: autohet.profile/v1\ndevices:\n  cpu: {mem_bytes: 1, matmul_tflops: 1,"
        " mem_bandwidth_gbytes_s: 1, allreduce_hop_ms: 0.1}\n"
    )
    with pytest.raises(ConfigError, match="allreduce_gbytes_s"):
        load_profile(bad)


def test_a_tp_runs_fixed_cost_is_charged_to_tp_stages_only(tmp_path: Path) -> None:
    from autohet_cli.profiling.schema import Overhead, load_profile, save_profile

    o = Overhead(step_ms=5.0, tp_step_ms={2: 40.0})
    assert (o.step_cost_ms(1), o.step_cost_ms(2), o.step_cost_ms(4)) == (5.0, 45.0, 5.0)
    prof = replace(_profile(_entry(1, 1, 10.0)), overheads={"cpu": o})
    save_profile(prof, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml").overheads["cpu"].tp_step_ms == {2: 40.0}
    bad = (tmp_path / "p.yaml").read_text().replace("2: 40.0", "1: 40.0")
    (tmp_path / "bad.yaml").write_text(bad)
    import pytest

    from autohet_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="tp_step_ms"):
        load_profile(tmp_path / "bad.yaml")


def test_merging_keeps_absorbed_runs_and_voids_stale_overheads() -> None:
    from autohet_cli.profiling.schema import DeviceFacts, Overhead

    fit = DeviceFacts(
        gpu_type="cpu", mem_bytes=1, matmul_tflops=1.0, mem_bandwidth_gbytes_s=1.0,
        source="measured", allreduce_hop_ms=0.1, allreduce_gbytes_s=2.0,
    )  # fmt: skip
    old = Profile(
        devices={"cpu": fit},
        overheads={"cpu": Overhead(step_ms=3.0, sync_x=5.0)},
        meta={"calibrated_from": ["run-a"], "runtime_runs": {"h1": []}},
    )
    # a re-probe (no TP > 1, no runtime runs) of the same type
    reprobe = Profile(
        devices={"cpu": replace(fit, allreduce_hop_ms=None, allreduce_gbytes_s=None)},
        meta={"calibrated_from": ["run-b"], "runtime_runs": {"h2": []}},
    )
    merged = old.merged_with(reprobe)
    assert merged.meta["calibrated_from"] == ["run-a", "run-b"]  # never absorbed twice
    assert set(merged.meta["runtime_runs"]) == {"h1", "h2"}
    assert "cpu" not in merged.overheads  # fitted against numbers the re-probe replaced
    assert merged.devices["cpu"].allreduce_gbytes_s == 2.0  # the fit is kept
    # newer overheads for the type are kept
    refit = replace(reprobe, overheads={"cpu": Overhead(step_ms=1.0)})
    assert old.merged_with(refit).overheads["cpu"].step_ms == 1.0


def test_the_search_syncs_at_the_measured_allreduce_rate() -> None:
    from autohet_cli.costmodel.tables import CostTables
    from autohet_cli.planner.estimate import allreduce_gbps
    from autohet_cli.planner.search import SearchRequest
    from autohet_cli.profiling.schema import DeviceFacts
    from autohet_cli.settings import TrainingSettings

    training = TrainingSettings(global_batch_size=8, micro_batch_size=1, seq_len=64)
    facts = DeviceFacts(
        gpu_type="cpu", mem_bytes=1 << 33, matmul_tflops=0.1, mem_bandwidth_gbytes_s=10.0,
        source="measured", allreduce_hop_ms=0.1, allreduce_gbytes_s=1.5,
    )  # fmt: skip
    for devices, want in (({"cpu": facts}, 12.0), ({}, 100.0)):
        prof = replace(_profile(_entry(1, 1, 1.0)), devices=devices)
        req = SearchRequest(
            cluster=CLUSTER, model=TINY, tables=CostTables(TINY, prof, training),
            global_batch_size=8,
        )  # fmt: skip
        assert allreduce_gbps(req, "cpu", 100.0) == want
