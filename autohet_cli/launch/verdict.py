"""From what the executor saw to the attempt's outcome and its record (pure, but for
``write_events``).

``launch.executor.Job`` gathers each host's evidence (its exit code, a dropped
connection, its probe, what it printed last); here that becomes a ``HostState``
for ``triage``, triage's verdict is squared with a stop request or the workers'
preemption notice, and the outcome is built and written to ``events.json``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from autohet_cli.errors import CommandFailed
from autohet_cli.launch import hostcmds, triage
from autohet_cli.launch.hostlines import Status
from autohet_cli.launch.outcome import JobOutcome
from autohet_cli.launch.specs import LaunchSpec

EVENTS_TAIL_LINES = 20


def host_state(
    spec: LaunchSpec,
    exit_code: int | None,
    dropped: str,
    probed: object,
    tail: tuple[str, ...],
) -> triage.HostState:
    """One host as triage sees it. ``dropped``: why its connection was dropped, or "";
    ``probed``: its probe, or the error asking for it raised (a refused command is
    an answer; any other error is a host that does not answer)."""
    unreachable = dropped
    if isinstance(probed, Exception) and not isinstance(probed, CommandFailed):
        unreachable = unreachable or f"does not answer: {probed}"
    got = probed if isinstance(probed, hostcmds.Probe) else hostcmds.Probe()
    return triage.HostState(
        name=spec.host,
        exit_code=exit_code,
        unreachable=unreachable,
        heartbeat_age_s=float(max(got.heartbeat_ages_s)) if got.heartbeat_ages_s else None,
        booted=got.booted >= spec.nproc_per_node,
        errors=tuple(triage.parse_records(spec.host, got.errors)),
        output_tail=tail,
    )


def with_requests(
    verdict: triage.Verdict,
    notice: triage.Preemption | None,
    hosts: Sequence[str],
    *,
    stop_asked: bool,
    by_sigterm: bool,
) -> triage.Verdict:
    """Triage's verdict, squared with a stop request (``stop_asked``; ``by_sigterm``:
    this machine's SIGTERM asked it) and the workers' preemption ``notice``."""
    if stop_asked and not (by_sigterm and notice is not None):
        return triage.stopped_on_request(verdict, notice)
    if notice is not None and stop_asked:
        # The launcher's own SIGTERM: its machine shuts down with the workers'.
        notice = dataclasses.replace(notice, hosts=tuple((h, "SIGTERM") for h in hosts))
        return triage.preempted(verdict, notice, list(hosts))
    if notice is not None:
        return triage.preempted(verdict, notice, list(hosts))
    return verdict


def outcome_of(
    verdict: triage.Verdict,
    codes: Mapping[str, int | None],
    local_run_dir: Path,
    status: Status,
) -> JobOutcome:
    cause = verdict.root_cause
    return JobOutcome(
        status=verdict.status,
        exit_code=verdict.exit_code,
        exit_codes=dict(codes),
        lost_hosts=list(verdict.lost_hosts),
        failed_hosts=list(verdict.failed_hosts),
        not_started_hosts=list(verdict.not_started_hosts),
        root_cause=asdict(cause) if cause is not None else None,
        detail=verdict.detail,
        local_run_dir=str(local_run_dir),
        last_status=status.outcome_line(),
        last_step=status.step if status.loss is not None else None,
    )


def write_events(
    outcome: JobOutcome,
    plan_file: Path,
    states: Sequence[triage.HostState],
    local_run_dir: Path,
) -> None:
    """``events.json`` in the local run directory: the outcome, when, and each host's
    state with the last lines it printed."""
    events = {
        **outcome.to_dict(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "plan": str(plan_file),
        "hosts": [
            asdict(s) | {"output_tail": list(s.output_tail[-EVENTS_TAIL_LINES:])} for s in states
        ],
    }
    (local_run_dir / "events.json").write_text(json.dumps(events, indent=2, default=str) + "\n")
