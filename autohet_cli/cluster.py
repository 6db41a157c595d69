"""The inventory: hosts, their GPUs, and the links between them (pure).

Read from an ``autohet.cluster/v1`` YAML file or a DeepSpeed-style hostfile
(``host slots=N``, plus our optional ``gpu=TYPE``). Validation errors name the
file, the field and the fix, because a cluster file is hand-written. A YAML file
may define GPU types the catalog lacks (``gpu_types:``, see gputypes.py); a
hostfile cannot, and its error prints the YAML to write instead.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autohet_cli import catalog
from autohet_cli.catalog import GpuSpec
from autohet_cli.errors import ConfigError, UnknownNameError
from autohet_cli.gputypes import gpu_types_to_dict, parse_gpu_types, resolve_gpu_type, spec_of
from autohet_cli.limits import MAX_CLUSTER_GPUS, MAX_GPUS_PER_HOST, at_most
from autohet_cli.names import check_address, check_host_name, check_remote_dir
from autohet_cli.preemption import CheckSpec, check_from_dict
from autohet_cli.slurmconf import SlurmSettings, backend_from, settings_from_dict
from autohet_cli.yamlio import as_list, as_mapping, check_keys, coerce, load_yaml, read_text
from autohet_cli.yamlio import field as get

SCHEMA = "autohet.cluster/v1"
# Per user and private (created 0700; workers refuse directories others can write):
# never a world-writable place like /tmp, where anyone could plant a checkpoint.
DEFAULT_CHECKPOINT_DIR = "~/autohet/checkpoints"
PREEMPTION_KEY = "preemption_check"
_DEFAULT_KEYS = ("user", "port", "identity_file", "python", "workdir")
# Addresses that mean "this machine": such a host runs its commands here, without SSH.
LOCAL_ADDRESSES = ("localhost", "local")


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    name: str
    address: str
    gpu_type: str
    num_gpus: int
    gpu_mem_bytes: int
    intra_node_gbps: float
    spot: bool = False
    price_per_hour: float = 0.0
    checkpoint_dir: str = DEFAULT_CHECKPOINT_DIR
    user: str | None = None
    port: int = 22
    identity_file: str | None = None
    python: str = "python3"
    workdir: str = "~/autohet"
    # How the host announces a coming preemption (autohet_cli.preemption); None: off.
    preemption_check: CheckSpec | None = None

    @property
    def is_local(self) -> bool:
        return self.address in LOCAL_ADDRESSES


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    name: str
    hosts: tuple[Host, ...]
    inter_node_gbps: float
    pair_gbps: Mapping[frozenset[str], float] = field(default_factory=dict)
    remote_storage: str | None = None
    # Types the cluster file defines under gpu_types: (name -> figures); catalog types
    # are not repeated here.
    gpu_specs: Mapping[str, GpuSpec] = field(default_factory=dict)
    # How launch and recover start workers: "ssh" (every host reached over SSH) or
    # "slurm" (one heterogeneous batch job; host names are node names).
    backend: str = "ssh"
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    # The known_hosts file SSH checks host keys against (``--known-hosts`` overrides);
    # None: the user's ~/.ssh/known_hosts and the system's.
    known_hosts: str | None = None
    _by_name: Mapping[str, Host] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ConfigError(f"cluster {self.name!r}: no hosts")
        names = [h.name for h in self.hosts]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"cluster {self.name!r}: duplicate host names {sorted(dup)}")
        object.__setattr__(self, "_by_name", {h.name: h for h in self.hosts})

    def host(self, name: str) -> Host:
        # A dict, not a scan: the planner looks hosts up millions of times on 1024 GPUs.
        found = self._by_name.get(name)
        if found is None:
            raise UnknownNameError(f"cluster {self.name!r} has no host {name!r}")
        return found

    @property
    def num_gpus(self) -> int:
        return sum(h.num_gpus for h in self.hosts)

    def gpu_types(self) -> list[str]:
        """Distinct GPU types, in order of first appearance."""
        return list(dict.fromkeys(h.gpu_type for h in self.hosts))

    def gpu_spec(self, gpu_type: str) -> GpuSpec:
        """Figures of a type on this cluster: its own definition, else the catalog's."""
        return spec_of(gpu_type, self.gpu_specs)

    def link_gbps(self, a: str, b: str) -> float:
        """Per-direction bandwidth between two hosts (or within one host)."""
        if a == b:
            return self.host(a).intra_node_gbps
        return self.pair_gbps.get(frozenset((a, b)), self.inter_node_gbps)

    def without(self, lost: set[str]) -> Cluster:
        """The survivors after losing some hosts (for recovery and contingency)."""
        keep = tuple(h for h in self.hosts if h.name not in lost)
        return Cluster(
            name=self.name,
            hosts=keep,
            inter_node_gbps=self.inter_node_gbps,
            pair_gbps={k: v for k, v in self.pair_gbps.items() if not (k & lost)},
            remote_storage=self.remote_storage,
            gpu_specs=self.gpu_specs,
            backend=self.backend,
            slurm=self.slurm,
            known_hosts=self.known_hosts,
        )

    def total_mem_bytes(self) -> int:
        return sum(h.num_gpus * h.gpu_mem_bytes for h in self.hosts)


def python_for(host: Host) -> str:
    """The interpreter to run on a host. A local host left at the default name
    runs this very interpreter, which has torch (a system python3 often has not)."""
    if host.is_local and host.python in ("python3", "python"):
        return sys.executable
    return host.python


def load_cluster(path: str | Path) -> Cluster:
    """Load a cluster file; a file whose lines look like ``host slots=N`` is a hostfile."""
    p = Path(path)
    if p.suffix not in (".yaml", ".yml", ".json"):
        text = read_text(p)
        if _looks_like_hostfile(text):
            return parse_hostfile(text, str(p), name=p.stem)
    cluster = cluster_from_dict(load_yaml(p), str(p))
    kh = cluster.known_hosts
    if kh is not None and not kh.startswith("~") and not Path(kh).is_absolute():
        # Relative to the cluster file, as a path written in a file is read.
        cluster = dataclasses.replace(cluster, known_hosts=str(p.resolve().parent / kh))
    return cluster


def _looks_like_hostfile(text: str) -> bool:
    lines = [ln.split("#")[0].strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    return bool(lines) and all("slots=" in ln and ":" not in ln for ln in lines)


def parse_hostfile(text: str, where: str, *, name: str = "hostfile") -> Cluster:
    """DeepSpeed hostfile: ``host slots=N [gpu=TYPE]`` per line; ``#`` comments.

    Plain DeepSpeed hostfiles carry no GPU type; we read it from ``gpu=`` and
    otherwise ask for it, since planning on a guessed type would be wrong. A
    type outside the catalog needs figures a hostfile has no place for, so the
    error prints the equivalent cluster YAML with a ``gpu_types:`` entry to fill.
    """
    rows: list[tuple[str, dict[str, Any]]] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#")[0].strip()
        if not line:
            continue
        at = f"{where}:{lineno}"
        address, *tokens = line.split()
        if address in seen:
            raise ConfigError(f"{at}: host {address!r} already listed on line {seen[address]}")
        seen[address] = lineno
        opts: dict[str, str] = {}
        for tok in tokens:
            key, sep, value = tok.partition("=")
            if not sep or key not in ("slots", "gpu"):
                raise ConfigError(f"{at}: cannot read {tok!r}; expected 'slots=N' or 'gpu=TYPE'")
            opts[key] = value
        if "gpu" not in opts:
            raise ConfigError(
                f"{at}: no GPU type for {address!r}; append 'gpu=A100-40' (or the right type) "
                "to the line, or write an autohet.cluster/v1 YAML file"
            )
        try:
            slots = int(opts.get("slots", ""))
        except ValueError:
            raise ConfigError(f"{at}: slots must be a whole number, e.g. slots=8") from None
        rows.append((at, {"name": address, "gpus": {"type": opts["gpu"], "count": slots}}))
    if not rows:
        raise ConfigError(f"{where}: no hosts in hostfile")
    unknown = [h["gpus"]["type"] for _, h in rows if not _is_known(h["gpus"]["type"])]
    if unknown:
        at = next(at for at, h in rows if h["gpus"]["type"] == unknown[0])
        raise ConfigError(
            f"{at}: {catalog.unknown_gpu_message(unknown[0])}.\nA hostfile cannot define GPU "
            f"types: save this as {name}.yaml, fill in the datasheet figures, and pass that "
            f"file instead:\n{_hostfile_as_yaml(name, [h for _, h in rows], unknown)}"
        )
    hosts = tuple(_host({**h, "address": h["name"]}, {}, {}, at) for at, h in rows)
    return Cluster(name=name, hosts=hosts, inter_node_gbps=100.0)


def _is_known(raw: str) -> bool:
    try:
        catalog.canonical_gpu_name(raw)
    except UnknownNameError:
        return False
    return True


def _hostfile_as_yaml(name: str, hosts: list[dict[str, Any]], unknown: list[str]) -> str:
    lines = [f"schema: {SCHEMA}", f"name: {name}", "gpu_types:"]
    lines += [
        f"  {t}: {{mem_gb: TODO, peak_tflops: {{bf16: TODO, fp32: TODO}}, "
        "mem_bandwidth_gbytes_s: TODO}"
        for t in dict.fromkeys(unknown)
    ]
    lines.append("hosts:")
    for h in hosts:
        gpus = h["gpus"]
        lines.append(
            f"  - {{name: {h['name']}, gpus: {{type: {gpus['type']}, count: {gpus['count']}}}}}"
        )
    return "\n".join(lines)


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
        _host(as_mapping(h, f"{where}: hosts[{i}]"), defaults, defined, f"{where}: hosts[{i}]")
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
    "spot",
    "price_per_hour",
    "checkpoint_dir",
    *_DEFAULT_KEYS,
)


def _host(
    h: Mapping[str, Any], defaults: Mapping[str, Any], defined: Mapping[str, GpuSpec], at: str
) -> Host:
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
    )


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
