"""Run launch specs through the transport: start, watch, judge, stop (effects).

Every host's torchrun runs in its own process group (``hostprocs``: started, signalled
and stopped by its pid, never by process name). The monitor polls every host's
process and its SSH keep-alives (``liveness``: a host that died with its kernel
closes no connection) four times a second and, every couple of seconds, its run
directory (heartbeat ages, boot marks). When something happens (a connection drops
or falls silent, workers exit, heartbeats go stale, the start-up deadline passes) it
looks at every host once more (``evidence``: does it answer, what did its ranks
record; ``hostlines``: what did it print last) and ``triage`` decides: a lost host,
failed workers with a root cause, or workers that never started. The others are
then killed (a broken job has nothing to save) and ``events.json`` in the local run
directory says what happened (``verdict``).
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from autohet_cli.errors import AutohetError, TransportError
from autohet_cli.launch import evidence, hostprocs, liveness, triage
from autohet_cli.launch.collect import MetricsCollector
from autohet_cli.launch.hostlines import HostOutput
from autohet_cli.launch.outcome import JobOutcome, LaunchError, Printer
from autohet_cli.launch.specs import LaunchSpec
from autohet_cli.launch.verdict import host_state, outcome_of, with_requests, write_events
from autohet_cli.runfiles.metricsfile import STREAM_ENV
from autohet_cli.transport.base import ProcessHandle, Runner
from autohet_cli.transport.fanout import fan_out, fan_out_background, raise_first
from autohet_cli.transport.pool import ConnectOptions, HostPool

__all__ = ["ConnectOptions", "Job", "JobOutcome", "LaunchError", "Printer"]


class Job(HostOutput):
    """One launched plan: start it, watch it, stop it. What its hosts print is read
    by the ``HostOutput`` it builds on."""

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
        super().__init__(shares)
        self.specs = list(specs)
        self.pool = pool
        self.plan_file = plan_file
        self.local_run_dir = local_run_dir
        self.printer = printer
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
        self._init_backend()

    def _init_backend(self) -> None:
        """A subclass's own state (``slurm.job.SlurmJob``): set here, so that it keeps
        this constructor as it is."""

    def runner(self, host: str) -> Runner:
        return self.pool.runner(host)

    def _spec(self, host: str) -> LaunchSpec:
        return next(s for s in self.specs if s.host == host)

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

        def prepare(name: str) -> None:
            runner = self.runner(name)
            hostprocs.prepare_host(runner, specs[name], self.plan_file, token, self.ping_every_s)

        def start(name: str) -> ProcessHandle:
            return hostprocs.start_host(self.runner(name), specs[name], self._on_line(name))

        raise_first(fan_out(hosts, lambda h: prepare(h.name)))
        self._open_logs(self.local_run_dir, [s.host for s in self.specs])
        started = fan_out(hosts, lambda h: start(h.name))
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
                stopped = triage.Verdict(
                    status=triage.INTERRUPTED, exit_code=130, detail="stopped on request"
                )
                return self._finish(stopped, codes, [])
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
        """One SIGTERM to each host's torchrun agent (``hostprocs.notify``): the
        workers' preemption notice."""
        for host, handle in self._handles.items():
            if host in self._gone or handle.pid is None or handle.poll() is not None:
                continue
            hostprocs.notify(self.runner(host), handle.pid)

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

    # ------------------------------------------------------------ judge

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
        found = triage.triage(
            states,
            stale_after_s=self.heartbeat_timeout_s,
            start_deadline_passed=deadline_passed,
        )
        if found is None:
            return None
        found = with_requests(
            found,
            self._notice(),
            [s.host for s in self.specs],
            stop_asked=self._graceful_since is not None,
            by_sigterm=self.stop_signal == signal.SIGTERM,
        )
        if found.status == triage.HOST_LOST:
            self.printer(f"lost: {found.detail}; stopping the other hosts")
        # Nothing more goes to a host that does not answer: it could only time out.
        self._gone |= {s.name for s in states if s.unreachable}
        self.stop_all(grace_s=self.broken_grace_s)
        return self._finish(found, codes, states)

    def _probe_all(
        self, codes: dict[str, int | None], dropped: dict[str, str]
    ) -> dict[str, object]:
        """Every host's probe (or its error), all at once. A host that falls silent
        meanwhile is not waited for (its probe could only time out, tens of seconds
        later), and is dropped if it was running."""

        def confirmed(name: str) -> object:
            timeout_s = self.pool.connect.connect_timeout_s + 10
            return evidence.confirmed_probe(self.runner(name), self._spec(name), timeout_s)

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
            pid = self._handles[name].pid
            if pid is None:
                return "none"
            return evidence.rendezvous(self.runner(name), self._spec(name), pid)

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
        tail = self._tail(name)
        state = host_state(spec, codes.get(name), dropped.get(name, ""), probes.get(name), tail)
        return self._second_look(state, probes)

    def _second_look(self, state: triage.HostState, probes: dict[str, object]) -> triage.HostState:
        """What a backend tells of a host beyond its own evidence, from ``probes`` (every
        host's): over SSH nothing, each host answers for itself (``slurm.job``)."""
        return state

    # ------------------------------------------------------------ stop

    def stop_all(self, skip: set[str] | None = None, grace_s: float = 10.0) -> None:
        """Stop every host's torchrun and the workers under it (``hostprocs.stop_hosts``):
        TERM, ``grace_s`` to save, then KILL; ``grace_s`` 0: KILL at once. Lost hosts
        and hosts stopped before are left alone."""
        left = {
            host: handle
            for host, handle in self._handles.items()
            if host not in self._gone and host not in self._stopped and not (skip and host in skip)
        }
        self._stopped |= hostprocs.stop_hosts(left, self.runner, grace_s)

    @property
    def started_anything(self) -> bool:
        """Whether the attempt left anything on a host, so that it is a run to record
        even when it failed (``runfolder.recorded``). Over SSH always: each host's run
        directory is made before any worker starts (the Slurm job: once submitted)."""
        return True

    def close(self) -> None:
        self._close_output()

    def _finish(
        self,
        found: triage.Verdict,
        codes: dict[str, int | None],
        states: Sequence[triage.HostState],
    ) -> JobOutcome:
        outcome = outcome_of(found, codes, self.local_run_dir, self.status)
        write_events(outcome, self.plan_file, states, self.local_run_dir)
        return outcome
