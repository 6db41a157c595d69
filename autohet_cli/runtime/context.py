"""Start-up of one worker: environment, device, process groups.

Reads torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (``MASTER_ADDR``/
``MASTER_PORT`` are read by ``init_process_group``); with none of them set the
worker runs alone, which is how a one-device plan is the single-process
reference. ``AUTOHET_HOST`` (optional) names the plan host this worker runs on;
see ``topology`` for how that changes the rank mapping.

Process groups (every rank creates every group, in one order, as ``new_group``
requires): one TP group per stage with ``tensor_parallel > 1`` (wrapped in a 1-D
``DeviceMesh`` for DTensor), and one group per distinct set of ranks that
all-reduce some gradients (``Topology.sync_groups``). Pipeline neighbours talk
point-to-point on the default group, so they need none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from autohet_cli.plan import Plan
from autohet_cli.runtime.topology import RankInfo, SyncGroup, Topology

HOST_ENV = "AUTOHET_HOST"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int
    host: str | None

    @classmethod
    def from_environ(cls) -> WorkerEnv:
        def num(name: str, default: int) -> int:
            raw = os.environ.get(name)
            if raw is None:
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None

        return cls(
            rank=num("RANK", 0),
            world_size=num("WORLD_SIZE", 1),
            local_rank=num("LOCAL_RANK", 0),
            host=os.environ.get(HOST_ENV) or None,
        )


@dataclass(slots=True, kw_only=True)
class Runtime:
    """One worker's view of the job: who it is and how it talks to the others."""

    topology: Topology
    info: RankInfo  # this worker's logical rank and its place in the plan
    device: torch.device
    to_global: tuple[int, ...]  # logical rank -> torch.distributed rank
    tp_group: ProcessGroup | None = None
    tp_mesh: DeviceMesh | None = None
    # A weight-sharded stage's holders group (FSDP's data-parallel mesh); for a TP
    # stage, the "dp" dimension of the (holders x TP) mesh whose "tp" is tp_mesh
    shard_mesh: DeviceMesh | None = None
    sync_groups: list[tuple[SyncGroup, ProcessGroup | None]] = field(default_factory=list)
    _groups: dict[tuple[int, ...], ProcessGroup] = field(default_factory=dict)

    @property
    def plan(self) -> Plan:
        return self.topology.plan

    @property
    def global_rank(self) -> int:
        return self.to_global[self.info.rank]

    def peer(self, logical: int | None) -> int | None:
        return None if logical is None else self.to_global[logical]

    def group(self, logical: tuple[int, ...]) -> ProcessGroup | None:
        """The process group of these logical ranks (None for one rank).

        ``new_group`` is collective over the world: every rank must ask for every
        group, members or not, in the same order.
        """
        if len(logical) < 2:
            return None
        if logical not in self._groups:
            self._groups[logical] = dist.new_group([self.to_global[r] for r in logical])
        return self._groups[logical]

    def build_sync_groups(self, tied: list[tuple[str, tuple[int, ...]]]) -> None:
        """Create every gradient-sync group; keep the ones this rank is in.

        ``tied``: (first full name, layer indices) of each tied parameter.
        """
        me = self.info.rank
        for sync in self.topology.sync_groups(tied):
            pg = self.group(sync.ranks)
            if me in sync.members:  # a full-gradient sync's member reduces only via rank 0
                self.sync_groups.append((sync, pg if me in sync.ranks else None))


def pick_device(choice: str, env: WorkerEnv) -> torch.device:
    """``auto``: CUDA when available, else CPU; the GPU is ``cuda:LOCAL_RANK``.

    Started one agent per host (``AUTOHET_HOST``), the launcher sets
    ``CUDA_VISIBLE_DEVICES`` to that host's plan GPUs in plan order, so the
    ``LOCAL_RANK``-th visible GPU is this worker's plan GPU there too.
    """
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device {choice!r}: expected auto, cpu or cuda")
    use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device("cuda", env.local_rank)


def init_runtime(plan: Plan, *, device: str = "auto") -> Runtime:
    """Join the job, find this worker's place in ``plan``, build the TP groups.

    The gradient-sync groups come once the model is known: ``build_sync_groups``.
    """
    env = WorkerEnv.from_environ()
    topo = Topology(plan)
    if env.world_size != topo.world_size:
        raise ValueError(
            f"plan {plan.name!r} has {topo.world_size} devices but WORLD_SIZE is "
            f"{env.world_size}: start one worker per plan device"
        )
    logical = topo.slot_for_host(env.host, env.local_rank) if env.host else env.rank
    dev = pick_device(device, env)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=env.rank, world_size=env.world_size)
        else:  # alone, without torchrun
            dist.init_process_group(backend, store=HashStore(), rank=0, world_size=1)
    runtime = Runtime(
        topology=topo,
        info=topo.ranks[logical],
        device=dev,
        to_global=_exchange_ranks(topo, logical, env),
    )
    for ranks in topo.tp_groups():
        pg = runtime.group(ranks)
        if logical in ranks and pg is not None:
            runtime.tp_group = pg
            runtime.tp_mesh = DeviceMesh.from_group(pg, dev.type)
    _sharded_tp_meshes(runtime)
    return runtime


def _sharded_tp_meshes(runtime: Runtime) -> None:
    """For a weight-sharded stage with TP > 1 (``shard: weights``, issue 48): one 2-D
    mesh, holders x TP, whose "tp" dimension replaces ``tp_mesh`` and whose "dp"
    dimension is FSDP's (``runtime.fsdp_stage``). FSDP2 shards a TP DTensor further
    only over a mesh of the same parent as its TP mesh, so the two cannot be built
    apart. Built from groups (``DeviceMesh.from_group``: nothing collective beyond
    the groups themselves), the holders' groups created here by every rank in plan
    order (``group``: collective), which ``build_sync_groups`` then finds made."""
    topo, info = runtime.topology, runtime.info
    columns = sorted(
        {
            (s.layer_start, s.layer_end, s.tensor_parallel)
            for p in runtime.plan.pipelines
            for s in p.stages
            if s.shard == "weights" and s.tensor_parallel > 1
        }
    )
    for start, end, tp in columns:
        holders = [topo.holders(range(start, end), k) for k in range(tp)]  # per TP rank
        groups = [runtime.group(h) for h in holders]
        mine = (info.layer_start, info.layer_end, info.tp_size) == (start, end, tp)
        if not mine or runtime.tp_group is None:
            continue
        dp_group = groups[info.tp_rank]
        assert dp_group is not None, holders  # validation: at least two holders
        grid = torch.tensor(
            [[runtime.to_global[h[i]] for h in holders] for i in range(len(holders[0]))]
        )
        mesh = DeviceMesh.from_group(
            [dp_group, runtime.tp_group],
            runtime.device.type,
            mesh=grid,
            mesh_dim_names=("dp", "tp"),
        )
        runtime.tp_mesh, runtime.shard_mesh = mesh["tp"], mesh["dp"]


def _exchange_ranks(topo: Topology, logical: int, env: WorkerEnv) -> tuple[int, ...]:
    if not env.host:
        return tuple(range(topo.world_size))
    gathered: list[int | None] = [None] * env.world_size
    dist.all_gather_object(gathered, logical)
    if sorted(g for g in gathered if g is not None) != list(range(topo.world_size)):
        raise ValueError(f"workers claim logical ranks {gathered}: two share a plan device")
    to_global = [0] * topo.world_size
    for global_rank, slot in enumerate(gathered):
        assert slot is not None
        to_global[slot] = global_rank
    return tuple(to_global)
