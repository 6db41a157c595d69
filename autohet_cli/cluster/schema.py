"""The inventory's types: hosts, their GPUs, and the links between them (pure).

Split from ``cluster`` by responsibility: the YAML form is ``cluster.yamlform``,
hostfiles ``cluster.hostfile``, reading either from disk ``cluster.files``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from autohet_cli.catalog import GpuSpec
from autohet_cli.errors import ConfigError, UnknownNameError
from autohet_cli.gputypes import spec_of
from autohet_cli.preemption import CheckSpec
from autohet_cli.slurmconf import SlurmSettings

SCHEMA = "autohet.cluster/v1"
# Per user and private (created 0700; workers refuse directories others can write):
# never a world-writable place like /tmp, where anyone could plant a checkpoint.
DEFAULT_CHECKPOINT_DIR = "~/autohet/checkpoints"
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
    # Inter-node NICs, each at the network's speed, the GPUs sharing them evenly;
    # None: one per GPU (GPUDirect RDMA rails, as on DGX/HGX and cloud GPU hosts).
    nics: int | None = None

    @property
    def gpus_per_nic(self) -> int:
        """GPUs that share one inter-node NIC (1 with a NIC per GPU)."""
        return 1 if self.nics is None else max(1, -(-self.num_gpus // self.nics))

    def nic_share(self, tensor_parallel: int) -> int:
        """Ranks of one TP group of this degree that send through the same NIC when
        each runs its own ring to other hosts (TP rank k with TP rank k): their
        bytes add up on that NIC."""
        return min(tensor_parallel, self.gpus_per_nic)

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
