"""The probe measures this CPU; its result becomes a measured profile the planner uses.

The probe is packed into one file (``probe.pyz``, ``probepack``), copied alone to a
scratch directory and run as a script in an isolated interpreter, as ``autohet
profile run`` does on a remote host, once per module (a few seconds).
"""

from __future__ import annotations

import ast
import copy
import io
import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from autohet_cli.cluster import load_cluster
from autohet_cli.costmodel.fixed import layer_ops
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import ProfileError
from autohet_cli.models import ModelSpec, get_model
from autohet_cli.profiling import probepack
from autohet_cli.profiling.measure import layer_shapes, profile_from_probe, spec_for
from autohet_cli.profiling.probe import cli, driver, host, memory, shards
from autohet_cli.profiling.probe.spec import (
    DTYPE_NAMES,
    PROBE_VERSION,
    RESULT_SCHEMA,
    SpecError,
    check_spec,
)
from autohet_cli.profiling.schema import Profile, profile_from_dict, profile_to_dict
from autohet_cli.settings import TrainingSettings
from tests.model_specs import llama, sized
from tests.planning import plan_tables

ROOT = Path(__file__).resolve().parents[2]
PROBE_DIR = ROOT / "autohet_cli" / "profiling" / "probe"
LOCALHOST = ROOT / "profiles" / "clusters" / "localhost.yaml"
TINY = get_model("gpt-tiny")
SEQ = 64
TPS, MBSS = (1, 2), (1, 2, 8)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("probe")
    probepack.write_probe(work / "probe.pyz")
    # One thread per device, as the localhost cluster's two `cpu` devices share two cores.
    spec = spec_for(TINY, SEQ, TPS, MBSS, cpu_threads=1, time_budget_s=8)
    (work / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-I", "probe.pyz", "--spec", "spec.json", "--out", "result.json"],
        cwd=work,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tp 2 mbs 8 block" in proc.stderr  # progress lines
    out: dict[str, Any] = json.loads((work / "result.json").read_text(encoding="utf-8"))
    return out


def _layer(result: dict[str, Any], tp: int, mbs: int, kind: str) -> dict[str, Any]:
    (run,) = (r for r in result["runs"] if r["tp"] == tp and r["mbs"] == mbs)
    assert run["status"] == "ok", run
    layer: dict[str, Any] = run["layers"][kind]
    return layer


# --- the probe itself -------------------------------------------------------------------------


def _probe_sources() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(PROBE_DIR.glob("*.py"))}


def test_probe_imports_only_the_standard_library_torch_and_itself() -> None:
    sources = _probe_sources()
    own = {name.removesuffix(".py") for name in sources}
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    for name, text in sources.items():
        modules = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level:
                # its own modules, relatively: the package is renamed in the zipapp
                assert node.level == 1 and node.module in own, (name, node.module)
            elif isinstance(node, ast.ImportFrom):
                modules.add((node.module or "").split(".")[0])
        assert modules <= allowed, f"{name} must stay self-contained: {modules - allowed}"


def test_probe_modules_keep_to_python_3_8() -> None:
    """Hosts run the probe with whatever Python they have, 3.8 at the oldest."""
    for name, text in _probe_sources().items():
        ast.parse(text, filename=name, feature_version=(3, 8))


def test_the_packed_probe_holds_every_module_as_it_is() -> None:
    packed = probepack.pack_probe()
    assert packed == probepack.pack_probe()  # the same sources, the same bytes
    with zipfile.ZipFile(io.BytesIO(packed)) as archive:
        files = {name: archive.read(name).decode("utf-8") for name in archive.namelist()}
    main = files.pop("__main__.py")
    assert f"from {probepack.PACKAGE}.cli import main" in main
    sources = _probe_sources()
    assert {"cli.py", "driver.py", "spec.py", "__init__.py"} <= set(sources)
    assert files == {f"{probepack.PACKAGE}/{name}": text for name, text in sources.items()}


def test_the_result_keeps_its_keys(result: dict[str, Any]) -> None:
    """``autohet.probe-result/v1``'s top level, as autohet and older profiles read it."""
    assert set(result) == {
        "schema",
        "probe_version",
        "spec",
        "host",
        "gpus",
        "nvidia_smi",
        "device",
        "dtype",
        "matmul",
        "mem_bandwidth",
        "fixed",
        "peer_copy_gbytes_s",
        "tp_comm",
        "update",
        "runs",
        "elapsed_s",
        "created_utc",
        "notes",
    }


def test_result_describes_the_host_and_the_cpu_device(result: dict[str, Any]) -> None:
    assert result["schema"] == RESULT_SCHEMA and result["probe_version"] == PROBE_VERSION
    host = result["host"]
    assert host["hostname"] and host["python"] and host["torch"] and host["cpu_count"] >= 1
    assert result["gpus"] == [] and result["dtype"] == "fp32"
    device = result["device"]
    assert device["type"] == "cpu" and device["name"] == "cpu" and device["threads"] == 1
    assert 0 < device["mem_bytes"] <= 8 << 30 and device["cores"] >= 1
    assert result["matmul"]["tflops"] > 0 and result["mem_bandwidth"]["gbytes_s"] > 0


def test_every_combination_ran_with_positive_times(result: dict[str, Any]) -> None:
    assert [(r["tp"], r["mbs"]) for r in result["runs"]] == [(t, m) for t in TPS for m in MBSS]
    for run in result["runs"]:
        assert run["status"] == "ok", run
        assert set(run["layers"]) == {"embedding", "block", "head"}
        for kind, layer in run["layers"].items():
            assert layer["repeat"] >= 1
            assert layer["fwd_ms"] > 0 and layer["bwd_ms"] > 0, (run["tp"], run["mbs"], kind)
            assert layer["fwd_ms"] == pytest.approx(layer["compute_fwd_ms"] + layer["comm_fwd_ms"])
            assert layer["bwd_ms"] == pytest.approx(layer["compute_bwd_ms"] + layer["comm_bwd_ms"])
            # also timed under recomputation; the re-run forward repeats its all-reduces
            comm = layer["comm_fwd_ms"]
            assert layer["compute_recompute_fwd_ms"] > 0
            assert layer["recompute_fwd_ms"] == pytest.approx(
                layer["compute_recompute_fwd_ms"] + comm
            )
            assert layer["recompute_bwd_ms"] == pytest.approx(
                layer["compute_recompute_bwd_ms"] + comm + layer["comm_bwd_ms"]
            )
    for tp in TPS:
        for kind in ("embedding", "block", "head"):
            assert result["update"][str(tp)][kind]["status"] == "ok"
            assert result["update"][str(tp)][kind]["ms"] > 0


def test_backward_takes_longer_than_forward(result: dict[str, Any]) -> None:
    # Summed over micro-batch sizes, so one noisy sample cannot decide it.
    for tp in TPS:
        # The head's chunked loss forms its gradients in the forward (as the runtime's
        # does), so its backward is a scaling, and it is never recomputed.
        fwd = sum(_layer(result, tp, m, "head")["compute_fwd_ms"] for m in MBSS)
        bwd = sum(_layer(result, tp, m, "head")["compute_bwd_ms"] for m in MBSS)
        assert bwd < fwd, (tp, fwd, bwd)
        for kind in ("block",):
            fwd = sum(_layer(result, tp, m, kind)["compute_fwd_ms"] for m in MBSS)
            bwd = sum(_layer(result, tp, m, kind)["compute_bwd_ms"] for m in MBSS)
            assert bwd > 0.8 * fwd, (tp, kind, fwd, bwd)
            # under recomputation the backward runs the forward again
            rc_bwd = sum(_layer(result, tp, m, kind)["compute_recompute_bwd_ms"] for m in MBSS)
            assert rc_bwd > 0.8 * (bwd + fwd) * 0.8, (tp, kind, fwd, bwd, rc_bwd)


def test_time_and_activations_grow_with_the_micro_batch(result: dict[str, Any]) -> None:
    for tp in TPS:
        small, big = _layer(result, tp, 1, "block"), _layer(result, tp, 8, "block")
        t_small = small["compute_fwd_ms"] + small["compute_bwd_ms"]
        t_big = big["compute_fwd_ms"] + big["compute_bwd_ms"]
        assert t_big > 1.2 * t_small, (tp, t_small, t_big)  # 8x the tokens
        for kind in ("embedding", "block", "head"):
            act = [_layer(result, tp, m, kind)["act_bytes"] for m in MBSS]
            assert 0 < act[0] < act[1] < act[2], (tp, kind, act)
        assert big["output_bytes"] == 8 * SEQ * TINY.hidden_size * 4


def test_parameters_and_activations_split_across_tp_ranks(result: dict[str, Any]) -> None:
    layers = {layer.kind: layer for layer in TINY.layers()}
    for kind in ("embedding", "block", "head"):
        # At TP 1 the shard is the whole layer, exactly as the model zoo counts it.
        assert _layer(result, 1, 1, kind)["num_params"] == layers[kind].num_params
    one, two = _layer(result, 1, 2, "block"), _layer(result, 2, 2, "block")
    # Norms and row-parallel biases stay whole: a little over half.
    assert one["num_params"] / 2 <= two["num_params"] <= 0.52 * one["num_params"]
    assert two["act_bytes"] < one["act_bytes"]
    # The TP all-reduces were measured between two local gloo processes.
    comm = result["tp_comm"]["2"]
    assert comm["method"] == "gloo_allreduce", comm["note"]
    assert two["comm_fwd_ms"] > 0 and two["comm_bwd_ms"] > 0 and one["comm_fwd_ms"] == 0


def test_spec_errors_name_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = spec_for(TINY, SEQ, [1], [1])
    cases: list[tuple[dict[str, Any], str]] = [
        ({"seq_len": 0}, "spec.seq_len"),
        ({"tensor_parallel": []}, "spec.tensor_parallel"),
        ({"micro_batch_sizes": [1, "2"]}, "spec.micro_batch_sizes[1]"),
        ({"dtype": "int8"}, "spec.dtype"),
        ({"time_budget_s": -1}, "spec.time_budget_s"),
        ({"colour": "blue"}, "unknown key"),
        ({"layers": {"block": {"hidden_size": 64}}}, "spec.layers.block: missing"),
    ]
    for change, field in cases:
        with pytest.raises(SpecError, match=field.replace("[", r"\[")):
            check_spec({**good, **change})
    assert tuple(host.DTYPES) == DTYPE_NAMES  # what the check allows is what the host has
    bad = tmp_path / "spec.json"
    bad.write_text(json.dumps({**good, "schema": "nope"}), encoding="utf-8")
    assert cli.main(["--spec", str(bad), "--out", str(tmp_path / "r.json")]) == 2
    assert "spec.schema" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_what_cannot_fit_is_reported_as_oom_not_run() -> None:
    # A vocabulary no CPU device holds: predicted, so nothing is allocated.
    huge = sized("huge-vocab", "gpt2", (1, 64, 4, 4, 256, 1 << 30), num_positions=64)
    spec = spec_for(huge, 16, [1], [1], cpu_threads=1, time_budget_s=2, comm="copy")
    out = driver.run(spec)
    (run,) = out["runs"]
    assert run["status"] == "oom" and "embedding" in run["reason"]
    assert run["layers"]["block"]["status"] == "ok"
    assert out["update"]["1"]["embedding"]["status"] == "oom"
    profile = profile_from_probe(huge, out, host="localhost")
    assert not profile.entries and "cpu" in profile.devices
    assert any("oom" in note for note in profile.meta["history"][0]["notes"])


_LLAMA_MINI = llama("llama-mini", (2, 64, 4, 2, 128, 128))
# OPT's learned positions (offset by 2), embedding projection and no final norm
_OPT_FIELDS = {"num_positions": 18, "embed_proj_dim": 32, "final_norm": False}
_OPT_MINI = sized("opt-mini", "opt", (2, 64, 4, 4, 256, 128), **_OPT_FIELDS)


@pytest.mark.parametrize("model", [_LLAMA_MINI, _OPT_MINI], ids=lambda m: m.name)
def test_other_layer_shapes_measure_with_exact_parameter_counts(model: ModelSpec) -> None:
    # Rotary, grouped KV heads, SwiGLU, RMSNorm, a separate final norm; OPT's projections.
    spec = spec_for(model, 16, [1, 2], [1], cpu_threads=1, time_budget_s=2, comm="copy")
    out = driver.run(spec)
    assert all(r["status"] == "ok" for r in out["runs"]), out["runs"]
    assert "estimated as a ring all-reduce" in out["tp_comm"]["2"]["note"]
    profile = profile_from_probe(model, out, host="localhost")
    by_tp = {k.tensor_parallel: e for k, e in profile.entries.items()}
    assert [lt.num_params for lt in by_tp[1].layers] == [ly.num_params for ly in model.layers()]
    for one, two, layer in zip(by_tp[1].layers, by_tp[2].layers, model.layers(), strict=True):
        assert len(by_tp[2].layers) == model.num_layers
        if layer.kind == "norm":
            assert two.num_params == one.num_params
        else:
            assert two.num_params < one.num_params


def test_shard_problems_are_skipped_with_a_reason() -> None:
    block = layer_shapes(TINY)["block"]
    assert shards.shard_problem("block", block, 2) is None
    assert "heads" in str(shards.shard_problem("block", block, 3))
    assert shards.shard_problem("head", layer_shapes(TINY)["head"], 3) is None


def test_out_of_memory_errors_are_recognised() -> None:
    assert memory.is_oom(MemoryError())
    assert memory.is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert memory.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not memory.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


# --- the measured profile ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(result: dict[str, Any]) -> Profile:
    return profile_from_probe(TINY, result, host="localhost")


def test_profile_has_every_layer_of_every_combination(
    measured: Profile, result: dict[str, Any]
) -> None:
    assert len(measured.entries) == len(TPS) * len(MBSS)
    kinds = [layer.kind for layer in TINY.layers()]
    for key, entry in measured.entries.items():
        assert (key.model, key.gpu_type, key.seq_len) == (TINY.name, "cpu", SEQ)
        assert entry.source == "measured" and entry.dtype == "fp32"
        assert len(entry.layers) == TINY.num_layers
        for kind, timing in zip(kinds, entry.layers, strict=True):
            raw = _layer(result, key.tensor_parallel, key.micro_batch_size, kind)
            assert timing.fwd_ms == raw["fwd_ms"] and timing.bwd_ms == raw["bwd_ms"]
            assert timing.recompute_fwd_ms == raw["recompute_fwd_ms"]
            assert timing.recompute_bwd_ms == raw["recompute_bwd_ms"]
            assert timing.num_params == raw["num_params"]
            assert timing.act_bytes == raw["act_bytes"]
            upd = result["update"][str(key.tensor_parallel)][kind]["ms"]
            assert timing.update_ms == upd
    device = measured.devices["cpu"]
    assert device.source == "measured"
    assert device.matmul_tflops == result["matmul"]["tflops"]
    assert device.mem_bytes == result["device"]["mem_bytes"]


def test_profile_meta_records_host_time_and_versions(measured: Profile) -> None:
    meta = measured.meta
    assert meta["source"] == "measured" and meta["hosts"] == ["localhost"]
    assert meta["created"].endswith("+00:00") and meta["probe_version"] == PROBE_VERSION
    assert meta["software"]["torch"] and meta["software"]["python"]
    notes = meta["history"][0]["notes"]
    assert any("gloo" in n for n in notes) and any("thread" in n for n in notes)


def test_profile_round_trips_through_the_artifact(measured: Profile) -> None:
    again = profile_from_dict(profile_to_dict(measured), "measured.yaml")
    assert profile_to_dict(again) == profile_to_dict(measured)
    assert again.entries == measured.entries and again.devices == measured.devices


def test_the_probe_times_an_iteration_at_several_layer_counts(result: dict[str, Any]) -> None:
    """What ``fixedfit`` fits an iteration's fixed cost from (issue 31.6)."""
    times = result["fixed"]["iteration_ms"]
    assert sorted(times, key=int) == ["1", "2", "4"] and all(t > 0 for t in times.values())


def test_the_fixed_costs_are_fitted_from_the_probes_timings(result: dict[str, Any]) -> None:
    """Synthetic timings through the real result: the block's forward + backward at TP 1
    rise by 0.3 ms a sample from 1.5 ms at none (its ops' dispatch), an iteration by
    0.3 ms a layer from 2 ms (what it costs beyond its layers)."""
    timed = copy.deepcopy(result)
    for mbs in MBSS:
        block = _layer(timed, 1, mbs, "block")
        block["fwd_ms"], block["bwd_ms"] = 0.5 + 0.1 * mbs, 1.0 + 0.2 * mbs
    timed["fixed"] = {"iteration_ms": {"1": 2.3, "2": 2.6, "4": 3.2}}
    device = profile_from_probe(TINY, timed, host="h").devices["cpu"]
    block_spec = next(layer for layer in TINY.layers() if layer.kind == "block")
    assert device.op_us == pytest.approx(1.5 / sum(layer_ops(block_spec, TINY)) * 1e3)
    assert device.step_ms == pytest.approx(2.0)
    # a probe before 1.2 timed no iteration: the catalog's step cost stands
    del timed["fixed"]
    assert profile_from_probe(TINY, timed, host="h").devices["cpu"].step_ms is None


def test_update_time_is_estimated_where_adam_did_not_run(result: dict[str, Any]) -> None:
    partial = copy.deepcopy(result)
    partial["update"]["1"]["block"] = {"status": "oom", "reason": "MemoryError"}
    profile = profile_from_probe(TINY, partial, host="h")
    entry = next(e for k, e in profile.entries.items() if k.tensor_parallel == 1)
    block = entry.layers[1]
    bandwidth = result["mem_bandwidth"]["gbytes_s"] * 1e9
    assert block.update_ms == pytest.approx(block.num_params * 30 / bandwidth * 1e3)
    assert any("estimated" in n for n in profile.meta["history"][0]["notes"])


def _set(doc: dict[str, Any], path: list[Any], value: Any) -> None:
    for part in path[:-1]:
        doc = doc[part]
    if value is _DELETE:
        del doc[path[-1]]
    else:
        doc[path[-1]] = value


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (["schema"], "autohet.probe-result/v0", "schema"),
        (["dtype"], "int8", "dtype"),
        (["runs", 0, "layers", "block", "fwd_ms"], _DELETE, "runs[0].layers.block.fwd_ms"),
        (["runs", 1, "layers", "head", "bwd_ms"], -1.0, "runs[1].layers.head.bwd_ms"),
        (["runs", 2, "layers", "block", "num_params"], 1.5, "runs[2].layers.block.num_params"),
        (["runs", 0, "layers"], {"block": {}}, "runs[0].layers.embedding"),
        (["runs", 0, "tp"], 0, "runs[0].tp"),
        (["runs"], {}, "runs"),
        (["device", "mem_bytes"], "lots", "device.mem_bytes"),
        (["device", "type"], "tpu", "device.type"),
        (["device"], {"type": "cuda", "name": "Voodoo 5", "mem_bytes": 1}, "device.name"),
        (["matmul", "tflops"], float("nan"), "matmul.tflops"),
        (["mem_bandwidth"], _DELETE, "mem_bandwidth"),
        (["spec", "model"], "gpt-small", "spec.model"),
        (["spec", "layers", "block", "hidden_size"], 65, "spec.layers"),
    ],
)
def test_malformed_results_name_host_and_field(
    result: dict[str, Any], path: list[Any], value: Any, field: str
) -> None:
    bad = copy.deepcopy(result)
    _set(bad, path, value)
    with pytest.raises(ProfileError) as err:
        profile_from_probe(TINY, bad, host="gpu-7")
    message = str(err.value)
    assert message.startswith("probe result from gpu-7: ") and field in message, message


def test_a_second_run_of_the_same_combination_is_rejected(result: dict[str, Any]) -> None:
    bad = copy.deepcopy(result)
    bad["runs"].append(bad["runs"][0])
    with pytest.raises(ProfileError, match="a second run of tp 1 mbs 1"):
        profile_from_probe(TINY, bad, host="h")


def test_a_gpu_name_becomes_its_canonical_type(result: dict[str, Any]) -> None:
    gpu = copy.deepcopy(result)
    gpu["device"] = {"type": "cuda", "name": "NVIDIA A100-SXM4-40GB", "mem_bytes": 40 << 30}
    profile = profile_from_probe(TINY, gpu, host="a100-0")
    assert set(profile.devices) == {"A100-40"}
    assert {k.gpu_type for k in profile.entries} == {"A100-40"}


def _on(result: dict[str, Any], name: str) -> dict[str, Any]:
    gpu = copy.deepcopy(result)
    gpu["device"] = {"type": "cuda", "name": name, "mem_bytes": 48 << 30}
    return gpu


def test_a_type_the_cluster_defines_names_the_measurement(result: dict[str, Any]) -> None:
    """The host's declared type keys the profile; the catalog never sees the name."""
    profile = profile_from_probe(TINY, _on(result, "NVIDIA RTX A6000"), host="ws", gpu_type="A6000")
    assert set(profile.devices) == {"A6000"}
    assert {k.gpu_type for k in profile.entries} == {"A6000"}
    assert profile.meta["history"][-1]["device_name"] == "NVIDIA RTX A6000"


def test_an_unknown_card_without_a_declared_type_says_how_to_define_it(
    result: dict[str, Any],
) -> None:
    with pytest.raises(ProfileError) as err:
        profile_from_probe(TINY, _on(result, "NVIDIA RTX A6000"), host="ws")
    assert "device.name" in str(err.value) and "gpu_types:" in str(err.value)


@pytest.mark.parametrize(
    ("device", "declared", "found"),
    [
        ("Tesla V100-SXM2-16GB", "A100-40", "'Tesla V100-SXM2-16GB' (V100-16)"),
        (None, "A6000", "no GPU"),
        ("NVIDIA A100-SXM4-40GB", "cpu", "(A100-40)"),
    ],
)
def test_a_device_plainly_not_the_declared_type_is_refused(
    result: dict[str, Any], device: str | None, declared: str, found: str
) -> None:
    doc = result if device is None else _on(result, device)
    with pytest.raises(ProfileError) as err:
        profile_from_probe(TINY, doc, host="h", gpu_type=declared)
    message = str(err.value)
    assert f"gpus.type {declared} but the probe found" in message and found in message


def test_spec_for_rejects_nonsense() -> None:
    with pytest.raises(ProfileError, match="seq_len"):
        spec_for(TINY, 0, [1], [1])
    with pytest.raises(ProfileError, match="tensor_parallel"):
        spec_for(TINY, SEQ, [], [1])
    with pytest.raises(ProfileError, match="micro_batch_sizes"):
        spec_for(TINY, SEQ, [1], [0])
    with pytest.raises(ProfileError, match="dtype"):
        spec_for(TINY, SEQ, [1], [1], "int4")
    llama = spec_for(get_model("LLaMA-3-8B"), 8192, [1, 2], [1], dtype="bf16")
    assert set(llama["layers"]) == {"embedding", "block", "norm", "head"}
    assert llama["layers"]["block"]["rotary"] and llama["layers"]["block"]["gated_mlp"]
    assert not llama["layers"]["head"]["final_norm"]
    check_spec(llama)


# --- planning with it -------------------------------------------------------------------------


def test_localhost_plan_uses_the_measured_costs(measured: Profile) -> None:
    cluster = load_cluster(LOCALHOST)
    # A global batch of 2 keeps the planner to micro-batch sizes 1 and 2, both measured.
    training = TrainingSettings(
        global_batch_size=2, micro_batch_size=1, seq_len=SEQ, precision="fp32"
    )
    tables = CostTables(TINY, measured, training)
    outcome = plan_tables(cluster, tables, name="localhost", time_limit_s=20, with_baselines=False)
    plan = outcome.plan
    tp, mbs = plan.tensor_parallel, plan.training.micro_batch_size
    assert plan.prediction is not None and plan.prediction.iteration_time_s > 0
    stages = [s for p in plan.pipelines for s in p.stages]
    assert stages
    for stage in stages:
        assert stage.gpu_type == "cpu" and tables.is_measured("cpu", tp, mbs)
        entry = tables.entry("cpu", tp, mbs)
        assert entry.source == "measured"
        layers = entry.layers[stage.layer_start : stage.layer_end]
        assert stage.predicted is not None
        assert stage.predicted.fwd_ms == pytest.approx(sum(lt.fwd_ms for lt in layers))
        assert stage.predicted.bwd_ms == pytest.approx(sum(lt.bwd_ms for lt in layers))
    assert math.isfinite(plan.prediction.tokens_per_s)
