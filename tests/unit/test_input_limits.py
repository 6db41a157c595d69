"""Range, name and path checks at load (issue 11, items 5, 7, 8, 12), and the limits of
the one YAML loader: each refused value is named by file and field."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from autohet_cli.architecture import spec_from_dict, spec_to_dict
from autohet_cli.cluster import load_cluster
from autohet_cli.costmodel.budget import deadline_in
from autohet_cli.costmodel.pipeline import simulate_1f1b
from autohet_cli.errors import AutohetError, ConfigError, TimeLimitReached
from autohet_cli.hfconfig import load_hf_config
from autohet_cli.inputs import load_inputs
from autohet_cli.models import ZOO, ModelSpec
from autohet_cli.plan import load_plan, write_plan
from autohet_cli.planner.api import training_for
from autohet_cli.profiling.schema import load_profile
from autohet_cli.yamlio import load_yaml
from tests.planning import plan_inputs

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ROOT / "profiles" / "models" / "tiny-llama" / "config.json"


def cluster_yaml(
    host: str = "", network: str = "{inter_node_gbps: 100}", defaults: str = "{}"
) -> str:
    body = "name: h1, gpus: {type: cpu, count: 2}, checkpoint_dir: /data/ck"
    return (
        "schema: autohet.cluster/v1\nname: c\n"
        f"defaults: {defaults}\nnetwork: {network}\n"
        f"hosts:\n  - {{{body}{', ' + host if host else ''}}}\n"
    )


def error_of(load: object, path: Path) -> str:
    with pytest.raises(AutohetError) as info:
        load(path)  # type: ignore[operator]
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    return message


# ------------------------------------------------------------------ item 12: cluster


@pytest.mark.parametrize(
    ("host", "network", "needles"),
    [
        ("", "{inter_node_gbps: .nan}", ["network.inter_node_gbps", "finite"]),
        ("intra_node_gbps: .nan", None, ["hosts[0].intra_node_gbps", "finite"]),
        ("price_per_hour: -1.5", None, ["hosts[0].price_per_hour", "negative"]),
        ("port: 99999", None, ["hosts[0].port", "1-65535"]),
        ("port: 70000", None, ["hosts[0].port", "1-65535"]),
        ("port: 0", None, ["hosts[0].port", "1-65535"]),
        ("checkpoint_dir: -rf", None, ["hosts[0].checkpoint_dir", "starts with '-'"]),
        ("gpus: {type: cpu, count: 100000}", None, ["hosts[0].gpus.count", "larger than"]),
    ],
)
def test_cluster_nonsense_is_refused(
    tmp_path: Path, host: str, network: str | None, needles: list[str]
) -> None:
    path = tmp_path / "c.yaml"
    text = cluster_yaml(host, network or "{inter_node_gbps: 100}")
    path.write_text(text.replace("gpus: {type: cpu, count: 2}, ", "") if "gpus:" in host else text)
    message = error_of(load_cluster, path)
    for needle in needles:
        assert needle in message, message


def test_too_many_gpus_in_all() -> None:
    hosts = "".join(f"  - {{name: h{i}, gpus: {{type: cpu, count: 1024}}}}\n" for i in range(1025))
    raw = yaml.safe_load(f"schema: autohet.cluster/v1\nname: c\nhosts:\n{hosts}")
    from autohet_cli.cluster import cluster_from_dict

    with pytest.raises(ConfigError, match=r"c.yaml: hosts\[\*\]\.gpus\.count, summed"):
        cluster_from_dict(raw, "c.yaml")


# ------------------------------------------------------------------ item 8: remote dirs


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("checkpoint_dir", "ck", "is relative"),
        ("checkpoint_dir", "./ck", "is relative"),
        ("checkpoint_dir", "~bob/ck", "~user"),
        ("workdir", "autohet", "is relative"),
        ("workdir", "~root", "~user"),
    ],
)
def test_remote_dirs_must_be_absolute_or_home(
    tmp_path: Path, field: str, value: str, needle: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(cluster_yaml().replace("checkpoint_dir: /data/ck", f"{field}: '{value}'"))
    message = error_of(load_cluster, path)
    assert f"hosts[0].{field}" in message and needle in message, message
    assert "absolute path" in message and "~/" in message


def test_workdir_from_defaults_is_checked_too(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(cluster_yaml(defaults="{workdir: runs/here}"))
    assert "hosts[0].workdir" in error_of(load_cluster, path)


@pytest.mark.parametrize("value", ["~", "~/ck", "/data/ck", "~/a b/ck"])
def test_home_and_absolute_dirs_are_fine(tmp_path: Path, value: str) -> None:
    path = tmp_path / "c.yaml"
    text = cluster_yaml(f"workdir: '{value}'")
    path.write_text(text.replace("checkpoint_dir: /data/ck", f"checkpoint_dir: '{value}'"))
    host = load_cluster(path).hosts[0]
    assert host.checkpoint_dir == value and host.workdir == value


# ------------------------------------------------------------------ item 5: names


@pytest.mark.parametrize("name", ["a/b", "../x", "a b", "-oProxyCommand=x", ".hidden", "tab\tx"])
def test_host_names_that_are_paths_or_options(tmp_path: Path, name: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(cluster_yaml().replace("name: h1", f"name: {json.dumps(name)}"))
    message = error_of(load_cluster, path)
    assert "hosts[0].name" in message and "host name" in message, message


def test_hostfile_host_names_are_checked_too(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("../etc slots=2 gpu=cpu\n")
    assert "host name '../etc'" in error_of(load_cluster, path)


@pytest.fixture(scope="module")
def plan_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    inputs = load_inputs(None, "gpt-tiny")
    training = training_for(4, 64, "bf16", "adam")
    outcome = plan_inputs(inputs, training, name="tiny", time_limit_s=5, with_baselines=False)
    _, path = write_plan(outcome.plan, tmp_path_factory.mktemp("plans"))
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("old", "new", "needles"),
    [
        ("name: tiny", "name: ../../../../tmp/x", ["name:", "plan name"]),
        ("name: tiny", "name: ''", ["name:", "plan name ''"]),
        ("host: localhost", "host: ../x", ["devices", "host name '../x'"]),
        ("version: 1", "version: -3", ["version: must be at least 1"]),
        ("tensor_parallel: ", "tensor_parallel: 0 #", ["tensor_parallel"]),
    ],
)
def test_hand_edited_plans_are_validated_at_load(
    tmp_path: Path, plan_text: str, old: str, new: str, needles: list[str]
) -> None:
    assert old in plan_text
    path = tmp_path / "p.yaml"
    path.write_text(plan_text.replace(old, new), encoding="utf-8")
    message = error_of(load_plan, path)
    for needle in needles:
        assert needle in message, message


# ------------------------------------------------------------------ item 12: profiles


PROFILE = """schema: autohet.profile/v1
devices: {{cpu: {{mem_bytes: {mem}, matmul_tflops: {tflops}, mem_bandwidth_gbytes_s: 10}}}}
entries:
  - {{model: gpt-tiny, gpu_type: cpu, tensor_parallel: {tp}, micro_batch_size: 1, seq_len: 64,
     layers: [{{fwd_ms: 1, bwd_ms: 2, update_ms: 0.1, num_params: {params}, act_bytes: 8,
                output_bytes: {out}}}]}}
"""
GOOD = {"mem": 1000, "tflops": 1.0, "tp": 1, "params": 10, "out": 4}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"params": -5}, "layers[0].num_params: must not be negative"),
        ({"out": -1}, "layers[0].output_bytes: must not be negative"),
        ({"mem": -1}, "devices.cpu.mem_bytes: must be positive"),
        ({"tflops": ".nan"}, "devices.cpu.matmul_tflops: expected a finite number"),
        ({"tp": 0}, "entries[0].tensor_parallel: must be 1 to"),
        ({"tp": 10**9}, "entries[0].tensor_parallel: must be 1 to"),
    ],
)
def test_profile_nonsense_is_refused(
    tmp_path: Path, change: dict[str, object], needle: str
) -> None:
    path = tmp_path / "prof.yaml"
    path.write_text(PROFILE.format(**{**GOOD, **change}))
    assert needle in error_of(load_profile, path)


def test_the_good_profile_loads(tmp_path: Path) -> None:
    path = tmp_path / "prof.yaml"
    path.write_text(PROFILE.format(**GOOD))
    assert len(load_profile(path).entries) == 1


# ------------------------------------------------------------------ item 7: models


def test_model_sizes_are_bounded_wherever_a_spec_is_made(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model 'x': num_blocks: 1000000000 is larger than"):
        ModelSpec(
            name="x",
            family="gpt2",
            num_blocks=10**9,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=4,
            ffn_hidden_size=256,
            vocab_size=256,
        )
    arch = {**spec_to_dict(ZOO["gpt-tiny"]), "vocab_size": 10**12}
    with pytest.raises(ConfigError, match=r"^p.yaml: model.architecture: model 'gpt-tiny': vocab"):
        spec_from_dict(arch, "p.yaml: model.architecture")


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("hidden_size", 1 << 20, "hidden_size"),
        ("intermediate_size", 10**12, "ffn_hidden_size"),
        ("max_position_embeddings", 10**10, "max_position_embeddings"),
        ("rope_theta", float("nan"), "rope_theta: expected a finite number"),
        ("rms_norm_eps", float("inf"), "norm_eps: expected a finite number"),
    ],
)
def test_hf_config_sizes_are_bounded(tmp_path: Path, key: str, value: float, needle: str) -> None:
    config = json.loads(TINY_LLAMA.read_text(encoding="utf-8"))
    config[key] = value
    if key == "hidden_size":
        config["num_attention_heads"] = 4
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))  # json writes NaN and Infinity, as some tools do
    message = error_of(load_hf_config, path)
    assert needle in message, message


def test_deeply_nested_hf_config_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000)
    assert "not valid JSON" in error_of(load_hf_config, path)


# ------------------------------------------------------------------ item 7: the deadline


def test_the_simulator_stops_at_the_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(TimeLimitReached), deadline_in(0.2):
        simulate_1f1b([1.0] * 8, [2.0] * 8, 1 << 20)
    assert time.monotonic() - start < 1.5
    assert simulate_1f1b([1.0] * 8, [2.0] * 8, 64).makespan_ms > 0  # no deadline outside


# ------------------------------------------------------------------ the YAML loader


def test_anchors_and_merge_keys_still_work(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "schema: autohet.cluster/v1\nname: c\n"
        "x-host: &h {gpus: {type: cpu, count: 1}, checkpoint_dir: /ck}\n"
        "hosts:\n  - {<<: *h, name: a}\n  - {<<: *h, name: b}\n"
    )
    data = load_yaml(path)
    assert [h["name"] for h in data["hosts"]] == ["a", "b"]
    assert data["hosts"][1]["gpus"] == {"type": "cpu", "count": 1}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a: &x [1, *x]\n", "refers to a node that contains it"),
        ("a: 2024-13-45\n", "month must be in 1..12"),
        ("a: [1, 2\nb: 3\n", "(line 2): not valid YAML: while parsing a flow sequence, did"),
        ("- " * 70 + "x\n", "nested more than 64 levels deep"),
        ("a: !!python/object:os.system {}\n", "not valid YAML"),
    ],
)
def test_yaml_failures_are_one_line(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "f.yaml"
    path.write_text(text)
    assert needle in error_of(load_yaml, path)


# ------------------------------------------------- issue 29: huge numbers, shown short

BIG = "1" + "0" * 400  # 10^400: Python reads it whole; no field means anything by it


def _short(message: str) -> str:
    """A message that shows a huge number in a few characters, not its 400 digits."""
    assert "0" * 20 not in message and len(message) < 400, message
    return message


@pytest.mark.parametrize(
    ("host", "needles"),
    [
        (f"gpus: {{type: cpu, count: {BIG}}}", ["hosts[0].gpus.count", "1e+400"]),
        (f"gpus: {{type: cpu, count: -{BIG}}}", ["hosts[0].gpus.count", "-1e+400"]),
        (f"gpus: {{type: cpu, count: 2, mem_gb: {BIG}}}", ["hosts[0].gpus.mem_gb", "1e+400"]),
        (f"port: {BIG}", ["hosts[0].port", "1e+400"]),
        (f"price_per_hour: {BIG}", ["hosts[0].price_per_hour", "1e+400"]),
    ],
)
def test_a_huge_number_in_a_cluster_file_is_shown_short(
    tmp_path: Path, host: str, needles: list[str]
) -> None:
    path = tmp_path / "c.yaml"
    text = cluster_yaml(host)
    path.write_text(text.replace("gpus: {type: cpu, count: 2}, ", "") if "gpus:" in host else text)
    message = _short(error_of(load_cluster, path))
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"mem": BIG}, "devices.cpu.mem_bytes"),
        ({"params": BIG}, "layers[0].num_params"),
        ({"tp": BIG}, "entries[0].tensor_parallel"),
        ({"out": BIG}, "layers[0].output_bytes"),
    ],
)
def test_a_huge_number_in_a_profile_is_refused_and_shown_short(
    tmp_path: Path, change: dict[str, object], needle: str
) -> None:
    path = tmp_path / "prof.yaml"
    path.write_text(PROFILE.format(**{**GOOD, **change}))
    message = _short(error_of(load_profile, path))
    assert needle in message and "1e+400" in message, message


def test_a_huge_number_in_a_plan_is_refused_and_shown_short(tmp_path: Path, plan_text: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(plan_text.replace("version: 1", f"version: {BIG}"), encoding="utf-8")
    message = _short(error_of(load_plan, path))
    assert "version" in message and "1e+400" in message, message


def test_a_huge_number_in_a_model_config_is_shown_short(tmp_path: Path) -> None:
    config = json.loads(TINY_LLAMA.read_text(encoding="utf-8"))
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(config).replace(
            '"num_hidden_layers": ', f'"x": 0, "num_hidden_layers": {BIG}, "y": '
        )
    )
    message = _short(error_of(load_hf_config, path))
    assert "1e+400" in message, message


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (-12, "-12"),
        (10**14, "100000000000000"),
        (10**23, "1e+23"),
        (123456789 * 10**20, "1.23e+28"),
        (-(10**400), "-1e+400"),
        (10**5000, "a number of about 5,000 digits"),
    ],
    ids=["0", "-12", "1e14", "1e23", "1.23e28", "-1e400", "1e5000"],
)
def test_numbers_are_shown_whole_up_to_15_digits(value: int, text: str) -> None:
    from autohet_cli.limits import shown

    assert shown(value) == text


def test_values_are_shown_bounded_however_big_or_deep() -> None:
    from autohet_cli.limits import shown

    deep: list[object] = []
    for _ in range(10_000):
        deep = [deep]
    wide = {f"k{i}": "x" * 10_000 for i in range(10_000)}
    for value in (deep, wide, "y" * 10**6, [10**400] * 10**5, True, 1.5):
        assert len(shown(value)) <= 60
    assert shown(True) == "True" and shown("a") == "'a'" and shown([1, 2]) == "[1, 2]"
