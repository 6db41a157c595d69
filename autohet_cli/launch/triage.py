"""Why a launched job stopped, from what the launcher observed (pure).

Three different things end a job early, and each calls for a different answer:

lost host
    The host is gone: it does not answer (unreachable, connection refused or
    timed out), its SSH connection dropped, or its workers' heartbeats stand still
    although they run (a frozen host). The survivors can go on:
    ``autohet recover`` is offered, and ``--auto-recover`` acts.
failed workers
    Every host answers, but workers exited non-zero: a crash in user code, a bad
    config, a port already in use, out of memory. Recovery would only crash again
    on fewer GPUs, so none is offered; the root cause is named instead: the
    earliest error any rank recorded (``workerbase.records``), else what the failed
    hosts' output says (``logcause``: the first failed worker's message or exit;
    never "out of memory" without evidence).
preempted
    A host announced its preemption (``runtime.preempt``): every rank saved the
    step it had finished and stopped. The job goes on without that host from
    exactly that step: ``autohet recover`` is offered, ``--auto-recover`` acts.
workers that never started
    A host's workers did not mark their start within the start-up deadline: a
    hung interpreter, or a rendezvous that never completed. Nothing is offered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from autohet_cli.ckpt.steptext import after
from autohet_cli.launch import logcause

FINISHED, FAILED, HOST_LOST, NOT_STARTED, INTERRUPTED, PREEMPTED = (
    "finished",
    "failed",
    "host_lost",
    "not_started",
    "interrupted",
    "preempted",
)
RECOVERABLE = (HOST_LOST, PREEMPTED)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerError:
    """One rank's failure (from its record) or one host's (from its output)."""

    host: str
    kind: str  # error | peer_lost | stuck | output
    message: str
    rank: int | None = None
    place: str = ""
    time_unix: float | None = None
    detail: str = ""

    def headline(self) -> str:
        who = f"rank {self.rank} on {self.host}" if self.rank is not None else self.host
        if self.place:
            who += f" ({self.place})"
        return f"{who}: {self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class HostState:
    """What the launcher knows about one host when the job stopped."""

    name: str
    exit_code: int | None = None  # None: still running, or unknown
    unreachable: str = ""  # why the host does not answer; "" if it does
    heartbeat_age_s: float | None = None  # oldest running rank's; None: no heartbeat
    booted: bool = True  # every worker of the host marked its start
    errors: tuple[WorkerError, ...] = ()
    output_tail: tuple[str, ...] = ()
    # Before any worker starts: does this host's torchrun hold the rendezvous port
    # (``listening``, the master), a connection to it (``connected``), or neither
    # (``none``: it never got that far)? "" when not looked at.
    rendezvous: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    status: str
    exit_code: int
    lost_hosts: tuple[str, ...] = ()
    failed_hosts: tuple[str, ...] = ()
    not_started_hosts: tuple[str, ...] = ()
    root_cause: WorkerError | None = None
    detail: str = ""

    @property
    def recoverable(self) -> bool:
        """Only a lost (or leaving) host is healed by recovering on the others."""
        return self.status in RECOVERABLE


def parse_records(host: str, text: str) -> list[WorkerError]:
    """The JSON lines of ``RUN_DIR/errors/rank*.json`` as cat'ed from a host."""
    out = []
    for line in text.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if not isinstance(r, dict) or not isinstance(r.get("message"), str):
            continue
        rank, when = r.get("rank"), r.get("time")
        out.append(
            WorkerError(
                host=str(r.get("host") or host),
                kind=str(r.get("kind") or "error"),
                message=r["message"],
                rank=rank if isinstance(rank, int) else None,
                place=str(r.get("place") or ""),
                time_unix=float(when) if isinstance(when, int | float) else None,
                detail=str(r.get("detail") or ""),
            )
        )
    return out


def error_from_output(
    host: str, lines: Sequence[str], exit_code: int | None = None
) -> WorkerError | None:
    """The most telling error of a host's output, for failures with no record
    (``logcause``: a worker's own message, else the first failed worker's exit)."""
    found = logcause.cause_from_output(lines, exit_code)
    if found is None:
        return None
    return WorkerError(host=host, kind="output", message=found.message, rank=found.rank)


# Errors whose fix is known: (pattern in the message, what to do).
_HINTS = (
    (
        re.compile("EADDRINUSE|address already in use"),
        "another process holds that port: leave out --master-port (a free port is "
        "picked) or choose another",
    ),
    (
        logcause.OOM_TEXT,
        "the stage does not fit: re-plan with a measured profile (autohet profile "
        "run) or a smaller micro-batch",
    ),
    (
        re.compile("No module named"),
        "install it in that host's interpreter, or copy your code with --sync-dir",
    ),
)


def hint_for(message: str) -> str:
    """What to do about a known error, or "". Out of memory only on evidence: a
    message that says so, or the kernel's OOM-kill count (``runtime.oom``)."""
    return next((fix for pattern, fix in _HINTS if pattern.search(message)), "")


def root_cause(hosts: Iterable[HostState]) -> WorkerError | None:
    """The earliest own error of any rank; failing that, peers' reports or output lines.

    A rank that stopped because a peer vanished records ``peer_lost``; those are
    consequences, so they count only when no rank recorded an error of its own.
    Without records, hosts' output is read (``logcause``).
    """
    states = list(hosts)
    records = [e for h in states for e in h.errors]
    for kinds in (("error",), ("stuck", "peer_lost")):
        chosen = [e for e in records if e.kind in kinds]
        if chosen:
            return min(chosen, key=lambda e: (e.time_unix is None, e.time_unix or 0.0))
    # From the output: the most telling cause of any failed host (a host whose
    # workers torchrun stopped, or that lost their peer, yields to the one that
    # failed first), the first host in plan order among equals.
    found = [
        (c.weight, i, WorkerError(host=h.name, kind="output", message=c.message, rank=c.rank))
        for i, h in enumerate(states)
        if h.exit_code not in (None, 0)
        and (c := logcause.cause_from_output(h.output_tail, h.exit_code)) is not None
    ]
    return min(found, key=lambda f: f[:2])[2] if found else None


def triage(
    hosts: Sequence[HostState],
    *,
    stale_after_s: float,
    start_deadline_passed: bool = False,
) -> Verdict | None:
    """The verdict, or None while the job should go on running."""
    lost = [h.name for h in hosts if h.unreachable]
    lost += [
        h.name
        for h in hosts
        if not h.unreachable
        and h.exit_code is None
        and h.heartbeat_age_s is not None
        and h.heartbeat_age_s > stale_after_s
    ]
    if lost:
        why = "; ".join(
            f"{h.name}: {h.unreachable or f'heartbeats stale for {h.heartbeat_age_s:.0f} s'}"
            for h in hosts
            if h.name in lost
        )
        return Verdict(status=HOST_LOST, exit_code=1, lost_hosts=tuple(lost), detail=why)
    failed = [h.name for h in hosts if h.exit_code not in (None, 0)]
    if failed:
        cause = root_cause(hosts)
        codes = ", ".join(f"{h.name} exit {h.exit_code}" for h in hosts if h.name in failed)
        detail = f"workers failed ({codes})"
        if cause is not None:
            detail += f"; root cause: {cause.headline()}"
            if hint := hint_for(cause.message):
                detail += f" (hint: {hint})"
        first = next(h.exit_code for h in hosts if h.name in failed)
        return Verdict(
            status=FAILED,
            exit_code=int(first or 1),
            failed_hosts=tuple(failed),
            root_cause=cause,
            detail=detail,
        )
    if all(h.exit_code == 0 for h in hosts):
        return Verdict(status=FINISHED, exit_code=0)
    if start_deadline_passed:
        waiting = [h.name for h in hosts if not h.booted and h.exit_code is None]
        if len(waiting) == len(hosts):
            # Nobody started: blame the hosts whose torchrun never reached the
            # rendezvous, when that is known.
            stuck = [h.name for h in hosts if h.rendezvous == "none"]
            waiting = stuck or waiting
        if waiting:
            return Verdict(
                status=NOT_STARTED,
                exit_code=1,
                not_started_hosts=tuple(waiting),
                detail=_not_started_detail(hosts, waiting),
            )
    return None


def _not_started_detail(hosts: Sequence[HostState], waiting: Sequence[str]) -> str:
    if any(h.rendezvous for h in hosts) and len(waiting) < len(hosts):
        return (
            f"torchrun on {', '.join(waiting)} never reached the rendezvous (the other "
            "hosts wait there): a hung interpreter or wrapper, or no route to the master "
            "address and port? see their logs"
        )
    if len(waiting) < len(hosts):
        return (
            f"workers on {', '.join(waiting)} did not start (the other hosts' did): "
            "a hung interpreter, or a slow import? see their logs"
        )
    last = "; ".join(
        f"{h.name}: {h.output_tail[-1] if h.output_tail else 'no output'}" for h in hosts
    )
    return (
        "no worker started on any host: torchrun's rendezvous did not complete (can every "
        f"host reach the master address and port? a firewall?); last lines: {last}"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Preemption:
    """What the workers announced (``autohet-preempt:`` lines of rank 0)."""

    hosts: tuple[tuple[str, str], ...]  # (host, its notice), in the order announced
    step: int  # the step saved (the next step to run)
    saved: bool  # the emergency checkpoint completed

    def with_hosts(self, more: Iterable[tuple[str, str]]) -> Preemption:
        """This notice with the hosts of ``more`` it does not name yet, after its own
        (a notice that came during the save, an agent's late SIGTERM); itself if none."""
        known = {h for h, _ in self.hosts}
        new = tuple({h: w for h, w in more if h not in known}.items())
        return replace(self, hosts=self.hosts + new) if new else self


def preempted(verdict: Verdict, notice: Preemption, plan_hosts: Sequence[str]) -> Verdict:
    """The verdict of a job whose workers stopped for a preemption notice.

    Whatever else happened meanwhile (the leaving host vanished before its agent
    exited, or its torchrun exited non-zero on its own SIGTERM), the job is
    preempted: the hosts that gave notice leave, the others resume from the saved
    step. A lost host besides them leaves too. Without a saved step (checkpoints
    off, or the save failed) recovery resumes from the last periodic checkpoint.
    """
    leaving = [h for h, _ in notice.hosts if h in plan_hosts]
    leaving += [h for h in verdict.lost_hosts if h not in leaving]
    why = "; ".join(f"{h}: {w}" for h, w in notice.hosts)
    saved = (
        f"every rank saved step {notice.step} ({after(notice.step)})"
        if notice.saved
        else "no emergency checkpoint was saved (checkpoints off, or the save failed); "
        "recovery resumes from the last periodic one"
    )
    return Verdict(
        status=PREEMPTED,
        exit_code=3,
        lost_hosts=tuple(leaving),
        root_cause=verdict.root_cause if not notice.saved else None,
        detail=f"host preempting ({why}); {saved}",
    )


def stopped_on_request(verdict: Verdict, notice: Preemption | None) -> Verdict:
    """The verdict of a job the launcher's Ctrl-C/SIGTERM stopped through the workers'
    notice path: interrupted, with the step every rank saved (resumable)."""
    if notice is not None and notice.saved:
        detail = (
            f"stopped on request; every rank saved step {notice.step} ({after(notice.step)}; "
            "resume with --resume)"
        )
    elif verdict.status == FINISHED:
        detail = "stopped on request after the last step"
    else:
        detail = "stopped on request; no step was saved" + (
            f" ({verdict.detail})" if verdict.detail else ""
        )
    return Verdict(status=INTERRUPTED, exit_code=130, detail=detail)
