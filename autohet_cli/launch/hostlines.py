"""What the hosts print, line by line: logs, the step status, rank 0's reports and
its preemption notices (effects: this machine's files and console only).

Every line a host's torchrun prints arrives here, from SSH streams
(``launch.executor.Job``) or from files the nodes share (``slurm.job.SlurmJob``):
it goes to the host's log in the local run directory, to a short tail that
``triage`` reads for a root cause, and, unless torchrun's own failure traceback,
to the console. A few lines are records rather than text: rank 0's metrics (to
``metrics.jsonl``), its run report and start-up phases, and its preemption
notices; a torchrun agent's own line says a SIGTERM reached that host.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from autohet_cli.launch import triage
from autohet_cli.launch.collect import MetricsCollector
from autohet_cli.launch.consolefilter import Console
from autohet_cli.launch.outcome import Printer
from autohet_cli.runfiles.metricsfile import METRIC_PREFIX
from autohet_cli.workerbase.records import (
    AGENT_NOTICE,
    PREEMPT_PREFIX,
    REPORT_PREFIX,
    STARTUP_PREFIX,
)

STEP_LINE = re.compile(r"step (\d+) loss ([-+0-9.eE]+|nan|inf) tokens/s ([0-9.]+)")
OUTPUT_TAIL_LINES = 200


def parse_report(text: str) -> dict[str, object] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(slots=True, kw_only=True)
class Status:
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    shares: tuple[int, ...] = ()  # micro-batches per pipeline, from the plan

    def line(self) -> str:
        """``step 12 loss 5.5103 | 13,000 tok/s = p0 8,125 + p1 4,875``: every pipeline
        runs the same step time, so its tokens/s is its share of the batch."""
        if self.loss is None:
            return "starting"
        total = self.tokens_per_s or 0.0
        text = f"step {self.step} loss {self.loss:.4f} | {total:,.0f} tok/s"
        if len(self.shares) > 1:
            parts = [f"p{i} {total * m / sum(self.shares):,.0f}" for i, m in enumerate(self.shares)]
            text += " = " + " + ".join(parts)
        return text

    def outcome_line(self) -> str:
        """The last status for a job that ended: ``line()``, but "starting" would read
        as if the job were still starting (``finished: starting``)."""
        return self.line() if self.loss is not None else "no training step reported"


class HostOutput:
    """The part of a job that reads what its hosts print (``launch.executor.Job``
    builds on it). Lines come from the hosts' reader threads, so what they set is
    read under ``_lock``; ``printer`` is the job's, looked up as it is then (callers
    may set it after construction)."""

    printer: Printer

    def __init__(self, shares: tuple[int, ...]) -> None:
        self.status = Status(shares=shares)
        self.run_report: dict[str, object] | None = None  # rank 0's, at the end of training
        self.startup: dict[str, object] | None = None  # rank 0's start-up phases
        # The workers' preemption notice (runtime.preempt), once rank 0 announced one.
        self.preemption: triage.Preemption | None = None
        self._logs: dict[str, TextIO] = {}
        self._tails: dict[str, collections.deque[str]] = {}
        # Hosts whose torchrun agent took a SIGTERM as a preemption notice, in order.
        self._agent_notices: list[str] = []
        self._lock = threading.Lock()
        # Rank 0's metrics lines, when its host streams them (``launch.collect``).
        self._collector: MetricsCollector | None = None
        # The hosts' lines as echoed (torchrun's failure traceback left out).
        self._console = Console(lambda text: self.printer(text))

    def _open_logs(self, run_dir: Path, hosts: Iterable[str]) -> None:
        """Each host's log in the local run directory (appended to) and its tail."""
        for host in hosts:
            self._logs[host] = (run_dir / f"{host}.log").open("a", encoding="utf-8")
            self._tails[host] = collections.deque(maxlen=OUTPUT_TAIL_LINES)

    def _on_line(self, host: str) -> Callable[[str, str], None]:
        def on_line(stream: str, line: str) -> None:
            if line.startswith(METRIC_PREFIX):
                # Into the run folder's metrics.jsonl, not the log: the step's own line
                # is in the log already.
                if self._collector is not None:
                    self._collector.add(line[len(METRIC_PREFIX) :])
                return
            with self._lock:
                log = self._logs[host]
                log.write(f"{stream}: {line}\n")
                log.flush()
                if line.startswith(REPORT_PREFIX):
                    self.run_report = parse_report(line[len(REPORT_PREFIX) :])
                    return  # logged, not echoed: one long JSON line
                if line.startswith(STARTUP_PREFIX):
                    self.startup = parse_report(line[len(STARTUP_PREFIX) :])
                    return  # the human line follows on stderr
                if line.startswith(PREEMPT_PREFIX):
                    said = self._on_preempt(parse_report(line[len(PREEMPT_PREFIX) :]))
                    if said:
                        self.printer(said)
                    return
                self._tails[host].append(line)
                if AGENT_NOTICE in line and host not in self._agent_notices:
                    self._agent_notices.append(host)
                m = STEP_LINE.search(line)
                if m:
                    self.status.step = int(m.group(1))
                    self.status.loss = float(m.group(2))
                    self.status.tokens_per_s = float(m.group(3))
            self._console.echo(host, stream, line)  # logged and in the tail whole

        return on_line

    def _on_preempt(self, event: dict[str, object] | None) -> str:
        """Record rank 0's preemption line (under the lock); what to print, or ""."""
        raw = event.get("hosts") if event is not None else None
        if event is None or not isinstance(raw, dict):
            return ""
        hosts = tuple((str(h), str(w)) for h, w in raw.items())
        step = event.get("step")
        if event.get("event") == "notice" and isinstance(step, int):
            self.preemption = triage.Preemption(hosts=hosts, step=step, saved=False)
            who = "; ".join(f"{h} ({w})" for h, w in hosts)
            return f"host preempting: {who}; every rank saves step {step}, then stops"
        if event.get("event") == "saved" and self.preemption is not None:
            saved = isinstance(step, int)
            # Hosts whose notice came during the save (runtime.preempt asks again).
            self.preemption = dataclasses.replace(
                self.preemption.with_hosts(hosts),
                saved=saved,
                step=step if isinstance(step, int) else 0,
            )
            return (
                f"emergency checkpoint: step {step} saved on every rank"
                if saved
                else "emergency checkpoint: none saved (checkpoints are off)"
            )
        return ""

    def _tail(self, host: str) -> tuple[str, ...]:
        """What ``host`` printed last (``OUTPUT_TAIL_LINES``), for triage."""
        with self._lock:
            return tuple(self._tails.get(host, ()))

    def _notice(self) -> triage.Preemption | None:
        """The workers' preemption notice, if any, with the hosts whose agent took a
        SIGTERM after it."""
        with self._lock:
            notice = self.preemption
            if notice is not None:
                notice = _with_late_notices(notice, self._agent_notices)
        return notice

    def _close_output(self) -> None:
        self._console.flush()
        for log in self._logs.values():
            log.close()
        if self._collector is not None:
            self._collector.close()


def _with_late_notices(notice: triage.Preemption, agent_hosts: Sequence[str]) -> triage.Preemption:
    """The workers' notice, with the hosts whose agent took a SIGTERM after it.

    A shutdown signals every host within moments, but each on its own (slurmd signals
    each node's step separately): a host whose TERM came after the emergency save is
    still leaving, and recovery must not resume on it.
    """
    return notice.with_hosts((h, "SIGTERM") for h in agent_hosts)
