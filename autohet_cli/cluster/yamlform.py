"""A cluster as plain data (the ``autohet.cluster/v1`` YAML form), both ways (pure).

Validation errors name the file, the field and the fix, because a cluster file is
hand-written. ``defaults:`` fills the SSH settings a host leaves out; a YAML file
may define GPU types the catalog lacks (``gpu_types:``, see gputypes.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autohet_cli import catalog
from autohet_cli.catalog import GpuSpec
from autohet_cli.cluster.schema import DEFAULT_CHECKPOINT_DIR, SCHEMA, Cluster, Host
from autohet_cli.errors import ConfigError, UnknownNameError
from autohet_cli.gputypes import gpu_types_to_dict, parse_gpu_types, resolve_gpu_type, spec_of
from autohet_cli.limits import MAX_CLUSTER_GPUS, MAX_GPUS_PER_HOST, at_most
from autohet_cli.names import check_address, check_host_name, check_remote_dir
from autohet_cli.preemption import CheckSpec, check_from_dict
from autohet_cli.slurmconf import SlurmSettings, backend_from, settings_from_dict
from autohet_cli.yamlio import as_list, as_mapping, check_keys, coerce
from autohet_cli.yamlio import field as get

PREEMPTION_KEY = "preemption_check"
_DEFAULT_KEYS = ("user", "port", "identity_file", "python", "workdir")


def cluster_from_dict(raw: Any, where: str) -> Cluster:
    d = as_mapping(raw, where)
    check_keys(
        d,
        where,
        ["schema", "name", "hosts"],
        [
            "defaults",
            "network",
            "remote_storage",
            "notes",
            "gpu_types",
            "backend",
            "slurm",
            "known_hosts",
        ],
    )
    if d["schema"] != SCHEMA:
        raise ConfigError(f"{where}: schema: expected {SCHEMA!r}, got {d['schema']!r}")
    defaults = as_mapping(d.get("defaults") or {}, f"{where}: defaults")
    check_keys(defaults, f"{where}: defaults", [], [*_DEFAULT_KEYS, PREEMPTION_KEY])
    network = as_mapping(d.get("network") or {}, f"{where}: network")
    check_keys(network, f"{where}: network", [], ["inter_node_gbps", "pairs"])
    inter = get(network, "inter_node_gbps", float, f"{where}: network", 100.0)
    _positive(inter, f"{where}: network.inter_node_gbps")
    defined = parse_gpu_types(d.get("gpu_types"), where)
    raw_hosts = as_list(d["hosts"], f"{where}: hosts")
    if not raw_hosts:
        raise ConfigError(f"{where}: hosts: empty; list at least one host")
    hosts = tuple(
        host_from_dict(
            as_mapping(h, f"{where}: hosts[{i}]"), defaults, defined, f"{where}: hosts[{i}]"
        )
        for i, h in enumerate(raw_hosts)
    )
    first: dict[str, int] = {}
    for i, h in enumerate(hosts):
        if h.name in first:
            raise ConfigError(
                f"{where}: hosts[{i}].name: {h.name!r} is already used by hosts[{first[h.name]}]; "
                "give every host a unique name"
            )
        first[h.name] = i
    at_most(
        sum(h.num_gpus for h in hosts),
        MAX_CLUSTER_GPUS,
        f"{where}: hosts[*].gpus.count, summed",
        "the largest training fleets have ~200k GPUs",
    )
    names = {h.name for h in hosts}
    pairs: dict[frozenset[str], float] = {}
    for i, pr in enumerate(as_list(network.get("pairs") or [], f"{where}: network.pairs")):
        at = f"{where}: network.pairs[{i}]"
        pm = as_mapping(pr, at)
        check_keys(pm, at, ["hosts", "gbps"])
        pair = as_list(pm["hosts"], f"{at}.hosts")
        pair_names = {str(n) for n in pair}
        if len(pair) != 2 or len(pair_names) != 2 or not pair_names <= names:
            raise ConfigError(
                f"{at}.hosts: expected two different host names of this cluster, got {pair}"
            )
        pairs[frozenset(pair_names)] = _positive(get(pm, "gbps", float, at), f"{at}.gbps")
    return Cluster(
        name=get(d, "name", str, where),
        hosts=hosts,
        inter_node_gbps=inter,
        pair_gbps=pairs,
        remote_storage=get(d, "remote_storage", str, where, None),
        gpu_specs=defined,
        backend=backend_from(d.get("backend"), f"{where}: backend"),
        slurm=settings_from_dict(d.get("slurm"), where, {h.gpu_type for h in hosts}),
        known_hosts=get(d, "known_hosts", str, where, None),
    )


_HOST_KEYS = (
    "intra_node_gbps",
    "nics",
    "spot",
    "price_per_hour",
    "checkpoint_dir",
    *_DEFAULT_KEYS,
)


def host_from_dict(
    h: Mapping[str, Any], defaults: Mapping[str, Any], defined: Mapping[str, GpuSpec], at: str
) -> Host:
    """One entry of ``hosts:``, its SSH settings filled from ``defaults``; also how a
    hostfile's lines become hosts (``cluster.hostfile``)."""
    check_keys(h, at, ["name", "gpus"], ["address", *_HOST_KEYS, PREEMPTION_KEY])
    gpus = as_mapping(h["gpus"], f"{at}.gpus")
    check_keys(gpus, f"{at}.gpus", ["type", "count"], ["mem_gb"])
    type_raw = get(gpus, "type", str, f"{at}.gpus")
    try:
        gpu_type = resolve_gpu_type(type_raw, defined)
    except UnknownNameError as exc:
        raise ConfigError(f"{at}.gpus.type: {exc}") from None
    spec = spec_of(gpu_type, defined)
    count = get(gpus, "count", int, f"{at}.gpus")
    if count < 1:
        raise ConfigError(f"{at}.gpus.count: must be at least 1, got {count}")
    at_most(count, MAX_GPUS_PER_HOST, f"{at}.gpus.count", "hosts carry 8 or 16 GPUs")
    mem_gb = get(gpus, "mem_gb", float, f"{at}.gpus", None)
    merged = {**defaults, **{k: v for k, v in h.items() if k in _DEFAULT_KEYS}}
    name = check_host_name(get(h, "name", str, at), f"{at}.name")
    port = coerce(merged.get("port", 22), int, f"{at}.port")
    if not 1 <= port <= 65535:
        raise ConfigError(f"{at}.port: {port} is not a TCP port; use 1-65535 (ssh: 22)")
    price = get(h, "price_per_hour", float, at, 0.0)
    if price < 0:
        raise ConfigError(f"{at}.price_per_hour: must not be negative, got {price}")
    workdir = _opt_str(merged, "workdir", at) or "~/autohet"
    if h.get(PREEMPTION_KEY) is not None:
        check: CheckSpec | None = check_from_dict(h[PREEMPTION_KEY], f"{at}.{PREEMPTION_KEY}")
    elif defaults.get(PREEMPTION_KEY) is not None:
        check = check_from_dict(defaults[PREEMPTION_KEY], f"defaults.{PREEMPTION_KEY}")
    else:
        check = None
    return Host(
        name=name,
        address=check_address(get(h, "address", str, at, name), f"{at}.address"),
        gpu_type=gpu_type,
        num_gpus=count,
        gpu_mem_bytes=int(_positive(mem_gb, f"{at}.gpus.mem_gb") * catalog.GIB)
        if mem_gb is not None
        else spec.mem_bytes,
        intra_node_gbps=_positive(
            get(h, "intra_node_gbps", float, at, spec.intra_node_gbps), f"{at}.intra_node_gbps"
        ),
        spot=get(h, "spot", bool, at, False),
        price_per_hour=price,
        checkpoint_dir=check_remote_dir(
            get(h, "checkpoint_dir", str, at, DEFAULT_CHECKPOINT_DIR), f"{at}.checkpoint_dir"
        ),
        user=_opt_str(merged, "user", at),
        port=port,
        identity_file=_opt_str(merged, "identity_file", at),
        python=_opt_str(merged, "python", at) or "python3",
        workdir=check_remote_dir(workdir, f"{at}.workdir"),
        preemption_check=check,
        nics=_nics(h, at, count),
    )


def _nics(h: Mapping[str, Any], at: str, count: int) -> int | None:
    """``nics``: the host's inter-node NICs (the sync and sharded-weight collectives
    of its TP ranks share them); absent: one per GPU."""
    nics = get(h, "nics", int, at, None)
    if nics is None:
        return None
    if nics < 1:
        raise ConfigError(
            f"{at}.nics: must be at least 1, got {nics} (the host's inter-node network "
            f"interfaces; leave it out for one per GPU)"
        )
    at_most(nics, 64, f"{at}.nics", "hosts carry 8 or 16 GPUs, one NIC each at most")
    return min(nics, count)


def _opt_str(d: Mapping[str, Any], key: str, at: str) -> str | None:
    return None if d.get(key) is None else coerce(d[key], str, f"{at}.{key}")


def _positive(value: float, at: str) -> float:
    if value <= 0:
        raise ConfigError(f"{at}: must be positive, got {value}")
    return value


def cluster_to_dict(c: Cluster) -> dict[str, Any]:
    """The canonical YAML form (used for fingerprints and embedded clusters)."""
    hosts = []
    for h in c.hosts:
        entry: dict[str, Any] = {
            "name": h.name,
            "address": h.address,
            "gpus": {
                "type": h.gpu_type,
                "count": h.num_gpus,
                "mem_gb": h.gpu_mem_bytes / catalog.GIB,
            },
            "intra_node_gbps": h.intra_node_gbps,
            "spot": h.spot,
            "price_per_hour": h.price_per_hour,
            "checkpoint_dir": h.checkpoint_dir,
            "port": h.port,
            "python": h.python,
            "workdir": h.workdir,
        }
        if h.user:
            entry["user"] = h.user
        if h.identity_file:
            entry["identity_file"] = h.identity_file
        if h.preemption_check is not None:
            entry[PREEMPTION_KEY] = h.preemption_check.to_dict()
        if h.nics is not None:  # only when set: clusters without it keep their digests
            entry["nics"] = h.nics
        hosts.append(entry)
    pairs = [{"hosts": sorted(k), "gbps": v} for k, v in c.pair_gbps.items()]
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "name": c.name,
        "network": {"inter_node_gbps": c.inter_node_gbps, "pairs": pairs},
        "hosts": hosts,
    }
    if c.remote_storage:
        out["remote_storage"] = c.remote_storage
    if c.gpu_specs:
        out["gpu_types"] = gpu_types_to_dict(c.gpu_specs)
    if c.backend != "ssh":
        out["backend"] = c.backend
    if c.slurm != SlurmSettings():
        out["slurm"] = c.slurm.to_dict()
    if c.known_hosts:
        out["known_hosts"] = c.known_hosts
    return out
