"""What a Slurm launch needs of this machine, checked before anything is written (effects).

A launch that lacks one of these used to find out late: it made the run folder,
chose the job, printed the rendezvous, checkpoint and metrics lines, and only then
failed (``sbatch is not on PATH``), or it submitted a job whose nodes could never
see its run folder and waited out the start deadline. So ``run_slurm_job`` and
``autohet launch --dry-run`` ask first, and say every problem in one error:

- Slurm's client commands the launcher runs here (``slurm.ctl``): ``sbatch`` to
  submit, ``scontrol`` and ``sinfo`` to follow the job and its nodes, ``scancel``
  to stop it;
- a run folder the nodes share with this machine: the batch script, the job key,
  the nodes' output, heartbeats and exit codes all meet there. A node-local path
  is refused: under ``/tmp``, ``/var/tmp``, ``/dev/shm`` or ``/run``, or on a
  memory file system (tmpfs, ramfs), each node has its own. Where every node of
  the plan is this machine (loopback addresses, a one-machine Slurm) every path
  is shared, and none is refused.
"""

from __future__ import annotations

import ipaddress
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath

from autohet_cli.cluster import LOCAL_ADDRESSES, Cluster
from autohet_cli.slurm.ctl import SlurmError

# What the launcher runs on this machine (slurm.ctl); srun runs on the nodes.
TOOLS = ("sbatch", "scontrol", "sinfo", "scancel")
NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run")
NODE_LOCAL_FS = frozenset({"tmpfs", "ramfs"})
MOUNTINFO = Path("/proc/self/mountinfo")


def check(cluster: Cluster, hosts: Sequence[str], runs_root: Path) -> None:
    """Raise one ``SlurmError`` naming every problem (``problems``); nothing is written."""
    found = problems(cluster, hosts, runs_root)
    if found:
        raise SlurmError("; ".join(found))


def problems(
    cluster: Cluster,
    hosts: Sequence[str],
    runs_root: Path,
    *,
    which: Callable[[str], str | None] = shutil.which,
) -> list[str]:
    """What stops a Slurm launch from ``runs_root`` on this machine, one line each."""
    out = []
    missing = [t for t in TOOLS if which(t) is None]
    if missing:
        out.append(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on PATH: "
            "a Slurm launch submits and follows its job with Slurm's client commands; run "
            "autohet on a Slurm login node (or install them, Debian: slurm-client)"
        )
    root = runs_root.resolve()
    if not all(_is_this_machine(cluster.host(h).address) for h in hosts):
        where = node_local(root, _mounts())
        if where is not None:
            out.append(
                f"run folder {root}: {where}, which is node-local (each Slurm node has "
                "its own), but the nodes and this launcher meet in the run folder (batch "
                "script, job key, the nodes' output and exit codes); run autohet launch "
                "from a directory on a file system the nodes share (your home or a project "
                "directory)"
            )
    return out


def node_local(path: Path, mounts: Sequence[tuple[str, str]]) -> str | None:
    """Why ``path`` (absolute) is on every node a different place, in words, or None.
    ``mounts``: (mount point, file system type) pairs, as in ``/proc/self/mountinfo``."""
    posix = PurePosixPath(path)
    for prefix in NODE_LOCAL_PREFIXES:
        if posix.is_relative_to(prefix):
            return f"it is under {prefix}"
    under = [(m, fs) for m, fs in mounts if posix.is_relative_to(m)]
    if under:
        point, fs = max(under, key=lambda pair: len(pair[0]))
        if fs in NODE_LOCAL_FS:
            return f"it is on a {fs} (memory) file system mounted at {point}"
    return None


def _is_this_machine(address: str) -> bool:
    if address in LOCAL_ADDRESSES:
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of this machine; none where it cannot be read."""
    try:
        text = MOUNTINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return parse_mountinfo(text)


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """``/proc/self/mountinfo``'s mount point (field 5, octal escapes undone) and file
    system type (the first field after ``-``) of each line."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = fields[4].encode().decode("unicode_escape")  # \040 is a space
        out.append((point, right.split()[0]))
    return out
