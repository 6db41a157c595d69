"""Host memory for snapshots: how much a process may still take (the kernel's
estimate, or less under a cgroup limit: a Slurm job's ``--mem``, a container), and
whether a snapshot fits when every rank of the host allocates its buffers at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Host memory left free beside the buffers: the kernel, the loader's workers, the
# writer threads' own buffers. A save that would eat into it runs synchronously.
RESERVE_BYTES = 2 << 30
MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"


def available_memory_bytes() -> int | None:
    """Memory this process may still take without swapping or being killed (None:
    unknown): the kernel's estimate, or less where a cgroup limits the process (a
    Slurm job's ``--mem``, a container's limit), which /proc/meminfo does not show."""
    known = [b for b in (_meminfo_available_bytes(), cgroup_available_bytes()) if b is not None]
    return min(known) if known else None


def _meminfo_available_bytes() -> int | None:
    try:
        with open(MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


NO_LIMIT_BYTES = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def cgroup_available_bytes(
    root: Path = Path(CGROUP_ROOT), self_cgroup: Path = Path(SELF_CGROUP)
) -> int | None:
    """The headroom under the tightest memory limit of this process's cgroup and its
    ancestors (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), reclaimable page
    cache counted as free; None where no limit applies or none can be read."""
    try:
        lines = self_cgroup.read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "" and (root / "cgroup.controllers").is_file():
            files = ("memory.max", "memory.current", "inactive_file")
            return _headroom(root, rel, files)
        if "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            return _headroom(root / controllers, rel, files)
    return None


def _headroom(base: Path, rel: str, files: tuple[str, str, str]) -> int | None:
    # In a container the process's own cgroup is the mount's root (its path is not there).
    d = base / rel.strip("/") if (base / rel.strip("/")).is_dir() else base
    limit_name, usage_name, inactive_key = files
    best: int | None = None
    while True:
        try:
            raw = (d / limit_name).read_text(encoding="ascii").strip()
            limit = NO_LIMIT_BYTES if raw == "max" else int(raw)
            if limit < NO_LIMIT_BYTES:
                used = int((d / usage_name).read_text(encoding="ascii"))
                stat = dict(
                    line.split() for line in (d / "memory.stat").read_text("ascii").splitlines()
                )
                free = max(0, limit - used + int(stat.get(inactive_key, 0)))
                best = free if best is None else min(best, free)
        except (OSError, ValueError):
            pass
        if d == base or base not in d.parents:
            return best
        d = d.parent


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryVerdict:
    """Whether a snapshot fits in host memory; ``reason`` says why not."""

    fits: bool
    need_bytes: int  # new buffers for every rank on this host
    available_bytes: int | None
    reason: str = ""


def memory_verdict(
    new_bytes: int,
    *,
    ranks_on_host: int,
    available_bytes: int | None,
    reserve_bytes: int = RESERVE_BYTES,
) -> MemoryVerdict:
    """Every rank of a host allocates its buffers at once (their first save), so
    each checks for all of them: ``new_bytes`` times the ranks on the host, plus a
    reserve. Unknown availability (no /proc) counts as enough."""
    need = new_bytes * max(1, ranks_on_host)
    if new_bytes == 0 or available_bytes is None or need + reserve_bytes <= available_bytes:
        return MemoryVerdict(fits=True, need_bytes=need, available_bytes=available_bytes)
    gb = 1e9
    return MemoryVerdict(
        fits=False,
        need_bytes=need,
        available_bytes=available_bytes,
        reason=(
            f"a snapshot of the training state needs {need / gb:.1f} GB of host memory "
            f"({ranks_on_host} rank(s) on this host) and {available_bytes / gb:.1f} GB is "
            f"available, {reserve_bytes / gb:.0f} GB of which stays free"
        ),
    )


def ranks_on_this_host(hosts: list[str] | None = None, me: str | None = None) -> int:
    """The ranks sharing this machine: counted from every rank's host name when
    known, else torchrun's LOCAL_WORLD_SIZE (1 outside torchrun)."""
    if hosts is not None and me is not None and me in hosts:
        return hosts.count(me)
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
