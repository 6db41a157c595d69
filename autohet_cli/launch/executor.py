"""Run launch specs through the transport: start, watch, judge, stop (effects).

Every host's torchrun runs in its own process group; its pid goes to a pid file
on the host, and stopping is always by that pid, never by process name. The
monitor polls every host's process and its SSH keep-alives (``liveness``: a host
that died with its kernel closes no connection) four times a second and, every
couple of seconds, its run directory (heartbeat ages, boot marks). When something
happens (a connection drops or falls silent, workers exit, heartbeats go stale,
the start-up deadline passes) it looks at every host once more (does it answer,
what did its ranks record, what did it print last) and ``triage`` decides: a lost
host, failed workers with a root cause, or workers that never started. The others
are then killed (a broken job has nothing to save) and ``events.json`` in the
local run directory says what happened.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from autohet_cli.errors import AutohetError, CommandFailed, TransportError
from autohet_cli.launch import hostcmds, liveness, triage
from autohet_cli.launch.collect import MetricsCollector
from autohet_cli.launch.consolefilter import Console
from autohet_cli.launch.specs import LaunchSpec
from autohet_cli.runfiles.metricsfile import METRIC_PREFIX, STREAM_ENV
from autohet_cli.runtime.records import (
    LAUNCH_TIME_ENV,
    PREEMPT_PREFIX,
    REPORT_PREFIX,
    STARTUP_PREFIX,
)
from autohet_cli.transport.base import ProcessHandle, Runner
from autohet_cli.transport.fanout import fan_out, fan_out_background, raise_first
from autohet_cli.transport.pool import ConnectOptions, HostPool

__all__ = ["ConnectOptions", "Job", "JobOutcome", "LaunchError"]


def _parse_report(text: str) -> dict[str, object] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


STEP_LINE = re.compile(r"step (\d+) loss ([-+0-9.eE]+|nan|inf) tokens/s ([0-9.]+)")
Printer = Callable[[str], None]
OUTPUT_TAIL_LINES = 200


class LaunchError(AutohetError):
    """The job could not be started as asked (names the host and what to do)."""


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


@dataclass(slots=True, kw_only=True)
class JobOutcome:
    status: str  # finished | failed | host_lost | not_started | interrupted
    exit_code: int
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    lost_hosts: list[str] = field(default_factory=list)
    failed_hosts: list[str] = field(default_factory=list)
    not_started_hosts: list[str] = field(default_factory=list)
    root_cause: dict[str, object] | None = None
    detail: str = ""
    local_run_dir: str = ""
    last_status: str = ""
    last_step: int | None = None

    @property
    def recoverable(self) -> bool:
        return self.status in triage.RECOVERABLE

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class Job:
    """One launched plan: start it, watch it, stop it."""

    def __init__(
        self,
        specs: Sequence[LaunchSpec],
        pool: HostPool,
        plan_file: Path,
        local_run_dir: Path,
        *,
        printer: Printer = print,
        shares: tuple[int, ...] = (),
        start_timeout_s: float | None = 300.0,
    ) -> None:
        self.specs = list(specs)
        self.pool = pool
        self.plan_file = plan_file
        self.local_run_dir = local_run_dir
        self.printer = printer
        self.status = Status(shares=shares)
        self.run_report: dict[str, object] | None = None  # rank 0's, at the end of training
        self.status_every_s = 10.0
        # None: no start-up deadline (user scripts write no boot marks).
        self.start_timeout_s = start_timeout_s
        # Ctrl-C/SIGTERM once: a notice, every rank saves its step and exits (the
        # workers' own preemption path); twice (or the wait running out): stop at once.
        self.stop_requested = threading.Event()
        self.kill_requested = threading.Event()
        self.graceful_stop_s = 600.0
        self._graceful_since: float | None = None
        self.stop_signal: int | None = None  # what asked for the stop (session sets it)
        self._handles: dict[str, ProcessHandle] = {}
        self._logs: dict[str, TextIO] = {}
        self._tails: dict[str, collections.deque[str]] = {}
        self._lock = threading.Lock()
        # Workers beat every ~2 s; 20 s of silence plus a 2 s check stays within
        # the 30 s in which a lost host must be noticed.
        self.heartbeat_timeout_s = 20.0
        self.heartbeat_check_s = 2.0
        self.poll_s = 0.25  # processes and keep-alives
        self.ping_every_s = liveness.PING_EVERY_S
        self.silent_after_s = liveness.SILENT_AFTER_S
        self._watcher = liveness.Watcher()
        self.settle_s = 3.0  # after a first failure, let the other hosts finish failing
        # TERM to KILL when stopping after a verdict. 0: KILL at once; a broken job has
        # nothing to save (the workers' SIGTERM handling would only wait for a step
        # that cannot end).
        self.broken_grace_s = 0.0
        self._gone: set[str] = set()  # lost hosts: nothing more is sent there
        self._stopped: set[str] = set()  # hosts stopped already (after a verdict)
        self._drained: set[str] = set()  # ended hosts whose output was read to its end
        self._started_at = 0.0
        # The workers' preemption notice (runtime.preempt), once rank 0 announced one.
        self.preemption: triage.Preemption | None = None
        self.startup: dict[str, object] | None = None  # rank 0's start-up phases
        # Rank 0's metrics lines, when its host streams them (``launch.collect``).
        self._collector: MetricsCollector | None = None
        # The hosts' lines as echoed (torchrun's failure traceback left out): through
        # ``self.printer`` as it is then (callers may set it after construction).
        self._console = Console(lambda text: self.printer(text))

    def runner(self, host: str) -> Runner:
        return self.pool.runner(host)

    # ------------------------------------------------------------ start

    def start(self) -> None:
        """Make each host's run directory (never reusing one) and copy the plan there,
        then start every host's torchrun: each step on every host at once, so a start
        takes one host's round trips, not their sum."""
        self.local_run_dir.mkdir(parents=True, exist_ok=True)
        if self.specs[0].env.get(STREAM_ENV):
            self._collector = MetricsCollector(self.local_run_dir)
        token = uuid.uuid4().hex
        hosts = [self.pool.host(s.host) for s in self.specs]
        specs = {s.host: s for s in self.specs}
        raise_first(fan_out(hosts, lambda h: self._prepare_host(specs[h.name], token)))
        for spec in self.specs:
            self._logs[spec.host] = (self.local_run_dir / f"{spec.host}.log").open(
                "a", encoding="utf-8"
            )
            self._tails[spec.host] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
        started = fan_out(hosts, lambda h: self._start_host(specs[h.name]))
        for spec in self.specs:  # in plan order; the started ones are stopped on failure
            if isinstance(handle := started[spec.host], ProcessHandle):
                self._handles[spec.host] = handle
        raise_first(started)
        for spec in self.specs:
            self.printer(
                f"{spec.host}: started {spec.nproc_per_node} worker(s), "
                f"pid {self._handles[spec.host].pid}, "
                f"log {self.local_run_dir / (spec.host + '.log')}"
            )
        self._started_at = time.monotonic()

    def _prepare_host(self, spec: LaunchSpec, token: str) -> None:
        runner = self.runner(spec.host)
        res = runner.run(
            ["sh", "-c", hostcmds.MKRUN, "sh"]
            + [spec.workdir, str(Path(spec.run_dir).parent), spec.run_dir, token],
            timeout_s=60,
        )
        if res.exit_code != 0:
            raise LaunchError(
                f"{spec.host}: cannot create the run directory {spec.run_dir}: "
                f"{res.stderr.strip() or 'exists'}; a run directory is never reused "
                "(its old heartbeats would be judged): pick another --run-id"
            )
        runner.put(self.plan_file, spec.plan_path)
        runner.start_pings(self.ping_every_s)  # answered from now on: see liveness

    def _start_host(self, spec: LaunchSpec) -> ProcessHandle:
        # The workers measure their start-up from this moment (runtime.startup).
        env = {**spec.env, LAUNCH_TIME_ENV: f"{time.time():.3f}"}
        handle = self.runner(spec.host).start(
            spec.argv,
            env=env,
            cwd=spec.workdir,
            on_line=self._on_line(spec.host),
            pid_file=spec.pid_file,  # before torchrun runs: recover sees it at once
        )
        deadline = time.monotonic() + 15  # the SSH pid line arrives asynchronously
        while handle.pid is None and handle.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return handle

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
                    self.run_report = _parse_report(line[len(REPORT_PREFIX) :])
                    return  # logged, not echoed: one long JSON line
                if line.startswith(STARTUP_PREFIX):
                    self.startup = _parse_report(line[len(STARTUP_PREFIX) :])
                    return  # the human line follows on stderr
                if line.startswith(PREEMPT_PREFIX):
                    said = self._on_preempt(_parse_report(line[len(PREEMPT_PREFIX) :]))
                    if said:
                        self.printer(said)
                    return
                self._tails[host].append(line)
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
            known = dict(self.preemption.hosts)
            more = tuple((h, w) for h, w in hosts if h not in known)
            self.preemption = dataclasses.replace(
                self.preemption,
                saved=saved,
                step=step if isinstance(step, int) else 0,
                hosts=self.preemption.hosts + more,
            )
            return (
                f"emergency checkpoint: step {step} saved on every rank"
                if saved
                else "emergency checkpoint: none saved (checkpoints are off)"
            )
        return ""

    # ------------------------------------------------------------ watch

    def watch(self, poll_s: float | None = None) -> JobOutcome:
        """Block until every host finished, something went wrong, or stop was asked."""
        poll_s = self.poll_s if poll_s is None else poll_s
        codes: dict[str, int | None] = dict.fromkeys(self._handles)
        dropped: dict[str, str] = {}
        last_status = last_check = time.monotonic()
        while True:
            if self.stop_requested.is_set() and self._stop_now():
                self.stop_all(grace_s=1.0 if self.kill_requested.is_set() else 10.0)
                verdict = triage.Verdict(
                    status=triage.INTERRUPTED, exit_code=130, detail="stopped on request"
                )
                return self._finish(verdict, codes, [])
            self._poll(codes, dropped)
            failed = bool(dropped) or any(c not in (None, 0) for c in codes.values())
            if failed and not dropped:
                # Let the other hosts finish failing, so the root cause is judged on
                # every host's exit; a dropped connection needs no such wait (a lost
                # host is the verdict whatever the others do, and they are stopped).
                self._settle(codes, dropped)
            ended = failed or None not in codes.values()
            now = time.monotonic()
            if ended or now - last_check >= self.heartbeat_check_s:
                last_check = now
                outcome = self._judge(codes, dropped, force=ended)
                if outcome is not None:
                    return outcome
            if now - last_status >= self.status_every_s:
                last_status = now
                self.printer(f"status: {self.status.line()}")
            time.sleep(poll_s)

    def _stop_now(self) -> bool:
        """After a stop request: True to stop at once (a second request, or the save
        did not end in ``graceful_stop_s``); the first request sends the notice."""
        if self.kill_requested.is_set():
            return True
        now = time.monotonic()
        if self._graceful_since is None:
            self._graceful_since = now
            self.printer(
                "stopping: every rank saves the step it is on, then exits (Ctrl-C again "
                "stops at once, unsaved)"
            )
            self.notify_all()
            return False
        if now - self._graceful_since > self.graceful_stop_s:
            self.printer(
                f"the workers did not stop within {self.graceful_stop_s:g} s of the request: "
                "stopping them"
            )
            return True
        return False

    def notify_all(self) -> None:
        """One SIGTERM to each host's torchrun agent (its process group): the workers'
        preemption notice (``runtime.agent`` forwards it, ``runtime.preempt`` saves)."""
        for host, handle in self._handles.items():
            if host in self._gone or handle.pid is None or handle.poll() is not None:
                continue
            try:
                self.runner(host).run(
                    ["sh", "-c", 'kill -TERM -- "-$1" 2>/dev/null || kill -TERM "$1"', "sh"]
                    + [str(handle.pid)],
                    timeout_s=20,
                )
            except AutohetError:
                pass  # unreachable: the watch judges it

    def _poll(self, codes: dict[str, int | None], dropped: dict[str, str]) -> None:
        """Each running host's exit code; a host whose connection closed or fell
        silent is dropped, with the reason."""
        for host, handle in self._handles.items():
            if codes[host] is not None or host in dropped:
                continue
            try:
                codes[host] = handle.poll()
            except TransportError as exc:
                dropped[host] = f"connection lost: {exc}"
        self._listen(codes, dropped)

    def _listen(self, codes: dict[str, int | None], dropped: dict[str, str]) -> set[str]:
        """Drop the running hosts that left keep-alives unanswered too long
        (``liveness.silent_hosts``); every silent host, ended ones too."""
        pings = {h: self.runner(h).liveness() for h in self._handles if h not in dropped}
        now = time.monotonic()
        silent = self._watcher.silent(
            pings, now_s=now, after_s=self.silent_after_s, alone_after_s=self.heartbeat_timeout_s
        )
        for host, quiet_s in silent.items():
            if codes.get(host) is None:
                dropped[host] = liveness.silence_reason(quiet_s)
        return set(silent)

    def _settle(self, codes: dict[str, int | None], dropped: dict[str, str]) -> None:
        deadline = time.monotonic() + self.settle_s
        while time.monotonic() < deadline:
            self._poll(codes, dropped)
            if all(c is not None or h in dropped for h, c in codes.items()):
                return
            time.sleep(0.2)

    def _judge(
        self, codes: dict[str, int | None], dropped: dict[str, str], *, force: bool
    ) -> JobOutcome | None:
        """Look at every host, decide; stop everything and finish if there is a verdict.
        ``force``: some host ended (or every one did), so a verdict is due now."""
        probes = self._probe_all(codes, dropped)
        self._drain_ended(codes, dropped)
        force = force or bool(dropped)  # a host fell silent while the others were probed
        deadline_passed = (
            self.start_timeout_s is not None
            and time.monotonic() - self._started_at > self.start_timeout_s
        )
        states = [self._state(spec, codes, dropped, probes) for spec in self.specs]
        if deadline_passed and not any(st.booted for st in states):
            states = self._with_rendezvous(states)
        stale = [
            s
            for s in states
            if s.exit_code is None
            and s.heartbeat_age_s is not None
            and s.heartbeat_age_s > self.heartbeat_timeout_s
        ]
        if not force and not stale and not deadline_passed:
            return None
        verdict = triage.triage(
            states,
            stale_after_s=self.heartbeat_timeout_s,
            start_deadline_passed=deadline_passed,
        )
        if verdict is None:
            return None
        with self._lock:
            notice = self.preemption
        if self._graceful_since is not None and not (
            self.stop_signal == signal.SIGTERM and notice is not None
        ):
            verdict = triage.stopped_on_request(verdict, notice)
        elif notice is not None and self._graceful_since is not None:
            # The launcher's own SIGTERM: its machine shuts down with the workers'.
            hosts = tuple((s.host, "SIGTERM") for s in self.specs)
            notice = dataclasses.replace(notice, hosts=hosts)
            verdict = triage.preempted(verdict, notice, [s.host for s in self.specs])
        elif notice is not None:
            verdict = triage.preempted(verdict, notice, [s.host for s in self.specs])
        if verdict.status == triage.HOST_LOST:
            self.printer(f"lost: {verdict.detail}; stopping the other hosts")
        # Nothing more goes to a host that does not answer: it could only time out.
        self._gone |= {s.name for s in states if s.unreachable}
        self.stop_all(grace_s=self.broken_grace_s)
        return self._finish(verdict, codes, states)

    def _probe_all(
        self, codes: dict[str, int | None], dropped: dict[str, str]
    ) -> dict[str, object]:
        """Every host's probe (or its error), all at once. A host that falls silent
        meanwhile is not waited for (its probe could only time out, tens of seconds
        later), and is dropped if it was running."""

        def probe(name: str) -> hostcmds.Probe:
            spec = next(s for s in self.specs if s.host == name)
            ranks = " ".join(str(r) for r in spec.ranks)
            res = self.runner(name).run(
                ["sh", "-c", hostcmds.PROBE, "sh", spec.run_dir, ranks],
                timeout_s=self.pool.connect.connect_timeout_s + 10,
            )
            return hostcmds.parse_probe(res.stdout)

        def confirmed(name: str) -> hostcmds.Probe:
            """One slow or failed probe is not a lost host: ask once more, simply."""
            try:
                return probe(name)
            except AutohetError:
                self.runner(name).run(
                    ["true"], timeout_s=self.pool.connect.connect_timeout_s + 10
                ).check()
                return hostcmds.Probe()

        names = [s.host for s in self.specs if s.host not in dropped]
        results = fan_out_background(names, confirmed, what="probe")
        while True:
            silent = self._listen(codes, dropped)
            waiting = [n for n in names if n not in dropped and n not in silent]
            if not results.wait(waiting, self.poll_s):
                break
        return {n: v for n, v in results.items() if n not in dropped}

    def _drain_ended(self, codes: dict[str, int | None], dropped: dict[str, str]) -> None:
        """Read what an ended host printed last before judging it: its exit code can
        be seen while its last lines (the error) are still in the pipe."""
        for host, code in codes.items():
            if code is None or host in dropped or host in self._drained:
                continue
            self._drained.add(host)
            try:
                self._handles[host].wait(0)  # ended: returns at once, after its output
            except AutohetError:
                pass  # a connection lost meanwhile: the next look judges it

    def _with_rendezvous(self, states: list[triage.HostState]) -> list[triage.HostState]:
        """Nobody started: which hosts' torchrun reached the rendezvous at all?"""

        def look(name: str) -> str:
            spec = next(s for s in self.specs if s.host == name)
            pid = self._handles[name].pid
            if pid is None:
                return "none"
            port = spec.argv[list(spec.argv).index("--master-port") + 1]
            res = self.runner(name).run(
                ["sh", "-c", hostcmds.RENDEZVOUS, "sh", str(pid), port], timeout_s=30
            )
            words = res.stdout.split()
            if "done" not in words:
                return ""
            return next((w for w in ("listening", "connected") if w in words), "none")

        hosts = [self.pool.host(st.name) for st in states if not st.unreachable]
        found = fan_out(hosts, lambda h: look(h.name))
        return [
            dataclasses.replace(st, rendezvous=r)
            if isinstance(r := found.get(st.name), str)
            else st
            for st in states
        ]

    def _state(
        self,
        spec: LaunchSpec,
        codes: dict[str, int | None],
        dropped: dict[str, str],
        probes: dict[str, object],
    ) -> triage.HostState:
        name = spec.host
        got = probes.get(name)
        unreachable = dropped.get(name, "")
        if isinstance(got, Exception) and not isinstance(got, CommandFailed):
            unreachable = unreachable or f"does not answer: {got}"
        if not isinstance(got, hostcmds.Probe):
            got = hostcmds.Probe()
        with self._lock:
            tail = tuple(self._tails.get(name, ()))
        return triage.HostState(
            name=name,
            exit_code=codes.get(name),
            unreachable=unreachable,
            heartbeat_age_s=float(max(got.heartbeat_ages_s)) if got.heartbeat_ages_s else None,
            booted=got.booted >= spec.nproc_per_node,
            errors=tuple(triage.parse_records(name, got.errors)),
            output_tail=tail,
        )

    # ------------------------------------------------------------ stop

    def stop_all(self, skip: set[str] | None = None, grace_s: float = 10.0) -> None:
        """Stop every host's torchrun and the workers under it (``hostcmds.stop_tree``):
        TERM, ``grace_s`` to save, then KILL; ``grace_s`` 0: KILL at once. Lost hosts
        and hosts stopped before are left alone."""
        threads = []
        for host, handle in self._handles.items():
            if host in self._gone or host in self._stopped or (skip and host in skip):
                continue
            t = threading.Thread(
                target=hostcmds.stop_tree,
                args=(self.runner(host), handle, grace_s),
                name=f"{host}-stop",
                daemon=True,
            )
            t.start()
            threads.append((host, t))
        for host, t in threads:
            t.join(grace_s + 20)
            if not t.is_alive():
                self._stopped.add(host)

    @property
    def started_anything(self) -> bool:
        """Whether the attempt left anything on a host, so that it is a run to record
        even when it failed (``runfolder.recorded``). Over SSH always: each host's run
        directory is made before any worker starts (the Slurm job: once submitted)."""
        return True

    def close(self) -> None:
        self._console.flush()
        for log in self._logs.values():
            log.close()
        if self._collector is not None:
            self._collector.close()

    def _finish(
        self,
        verdict: triage.Verdict,
        codes: dict[str, int | None],
        states: Sequence[triage.HostState],
    ) -> JobOutcome:
        cause = verdict.root_cause
        outcome = JobOutcome(
            status=verdict.status,
            exit_code=verdict.exit_code,
            exit_codes=dict(codes),
            lost_hosts=list(verdict.lost_hosts),
            failed_hosts=list(verdict.failed_hosts),
            not_started_hosts=list(verdict.not_started_hosts),
            root_cause=asdict(cause) if cause is not None else None,
            detail=verdict.detail,
            local_run_dir=str(self.local_run_dir),
            last_status=self.status.outcome_line(),
            last_step=self.status.step if self.status.loss is not None else None,
        )
        events = {
            **outcome.to_dict(),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "plan": str(self.plan_file),
            "hosts": [asdict(s) | {"output_tail": list(s.output_tail[-20:])} for s in states],
        }
        (self.local_run_dir / "events.json").write_text(
            json.dumps(events, indent=2, default=str) + "\n"
        )
        return outcome
