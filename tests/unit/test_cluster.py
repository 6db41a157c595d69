"""The cluster file: shipped examples, validation messages, queries, hostfiles, round trip."""

from __future__ import annotations

import ipaddress
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from autohet_cli import catalog
from autohet_cli.cluster import (
    SCHEMA,
    Cluster,
    cluster_from_dict,
    cluster_to_dict,
    load_cluster,
    parse_hostfile,
)
from autohet_cli.defaults import default_cluster_path
from autohet_cli.errors import ConfigError, UnknownNameError
from autohet_cli.yamlio import dump_yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "profiles" / "clusters"

# name -> GPUs per type, as advertised in each file's notes
ADVERTISED: dict[str, dict[str, int]] = {
    "paper-mix": {"A100-40": 8, "V100-16": 8, "RTX-3090": 8},
    "lab-mix": {"A100-40": 8, "V100-16": 8},
    "neo-a100-v100": {"A100-40": 8, "V100-16": 8},
    "small-mix": {"A100-40": 2, "V100-16": 2, "RTX-3090": 4},
    "mix-16": {"A100-40": 8, "V100-16": 4, "RTX-3090": 4},
    "mix-64": {"A100-40": 16, "V100-16": 24, "RTX-3090": 24},
    "mix-256": {"A100-40": 64, "V100-16": 96, "RTX-3090": 96},
    "scale-1024": {"A100-40": 256, "A100-80": 192, "V100-16": 384, "H100-80": 192},
    "localhost": {"cpu": 2},
    "custom-types": {"A6000": 4, "L20": 2, "A100-40": 2},
}


def _gpus_by_type(c: Cluster) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for h in c.hosts:
        counts[h.gpu_type] += h.num_gpus
    return dict(counts)


# ---------------------------------------------------------------- shipped examples


def test_every_example_file_is_covered() -> None:
    assert {p.stem for p in EXAMPLES.glob("*.yaml")} == set(ADVERTISED)


@pytest.mark.parametrize("name", sorted(ADVERTISED))
def test_example_loads_with_advertised_gpus(name: str) -> None:
    path = EXAMPLES / f"{name}.yaml"
    c = load_cluster(path)
    assert c.name == name
    assert _gpus_by_type(c) == ADVERTISED[name]
    assert c.num_gpus == sum(ADVERTISED[name].values())
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert raw["schema"] == SCHEMA
    assert isinstance(raw["notes"], str) and len(raw["notes"]) > 20


@pytest.mark.parametrize("name", sorted(ADVERTISED))
def test_example_addresses_are_loopback_only(name: str) -> None:
    for h in load_cluster(EXAMPLES / f"{name}.yaml").hosts:
        assert h.address == "localhost" or ipaddress.ip_address(h.address).is_loopback, h


def test_paper_mix_shape() -> None:
    c = load_cluster(EXAMPLES / "paper-mix.yaml")
    assert [h.num_gpus for h in c.hosts] == [4] * 6
    assert c.inter_node_gbps == 100
    assert len(c.pair_gbps) == 1
    for h in c.hosts:
        assert h.price_per_hour > 0
        assert h.spot == (h.gpu_type != "A100-40")
    a100 = next(h for h in c.hosts if h.gpu_type == "A100-40")
    rtx = next(h for h in c.hosts if h.gpu_type == "RTX-3090")
    assert a100.intra_node_gbps > rtx.intra_node_gbps  # NVLink vs PCIe
    assert a100.price_per_hour > rtx.price_per_hour


def test_lab_mix_matches_design() -> None:
    c = load_cluster(EXAMPLES / "lab-mix.yaml")
    a100, v100 = c.host("a100-0"), c.host("v100-0")
    assert (a100.num_gpus, a100.spot, a100.price_per_hour) == (8, False, 29.4)
    assert (a100.intra_node_gbps, a100.checkpoint_dir) == (2400, "/nvme/ckpt")
    assert (v100.num_gpus, v100.spot) == (8, True)
    assert a100.user == v100.user == "ubuntu"


def test_small_mix_is_brute_forceable() -> None:
    c = load_cluster(EXAMPLES / "small-mix.yaml")
    assert c.num_gpus <= 8
    assert 2 <= len(c.gpu_types()) <= 3


@pytest.mark.parametrize("name", ["mix-64", "mix-256", "scale-1024"])
def test_benchmark_clusters_use_8_gpu_hosts(name: str) -> None:
    c = load_cluster(EXAMPLES / f"{name}.yaml")
    assert {h.num_gpus for h in c.hosts} == {8}


def test_scale_1024_is_mostly_spot() -> None:
    c = load_cluster(EXAMPLES / "scale-1024.yaml")
    assert len(c.hosts) == 128
    assert sum(h.spot for h in c.hosts) > len(c.hosts) // 2


def test_localhost_default_is_packaged() -> None:
    packaged = default_cluster_path()
    assert packaged.is_file()
    example = EXAMPLES / "localhost.yaml"
    assert packaged.read_bytes() == example.read_bytes()
    c = load_cluster(packaged)
    (host,) = c.hosts
    assert (host.name, host.address, host.is_local) == ("localhost", "localhost", True)
    assert (host.gpu_type, host.num_gpus) == ("cpu", 2)
    assert host.checkpoint_dir == "~/autohet/checkpoints"  # private, never a shared /tmp


# ---------------------------------------------------------------- validation messages


def _base() -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "name": "t",
        "network": {"inter_node_gbps": 100, "pairs": [{"hosts": ["a", "b"], "gbps": 50}]},
        "hosts": [
            {"name": "a", "address": "127.0.0.2", "gpus": {"type": "A100-40", "count": 4}},
            {"name": "b", "address": "127.0.0.3", "gpus": {"type": "V100-16", "count": 2}},
        ],
    }


def _write(tmp_path: Path, data: Any, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    text = data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False)
    path.write_text(text, encoding="utf-8")
    return path


def _error(tmp_path: Path, data: Any) -> str:
    path = _write(tmp_path, data, "bad-cluster.yaml")
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    msg = str(info.value)
    assert "bad-cluster.yaml" in msg, msg
    return msg


def test_base_document_is_valid(tmp_path: Path) -> None:
    c = load_cluster(_write(tmp_path, _base()))
    assert c.num_gpus == 6


def test_unknown_gpu_key_names_allowed_keys(tmp_path: Path) -> None:
    d = _base()
    d["hosts"][0]["gpus"] = {"type": "A100-40", "cuont": 4}
    msg = _error(tmp_path, d)
    assert "hosts[0].gpus" in msg and "'cuont'" in msg
    assert "allowed: count, mem_gb, type" in msg


@pytest.mark.parametrize(
    ("where", "key", "field"),
    [
        ((), "nmae", "unknown key 'nmae'"),
        (("hosts", 1), "adress", "hosts[1]: unknown key 'adress'"),
        (("network",), "inter_gbps", "network: unknown key 'inter_gbps'"),
    ],
)
def test_unknown_keys_rejected_everywhere(
    tmp_path: Path, where: tuple[Any, ...], key: str, field: str
) -> None:
    d = _base()
    target: Any = d
    for step in where:
        target = target[step]
    target[key] = 1
    msg = _error(tmp_path, d)
    assert field in msg and "allowed:" in msg


def test_unknown_defaults_key(tmp_path: Path) -> None:
    d = _base()
    d["defaults"] = {"username": "x"}
    msg = _error(tmp_path, d)
    assert "defaults: unknown key 'username'" in msg
    assert "identity_file" in msg and "workdir" in msg


def _set(d: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    target: Any = d
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (("hosts", 0, "gpus", "count"), "eight", "hosts[0].gpus.count: expected an integer"),
        (("hosts", 0, "gpus", "count"), True, "hosts[0].gpus.count: expected an integer"),
        (("hosts", 0, "gpus", "count"), 2.5, "hosts[0].gpus.count: expected an integer"),
        (("hosts", 0, "gpus", "count"), 0, "hosts[0].gpus.count: must be at least 1"),
        (("hosts", 1, "spot"), "yes", "hosts[1].spot: expected true or false"),
        (("hosts", 1, "price_per_hour"), "cheap", "hosts[1].price_per_hour: expected a number"),
        (("hosts", 0, "port"), "ssh", "hosts[0].port: expected an integer"),
        (("hosts", 0, "gpus"), [4], "hosts[0].gpus: expected a mapping"),
        (("hosts", 0, "gpus", "mem_gb"), 0, "hosts[0].gpus.mem_gb: must be positive"),
        (("hosts", 1), "v100-0", "hosts[1]: expected a mapping"),
        (("hosts",), {"a": 1}, "hosts: expected a list"),
        (("hosts",), [], "hosts: empty"),
        (("network", "inter_node_gbps"), "fast", "network.inter_node_gbps: expected a number"),
        (("network", "inter_node_gbps"), 0, "network.inter_node_gbps: must be positive"),
        (("network", "inter_node_gbps"), -10, "network.inter_node_gbps: must be positive"),
        (("hosts", 0, "intra_node_gbps"), 0, "hosts[0].intra_node_gbps: must be positive"),
        (("network", "pairs", 0, "gbps"), -1, "network.pairs[0].gbps: must be positive"),
        (("network", "pairs"), {"a": "b"}, "network.pairs: expected a list"),
        (("hosts", 0, "nics"), 0, "hosts[0].nics: must be at least 1"),
        (("hosts", 0, "nics"), "two", "hosts[0].nics: expected an integer"),
        (("hosts", 0, "nics"), 1000, "hosts[0].nics: 1000 is larger than 64"),
    ],
)
def test_bad_values_name_file_and_field(
    tmp_path: Path, path: tuple[Any, ...], value: Any, expected: str
) -> None:
    d = _base()
    _set(d, path, value)
    assert expected in _error(tmp_path, d)


def test_missing_required_keys(tmp_path: Path) -> None:
    d = _base()
    del d["hosts"][0]["gpus"]["type"]
    assert "hosts[0].gpus: missing required key 'type'" in _error(tmp_path, d)
    d = _base()
    del d["name"]
    assert "missing required key 'name'" in _error(tmp_path, d)


def test_unknown_gpu_type_lists_known_types(tmp_path: Path) -> None:
    d = _base()
    d["hosts"][1]["gpus"]["type"] = "A200-40"
    msg = _error(tmp_path, d)
    assert "hosts[1].gpus.type" in msg and "'A200-40'" in msg
    assert "known types:" in msg
    for name in ("A100-40", "V100-16", "RTX-3090", "H100-80", "cpu"):
        assert name in msg


def test_gpu_type_spellings_are_canonicalised(tmp_path: Path) -> None:
    d = _base()
    d["hosts"][0]["gpus"]["type"] = "NVIDIA A100-SXM4-40GB"
    d["hosts"][1]["gpus"]["type"] = "v100_16gb"
    c = load_cluster(_write(tmp_path, d))
    assert [h.gpu_type for h in c.hosts] == ["A100-40", "V100-16"]


def test_duplicate_host_names(tmp_path: Path) -> None:
    d = _base()
    d["hosts"][1]["name"] = "a"
    d["network"]["pairs"] = []
    msg = _error(tmp_path, d)
    assert "hosts[1].name" in msg and "'a'" in msg and "unique" in msg


@pytest.mark.parametrize("pair", [["a", "nope"], ["a", "a"], ["a"], ["a", "b", "a"]])
def test_bad_pair_override_hosts(tmp_path: Path, pair: list[str]) -> None:
    d = _base()
    d["network"]["pairs"][0]["hosts"] = pair
    msg = _error(tmp_path, d)
    assert "network.pairs[0].hosts" in msg and "host names of this cluster" in msg
    assert repr(pair) in msg


@pytest.mark.parametrize("schema", ["autohet.cluster/v2", "autohet.plan/v1", 1])
def test_wrong_schema(tmp_path: Path, schema: Any) -> None:
    d = _base()
    d["schema"] = schema
    msg = _error(tmp_path, d)
    assert "schema" in msg and f"expected {SCHEMA!r}" in msg and repr(schema) in msg


def test_missing_schema(tmp_path: Path) -> None:
    d = _base()
    del d["schema"]
    assert "missing required key 'schema'" in _error(tmp_path, d)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            "schema: autohet.cluster/v1\nname: bad\nhosts:\n"
            "  - {name: a, gpus: {type: A100-40, count: 1}\n  - {name: b}\n",
            5,
        ),
        ("schema: autohet.cluster/v1\nname: bad\n  hosts: 3\n", 3),
        ("schema: autohet.cluster/v1\nname: bad\nhosts:\n\t- x\n", 4),
    ],
)
def test_invalid_yaml_reports_line(tmp_path: Path, text: str, line: int) -> None:
    msg = _error(tmp_path, text)
    assert f"(line {line})" in msg and "not valid YAML" in msg


def test_empty_and_missing_files(tmp_path: Path) -> None:
    assert "expected a mapping" in _error(tmp_path, "")
    with pytest.raises(ConfigError, match="nowhere.yaml: file not found"):
        load_cluster(tmp_path / "nowhere.yaml")


# ---------------------------------------------------------------- defaults and queries


def test_defaults_merge_into_hosts_and_hosts_override(tmp_path: Path) -> None:
    d = _base()
    d["defaults"] = {
        "user": "alice",
        "port": 2222,
        "identity_file": "~/.ssh/lab",
        "python": "/opt/venv/bin/python",
        "workdir": "/srv/autohet",
    }
    d["hosts"][1].update(user="bob", port=22, python="python3.11")
    c = load_cluster(_write(tmp_path, d))
    a, b = c.hosts
    assert (a.user, a.port, a.identity_file, a.python, a.workdir) == (
        "alice",
        2222,
        "~/.ssh/lab",
        "/opt/venv/bin/python",
        "/srv/autohet",
    )
    assert (b.user, b.port, b.identity_file, b.python, b.workdir) == (
        "bob",
        22,
        "~/.ssh/lab",
        "python3.11",
        "/srv/autohet",
    )


def test_host_fallbacks_without_defaults(tmp_path: Path) -> None:
    d = _base()
    del d["hosts"][1]["address"]
    d["hosts"][1]["gpus"]["mem_gb"] = 15
    c = load_cluster(_write(tmp_path, d))
    a, b = c.hosts
    assert (a.user, a.port, a.identity_file, a.python, a.workdir) == (
        None,
        22,
        None,
        "python3",
        "~/autohet",
    )
    assert b.address == "b"
    assert a.gpu_mem_bytes == catalog.CATALOG["A100-40"].mem_bytes
    assert b.gpu_mem_bytes == 15 * catalog.GIB
    assert (a.spot, a.price_per_hour) == (False, 0.0)


def test_link_gbps(tmp_path: Path) -> None:
    d = _base()
    d["hosts"][0]["intra_node_gbps"] = 2000
    d["hosts"].append(
        {"name": "c", "address": "127.0.0.4", "gpus": {"type": "RTX-3090", "count": 2}}
    )
    c = load_cluster(_write(tmp_path, d))
    assert c.link_gbps("a", "a") == 2000
    assert c.link_gbps("b", "b") == catalog.CATALOG["V100-16"].intra_node_gbps
    assert c.link_gbps("c", "c") == catalog.CATALOG["RTX-3090"].intra_node_gbps
    assert c.link_gbps("a", "b") == c.link_gbps("b", "a") == 50
    assert c.link_gbps("a", "c") == c.link_gbps("c", "b") == 100
    with pytest.raises(UnknownNameError, match="no host 'zz'"):
        c.link_gbps("zz", "zz")


def test_nics_say_how_many_tp_ranks_add_up_on_one(tmp_path: Path) -> None:
    """``nics``: a host's inter-node NICs; absent, one per GPU. Written back (and
    into fingerprints) only when set, so clusters without it keep their digests."""
    d = _base()
    default = load_cluster(_write(tmp_path, d))
    assert default.host("a").nics is None and default.host("a").nic_share(4) == 1
    assert "nics" not in cluster_to_dict(default)["hosts"][0]
    d["hosts"][0]["nics"] = 1  # 4 GPUs, one NIC
    d["hosts"][1]["nics"] = 8  # more NICs than GPUs count as one per GPU
    c = load_cluster(_write(tmp_path, d))
    assert [c.host("a").nic_share(t) for t in (1, 2, 4)] == [1, 2, 4]
    assert c.host("b").nics == 2 and c.host("b").nic_share(2) == 1
    d["hosts"][0]["nics"] = 2  # two GPUs per NIC
    c2 = load_cluster(_write(tmp_path, d))
    assert [c2.host("a").nic_share(t) for t in (1, 2, 4)] == [1, 2, 2]
    again = cluster_from_dict(cluster_to_dict(c2), "again")
    assert again.host("a").nics == 2 and cluster_to_dict(again) == cluster_to_dict(c2)


def test_queries(tmp_path: Path) -> None:
    c = load_cluster(_write(tmp_path, _base()))
    assert c.gpu_types() == ["A100-40", "V100-16"]
    assert c.host("b").num_gpus == 2
    assert c.total_mem_bytes() == 4 * 40 * catalog.GIB + 2 * 16 * catalog.GIB
    with pytest.raises(UnknownNameError, match="no host 'x'"):
        c.host("x")


def test_without_drops_hosts_and_their_pairs() -> None:
    c = load_cluster(EXAMPLES / "paper-mix.yaml")
    survivors = c.without({"a100-1", "rtx3090-0"})
    assert [h.name for h in survivors.hosts] == ["a100-0", "v100-0", "v100-1", "rtx3090-1"]
    assert survivors.num_gpus == c.num_gpus - 8
    assert dict(survivors.pair_gbps) == {}
    assert survivors.inter_node_gbps == c.inter_node_gbps
    assert len(c.hosts) == 6 and len(c.pair_gbps) == 1  # the original is untouched
    kept = c.without({"v100-0"})
    assert dict(kept.pair_gbps) == dict(c.pair_gbps)
    assert kept.link_gbps("a100-0", "a100-1") == 200
    with pytest.raises(ConfigError, match="no hosts"):
        c.without({h.name for h in c.hosts})


# ---------------------------------------------------------------- DeepSpeed hostfiles


HOSTFILE = """\
# two fake hosts on loopback
127.0.0.2 slots=4 gpu=A100-40   # the big one

127.0.0.3 slots=2 gpu=v100_16gb
"""


def test_hostfile_parsing() -> None:
    c = parse_hostfile(HOSTFILE, "hosts.txt", name="lab")
    assert c.name == "lab"
    assert [(h.name, h.address, h.gpu_type, h.num_gpus) for h in c.hosts] == [
        ("127.0.0.2", "127.0.0.2", "A100-40", 4),
        ("127.0.0.3", "127.0.0.3", "V100-16", 2),
    ]
    assert c.inter_node_gbps == 100


@pytest.mark.parametrize("filename", ["hostfile", "hosts.txt"])
def test_load_cluster_detects_hostfiles(tmp_path: Path, filename: str) -> None:
    c = load_cluster(_write(tmp_path, HOSTFILE, filename))
    assert c.name == Path(filename).stem
    assert c.num_gpus == 6


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "127.0.0.2 slots=4 gpu=A100-40\n127.0.0.3 slots=8\n",
            [":2:", "no GPU type for '127.0.0.3'", "gpu=A100-40", "autohet.cluster/v1"],
        ),
        ("127.0.0.2 slots=four gpu=A100-40\n", [":1:", "slots must be a whole number"]),
        ("127.0.0.2 slots= gpu=A100-40\n", [":1:", "slots must be a whole number"]),
        ("127.0.0.2 slots=0 gpu=A100-40\n", [":1", "gpus.count: must be at least 1"]),
        ("127.0.0.2 slots=4 gpu=A100-40 cpus=8\n", [":1:", "cannot read 'cpus=8'"]),
        ("127.0.0.2 slots=4 gpu=Z80\n", [":1", "unknown GPU type 'Z80'", "known types"]),
        (
            "127.0.0.2 slots=4 gpu=A100-40\n# again\n127.0.0.2 slots=4 gpu=A100-40\n",
            [":3:", "already listed on line 1"],
        ),
        ("# nothing here\n\n", ["no hosts in hostfile"]),
    ],
)
def test_hostfile_errors(text: str, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_hostfile(text, "myhosts")
    msg = str(info.value)
    assert msg.startswith("myhosts")
    for part in expected:
        assert part in msg, msg


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("name", sorted(ADVERTISED))
def test_examples_round_trip(name: str) -> None:
    c = load_cluster(EXAMPLES / f"{name}.yaml")
    assert cluster_from_dict(cluster_to_dict(c), "rt") == c
    assert cluster_from_dict(yaml.safe_load(dump_yaml(cluster_to_dict(c))), "rt") == c


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    d = _base()
    d["remote_storage"] = "s3://bucket/ckpt"
    d["defaults"] = {"user": "alice", "identity_file": "~/.ssh/k", "workdir": "/srv/w"}
    d["hosts"][0].update(
        spot=True, price_per_hour=3.5, checkpoint_dir="/nvme/c", port=2200, intra_node_gbps=999
    )
    d["hosts"][1]["gpus"]["mem_gb"] = 15.5
    c = load_cluster(_write(tmp_path, d))
    back = cluster_from_dict(cluster_to_dict(c), "rt")
    assert back == c
    assert back.remote_storage == "s3://bucket/ckpt"
    assert back.host("b").gpu_mem_bytes == int(15.5 * catalog.GIB)
    assert back.host("a").port == 2200 and back.host("a").user == "alice"


@pytest.mark.parametrize(
    "address",
    ["-oProxyCommand=touch /tmp/x", "a b", "a;b", "$(id)", "a`id`", "h\nx", "", "x" * 300],
)
def test_an_address_that_is_no_host_name_or_ip_is_refused(tmp_path: Path, address: str) -> None:
    """ssh would take a leading '-' as an option (ProxyCommand runs a command)."""
    d = _base()
    d["hosts"][0]["address"] = address
    msg = _error(tmp_path, d)
    assert "hosts[0].address" in msg and "host name or an IP address" in msg


@pytest.mark.parametrize(
    "address", ["10.0.0.1", "gpu-01.lab.example.org", "::1", "fe80::1%eth0", "2001:db8::2", "h_1"]
)
def test_host_names_and_ip_addresses_are_addresses(tmp_path: Path, address: str) -> None:
    d = _base()
    d["hosts"][0]["address"] = address
    assert load_cluster(_write(tmp_path, d)).hosts[0].address == address


def test_a_cluster_file_names_its_known_hosts_once(tmp_path: Path) -> None:
    """Issue 46: --known-hosts had to be given to every command; the cluster file may
    name it (relative to the file), and --known-hosts still wins."""
    from autohet_cli.cluster import cluster_to_dict, load_cluster
    from autohet_cli.transport.pool import ConnectOptions, HostPool

    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "c.yaml"
    path.write_text(
        "schema: autohet.cluster/v1\nname: c\nknown_hosts: keys/known\n"
        "hosts:\n  - {name: a, address: localhost, gpus: {type: cpu, count: 1}}\n"
    )
    cluster = load_cluster(path)
    assert cluster.known_hosts == str(tmp_path / "sub" / "keys" / "known")
    assert cluster.without({"x"}).known_hosts == cluster.known_hosts
    assert cluster_to_dict(cluster)["known_hosts"] == cluster.known_hosts
    with HostPool(cluster, ConnectOptions()) as pool:
        assert pool.connect.known_hosts == tmp_path / "sub" / "keys" / "known"
    mine = tmp_path / "mine"
    with HostPool(cluster, ConnectOptions(known_hosts=mine)) as pool:
        assert pool.connect.known_hosts == mine
    path.write_text(path.read_text().replace("known_hosts:", "known_host:"))
    with pytest.raises(ConfigError, match="known_host"):
        load_cluster(path)
