"""Slurm's own commands, run on this machine (effects): submit, ask, cancel, describe.

Only the client commands are used (``sbatch --parsable``, ``squeue``,
``scontrol show job|node``, ``sacct``, ``scancel``, ``sinfo``): they work from any
login node, talk to slurmctld for us and need no library. Each runs with a
timeout; a failure names the command and Slurm's message.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autohet_cli.errors import AutohetError

TIMEOUT_S = 30.0
# Job states after which nothing of the job runs any more (squeue/scontrol names).
TERMINAL = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)
# Of those, the ones that mean the job's nodes went away (a lost host, not a bug).
NODE_LOST = frozenset({"NODE_FAIL", "BOOT_FAIL", "PREEMPTED"})
# Node states in which a node's processes are gone or cannot be reached.
NODE_DOWN = ("DOWN", "FAIL", "NOT_RESPONDING", "POWER_DOWN", "POWERED_DOWN", "REBOOT")


class SlurmError(AutohetError):
    """A Slurm command failed or is missing; names the command and Slurm's message."""


def run(argv: Sequence[str], *, timeout_s: float = TIMEOUT_S) -> str:
    """stdout of a Slurm client command; SlurmError with its stderr if it fails."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(
            f"{argv[0]} is not on PATH: run autohet on a Slurm login node (or install "
            "Slurm's client commands, Debian: slurm-client)"
        )
    try:
        res = subprocess.run(list(argv), capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv)}: no answer in {timeout_s:.0f} s") from None
    # Bytes that are not UTF-8 (a Reason or Comment typed in Latin-1) become U+FFFD
    # instead of a UnicodeDecodeError: every field autohet uses is checked afterwards
    # (names, addresses, states), and a replaced byte fails those checks by name.
    out = res.stdout.decode("utf-8", errors="replace")
    if res.returncode != 0:
        err = res.stderr.decode("utf-8", errors="replace").strip()
        msg = err or out.strip() or f"exit code {res.returncode}"
        raise SlurmError(f"{' '.join(argv)}: {msg}")
    return out


def submit(script_path: str) -> str:
    """Submit a batch script; its job id."""
    out = run(["sbatch", "--parsable", script_path]).strip()
    job_id = out.split(";")[0]  # "<id>[;<cluster>]"
    if not job_id.isdigit():
        raise SlurmError(f"sbatch --parsable {script_path}: unexpected answer {out!r}")
    return job_id


@dataclass(frozen=True, slots=True, kw_only=True)
class JobState:
    """The job as Slurm sees it: one state per component (``"1234+0"`` ...)."""

    components: Mapping[str, str]  # component id -> state
    reasons: Mapping[str, str]  # component id -> reason (pending, failures)
    nodes: Mapping[str, str]  # component id -> node list expression

    @property
    def states(self) -> set[str]:
        return set(self.components.values())

    @property
    def pending(self) -> bool:
        return bool(self.components) and all(s == "PENDING" for s in self.states)

    @property
    def running(self) -> bool:
        return "RUNNING" in self.states

    @property
    def ended(self) -> bool:
        return bool(self.components) and self.states <= TERMINAL


def job_state(job_id: str) -> JobState | None:
    """From ``scontrol show job`` (squeue forgets ended jobs; sacct needs accounting):
    None when Slurm no longer knows the job."""
    try:
        out = run(["scontrol", "show", "job", "-o", job_id])
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            return None
        raise
    return parse_scontrol_jobs(out)


def parse_scontrol_jobs(text: str) -> JobState:
    comps: dict[str, str] = {}
    reasons: dict[str, str] = {}
    nodes: dict[str, str] = {}
    for line in text.splitlines():
        fields = parse_fields(line)
        if "JobId" not in fields:
            continue
        offset = fields.get("HetJobOffset")
        cid = f"{fields.get('HetJobId', fields['JobId'])}+{offset}" if offset else fields["JobId"]
        comps[cid] = fields.get("JobState", "UNKNOWN")
        reasons[cid] = fields.get("Reason", "None")
        nodes[cid] = fields.get("NodeList", "")
    return JobState(components=comps, reasons=reasons, nodes=nodes)


def parse_fields(line: str) -> dict[str, str]:
    """``Key=Value Key2=Value two`` of one ``scontrol -o`` line; values may hold
    spaces (``Reason=...``), so a token without ``=`` continues the previous value."""
    out: dict[str, str] = {}
    last = None
    for token in line.split(" "):
        key, eq, value = token.partition("=")
        if eq and key and key.replace("_", "").replace(":", "").isalnum():
            out[key] = value
            last = key
        elif last is not None and token:
            out[last] += " " + token
    return out


def node_states(nodes: Sequence[str]) -> dict[str, str]:
    """Each node's state (``IDLE``, ``ALLOCATED``, ``DOWN*``...), upper case."""
    if not nodes:
        return {}
    out = run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"])
    states = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1].upper()
    return states


def is_down(state: str) -> bool:
    return state.rstrip("*~#!%$@^-+").split("+")[0] in NODE_DOWN or state.endswith("*")


def cancel(job_id: str) -> None:
    run(["scancel", job_id])


def signal_steps(job_id: str, signal: str) -> None:
    """``scancel --signal`` without ``--full``/``-b``: every process of the job's steps
    on every node gets the signal (the batch shell does not, so the job stays), as
    from the time limit's ``--signal``."""
    run(["scancel", f"--signal={signal}", job_id])
