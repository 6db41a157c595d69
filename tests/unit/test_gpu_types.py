"""GPU types outside the catalog: defined in a cluster file, planned like catalog types.

A type such as an RTX A6000 gets its figures under ``gpu_types:``; every field is
checked, a name the catalog knows is refused, hostfiles are told what YAML to
write, and planning, estimating and the analytic profile work for the new type.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from autohet_cli.catalog import CATALOG, GIB
from autohet_cli.cluster import cluster_from_dict, cluster_to_dict, load_cluster, parse_hostfile
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import ConfigError, UnknownNameError
from autohet_cli.models import get_model
from autohet_cli.plan import load_plan
from autohet_cli.profiling.schema import DeviceFacts, Profile
from autohet_cli.settings import TrainingSettings
from tests.cli import autohet as run_autohet

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "profiles" / "clusters" / "custom-types.yaml"
A6000: dict[str, Any] = {
    "mem_gb": 48,
    "peak_tflops": {"bf16": 154.8, "fp16": 154.8, "fp32": 38.7},
    "mem_bandwidth_gbytes_s": 768,
}


def _raw(**types: Any) -> dict[str, Any]:
    return {
        "schema": "autohet.cluster/v1",
        "name": "ws",
        "gpu_types": types,
        "hosts": [{"name": "ws-0", "address": "127.0.0.2", "gpus": {"type": "A6000", "count": 2}}],
    }


def _error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        cluster_from_dict(raw, "c.yaml")
    return str(err.value)


# --- the cluster file -------------------------------------------------------------------------


def test_the_shipped_example_defines_two_types_beside_a_catalog_one() -> None:
    c = load_cluster(EXAMPLE)
    ws = c.host("ws-a6000")
    assert (ws.gpu_type, ws.num_gpus, ws.gpu_mem_bytes) == ("A6000", 4, 48 * GIB)
    assert ws.intra_node_gbps == 256.0
    assert c.host("l20-0").intra_node_gbps == 256.0  # the PCIe 4.0 default
    assert c.gpu_spec("A6000").peak_tflops_at("fp32") == 38.7
    assert c.gpu_spec("A6000").peak_tflops_at("bf16") == 154.8
    assert c.gpu_spec("A100-40") is CATALOG["A100-40"]


def test_defined_types_survive_a_round_trip_and_the_loss_of_hosts() -> None:
    c = load_cluster(EXAMPLE)
    assert cluster_from_dict(cluster_to_dict(c), "rt") == c
    assert cluster_from_dict(yaml.safe_load(yaml.safe_dump(cluster_to_dict(c))), "rt") == c
    survivors = c.without({"a100-0"})
    assert survivors.gpu_spec("L20").mem_bytes == 48 * GIB


def test_one_number_is_the_peak_at_every_precision() -> None:
    c = cluster_from_dict(_raw(A6000={**A6000, "peak_tflops": 100}), "c.yaml")
    assert {c.gpu_spec("A6000").peak_tflops_at(p) for p in ("bf16", "fp16", "fp32")} == {100.0}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"memory_gb": 48},
            ["gpu_types.A6000", "unknown key 'memory_gb'", "did you mean 'mem_gb'"],
        ),
        ({"mem_gb": -1}, ["gpu_types.A6000.mem_gb: must be positive"]),
        ({"mem_gb": "lots"}, ["gpu_types.A6000.mem_gb", "expected a number"]),
        ({"peak_tflops": {"tf32": 77}}, ["gpu_types.A6000.peak_tflops", "'tf32'"]),
        ({"peak_tflops": {}}, ["gpu_types.A6000.peak_tflops", "at least one of bf16"]),
        ({"peak_tflops": {"bf16": 0}}, ["gpu_types.A6000.peak_tflops.bf16: must be positive"]),
        ({"mem_bandwidth_gbytes_s": None}, ["gpu_types.A6000.mem_bandwidth_gbytes_s"]),
        ({"intra_node_gbps": 0}, ["gpu_types.A6000.intra_node_gbps: must be positive"]),
    ],
)
def test_every_field_is_checked_naming_it(change: dict[str, Any], expected: list[str]) -> None:
    body = {**copy.deepcopy(A6000), **change}
    message = _error(_raw(A6000=body))
    assert message.startswith("c.yaml: "), message
    for needle in expected:
        assert needle in message, message


def test_a_missing_figure_is_named() -> None:
    body = {k: v for k, v in A6000.items() if k != "mem_bandwidth_gbytes_s"}
    assert "missing required key 'mem_bandwidth_gbytes_s'" in _error(_raw(A6000=body))


@pytest.mark.parametrize(
    ("name", "catalog_name"), [("A100-40", "A100-40"), ("a100_40g", "A100-40")]
)
def test_a_catalog_name_cannot_be_redefined(name: str, catalog_name: str) -> None:
    raw = _raw(**{name: A6000})
    raw["hosts"][0]["gpus"]["type"] = name
    message = _error(raw)
    assert f"gpu_types.{name}" in message and f"the catalog's {catalog_name}" in message
    assert f"{name}-custom" in message  # the way out: another name


def test_a_type_name_is_one_word() -> None:
    assert "letters, digits" in _error(_raw(**{"RTX A6000": A6000}))


def test_an_unknown_type_says_how_to_define_it() -> None:
    message = _error(_raw())
    assert "c.yaml: hosts[0].gpus.type: unknown GPU type 'A6000'" in message
    assert "known types: A100-40" in message
    assert "gpu_types: {A6000: {mem_gb: 48" in message
    assert "profiles/clusters/custom-types.yaml" in message and "autohet profile run" in message


def test_a_near_miss_gets_a_did_you_mean() -> None:
    raw = _raw(A6000=A6000)
    raw["hosts"][0]["gpus"]["type"] = "a6000"  # case does not matter, as for catalog names
    assert cluster_from_dict(raw, "c.yaml").hosts[0].gpu_type == "A6000"
    raw["hosts"][0]["gpus"]["type"] = "A600"
    assert "did you mean A6000?" in _error(raw)
    raw["hosts"][0]["gpus"]["type"] = "RTX-3900"
    assert "did you mean RTX-3090?" in _error(raw)


def test_a_hostfile_with_an_unknown_type_prints_the_yaml_to_write() -> None:
    text = "10.0.0.1 slots=4 gpu=A6000\n10.0.0.2 slots=2 gpu=a100-40gb\n"
    with pytest.raises(ConfigError) as err:
        parse_hostfile(text, "hosts.txt", name="lab")
    message = str(err.value)
    assert message.startswith("hosts.txt:1: unknown GPU type 'A6000'")
    assert "A hostfile cannot define GPU types: save this as lab.yaml" in message
    written = message.split("pass that file instead:\n", 1)[1]
    raw = yaml.safe_load(written.replace("TODO", "50"))
    c = cluster_from_dict(raw, "lab.yaml")
    assert [(h.name, h.gpu_type, h.num_gpus) for h in c.hosts] == [
        ("10.0.0.1", "A6000", 4),
        ("10.0.0.2", "A100-40", 2),
    ]


# --- the cost model ---------------------------------------------------------------------------


def _tables(precision: str, profile: Profile | None = None) -> CostTables:
    c = load_cluster(EXAMPLE)
    training = TrainingSettings(
        global_batch_size=8, micro_batch_size=1, seq_len=4096, precision=precision
    )
    return CostTables(get_model("LLaMA-2-7B"), profile, training, gpu_specs=c.gpu_specs)


def test_the_analytic_profile_uses_the_peak_of_the_plans_precision() -> None:
    """A 7B block at 4096 tokens is compute-bound: fp32 costs 154.8/38.7 = 4x bf16."""
    block = next(i for i, x in enumerate(get_model("LLaMA-2-7B").layers()) if x.kind == "block")
    bf16 = _tables("bf16").entry("A6000", 1, 1).layers[block]
    fp32 = _tables("fp32").entry("A6000", 1, 1).layers[block]
    assert fp32.fwd_ms / bf16.fwd_ms == pytest.approx(154.8 / 38.7, rel=1e-6)
    assert _tables("bf16").spec("A6000").mem_bytes == 48 * GIB


def test_a_precision_without_a_figure_says_which_to_add() -> None:
    c = cluster_from_dict(_raw(A6000={**A6000, "peak_tflops": {"bf16": 154.8}}), "c.yaml")
    training = TrainingSettings(
        global_batch_size=8, micro_batch_size=1, seq_len=64, precision="fp32"
    )
    tables = CostTables(get_model("gpt-tiny"), None, training, gpu_specs=c.gpu_specs)
    with pytest.raises(ConfigError) as err:
        tables.entry("A6000", 1, 1)
    message = str(err.value)
    assert "gpu_types.A6000.peak_tflops" in message and "--precision bf16" in message


def test_catalog_types_keep_one_peak_at_every_precision() -> None:
    assert CATALOG["A100-40"].peak_tflops_at("fp32") == CATALOG["A100-40"].peak_tflops


def test_a_measured_type_plans_from_its_device_facts_alone() -> None:
    facts = DeviceFacts(
        gpu_type="MI250",
        mem_bytes=64 * GIB,
        matmul_tflops=180.0,
        mem_bandwidth_gbytes_s=1600.0,
        source="measured",
    )
    tables = _tables("bf16", Profile(devices={"MI250": facts}))
    assert tables.spec("MI250").mem_bytes == 64 * GIB
    assert tables.entry("MI250", 1, 1).layers[1].fwd_ms > 0
    with pytest.raises(UnknownNameError, match="gpu_types"):
        tables.spec("L40")


# --- end to end -------------------------------------------------------------------------------


def autohet(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_autohet(*args, cwd=cwd, timeout=240)


# gpt-tiny, batch 8, on the cluster file that follows
TINY_ON = ("plan", "--model", "gpt-tiny", "--global-batch-size", "8", "--cluster")


def test_plan_and_estimate_on_a_cluster_of_a_defined_type(tmp_path: Path) -> None:
    cluster = tmp_path / "ws.yaml"
    cluster.write_text(yaml.safe_dump(_raw(A6000=A6000)))
    res = autohet(*TINY_ON, str(cluster), "--time-limit", "5", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    plan_path = json.loads(res.stdout)["plan_path"]
    plan = load_plan(tmp_path / plan_path)
    assert {s.gpu_type for p in plan.pipelines for s in p.stages} == {"A6000"}
    est = autohet("estimate", plan_path, "--json", cwd=tmp_path)
    assert est.returncode == 0, est.stderr
    assert json.loads(est.stdout)["iteration_time_s"] == pytest.approx(
        json.loads(res.stdout)["iteration_time_s"], rel=1e-6
    )


def test_plan_on_an_undefined_type_fails_cleanly(tmp_path: Path) -> None:
    cluster = tmp_path / "ws.yaml"
    cluster.write_text(yaml.safe_dump(_raw()))
    res = autohet(*TINY_ON, str(cluster), cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "unknown GPU type 'A6000'" in res.stderr and "gpu_types:" in res.stderr
