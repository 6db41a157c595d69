"""Evidence of the kernel's out-of-memory killer, as a host's agent can see it (pure).

A worker killed by SIGKILL may have been the kernel's out-of-memory killer, ``kill -9``,
a scheduler or a host's hard shutdown deadline: the signal alone does not say. The
kernel counts its kills in ``/proc/vmstat`` (``oom_kill``, every process on the host)
and in the memory cgroup of the processes (v2 ``memory.events``, v1
``memory.oom_control``), which an unprivileged process may read where ``dmesg`` is
restricted. The agent (``runtime.agent``) reads the counters before torchrun starts
the workers and again when it ends; a counter that rose is printed as one line that
``launch.triage`` takes as evidence beside a worker's SIGKILL. Without that line no
one says "memory". Pure (files only, no torch), as ``launch.triage`` is.
"""

from __future__ import annotations

from pathlib import Path

EVIDENCE_PREFIX = "[autohet agent] out-of-memory kill: "
VMSTAT = "/proc/vmstat"
CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"


def kill_counts(
    *,
    vmstat: Path = Path(VMSTAT),
    root: Path = Path(CGROUP_ROOT),
    self_cgroup: Path = Path(SELF_CGROUP),
) -> dict[str, int]:
    """Every OOM-kill counter this process can read, by where it was read."""
    # The cgroup's counter is this job's own; /proc/vmstat counts every process of the
    # host (node-wide in a container), so it is read only where the cgroup's is not.
    if (events := _cgroup_events(root, self_cgroup)) is not None:
        if (n := _field(events, "oom_kill")) is not None:
            return {f"{events} oom_kill": n}
    if (n := _field(vmstat, "oom_kill")) is not None:
        return {"/proc/vmstat oom_kill": n}
    return {}


def evidence(before: dict[str, int], after: dict[str, int]) -> str:
    """The counters that rose, ``"NAME A -> B; ..."``; "" when none did."""
    rose = [f"{k} {before[k]} -> {v}" for k, v in after.items() if k in before and v > before[k]]
    return "; ".join(rose)


def evidence_line(before: dict[str, int]) -> str:
    """The line ``launch.triage`` reads when an OOM-kill counter rose since ``before``
    (the agent prints it as torchrun ends); "" when none did."""
    said = evidence(before, kill_counts())
    return f"{EVIDENCE_PREFIX}{said}" if said else ""


def _field(path: Path, key: str) -> int | None:
    """The value of ``key`` in a file of ``key value`` lines; None if unreadable."""
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _cgroup_events(root: Path, self_cgroup: Path) -> Path | None:
    """This process's memory cgroup file that counts OOM kills (v2 or v1), if any."""
    try:
        lines = self_cgroup.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "" and (root / "cgroup.controllers").is_file():
            return _own_dir(root, rel) / "memory.events"
        if "memory" in controllers.split(","):
            return _own_dir(root / controllers, rel) / "memory.oom_control"
    return None


def _own_dir(base: Path, rel: str) -> Path:
    # In a container the process's own cgroup is the mount's root (its path is not there).
    own = base / rel.strip("/")
    return own if own.is_dir() else base
