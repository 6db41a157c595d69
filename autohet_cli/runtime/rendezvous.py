"""The job as one worker reaches it: its default process group, its rendezvous store,
the token of this attempt, and whether a peer's process on this machine still runs.

Split from ``runtime.health``, which watches the job through these: they hold no
state of a run and read only torchrun's environment and the operating system, so
the worker joins the group with them (``init_process_group``, with the
``--collective-timeout``) before there is any trainer or monitor.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from autohet_cli.runtime.context import WorkerEnv

DEFAULT_TIMEOUT_S = {"cpu": 60.0, "cuda": 300.0}


def default_timeout_s(device: torch.device) -> float:
    return DEFAULT_TIMEOUT_S.get(device.type, DEFAULT_TIMEOUT_S["cuda"])


def init_process_group(device: torch.device, timeout_s: float) -> None:
    """Join the job's default group with ``timeout_s`` (before ``init_runtime``, which then
    reuses it). Without torchrun's ``MASTER_ADDR`` the runtime runs alone: nothing to do."""
    if dist.is_initialized() or "MASTER_ADDR" not in os.environ:
        return
    env = WorkerEnv.from_environ()
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def job_token() -> str:
    """Same for every worker of one job attempt; tells its beats from older runs'."""
    parts = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    return ":".join(os.environ.get(p, "") for p in parts)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust kill()
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def connect_store() -> Any:
    """A client of the job's rendezvous store of our own (the thread uses it alone)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        return TCPStore(
            addr, int(port), is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False
        )
    except Exception:
        return None
