"""Run launch specs through the transport: copy the plan, start, watch, stop (effects).

Every host's torchrun runs in its own process group; its pid goes to a pid file
on the host, and stopping is always by that pid (TERM, wait, KILL), never by
process name. The monitor polls every host: a worker group that exits with an
error, or an SSH connection that drops, ends the job: the survivors are stopped,
``events.json`` in the local run directory says what happened, and the exact
``autohet recover`` command is returned to print.
"""

from __future__ import annotations

import json
import re
import shlex
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from autohet_cli.cluster import Cluster
from autohet_cli.errors import AutohetError, TransportError
from autohet_cli.launch.specs import LaunchSpec
from autohet_cli.launch.sync import sync_dir
from autohet_cli.plan import Plan
from autohet_cli.profiling.run import remote_home
from autohet_cli.transport.base import ProcessHandle, Runner
from autohet_cli.transport.fanout import runner_for

STEP_LINE = re.compile(r"step (\d+) loss ([-+0-9.eE]+|nan|inf) tokens/s ([0-9.]+)")
Printer = Callable[[str], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectOptions:
    known_hosts: Path | None = None
    accept_new_host_keys: bool = False
    connect_timeout_s: float = 10.0


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


@dataclass(slots=True, kw_only=True)
class JobOutcome:
    status: str  # finished | failed | host_lost | interrupted
    exit_code: int
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    lost_hosts: list[str] = field(default_factory=list)
    failed_hosts: list[str] = field(default_factory=list)
    detail: str = ""
    local_run_dir: str = ""
    last_status: str = ""


class Job:
    """One launched plan: start it, watch it, stop it."""

    def __init__(
        self,
        specs: Sequence[LaunchSpec],
        cluster: Cluster,
        plan_file: Path,
        local_run_dir: Path,
        *,
        connect: ConnectOptions,
        printer: Printer = print,
        shares: tuple[int, ...] = (),
        sync_source: Path | None = None,
    ) -> None:
        self.sync_source = sync_source
        self.specs = list(specs)
        self.cluster = cluster
        self.plan_file = plan_file
        self.local_run_dir = local_run_dir
        self.connect = connect
        self.printer = printer
        self.status = Status(shares=shares)
        self.status_every_s = 10.0
        self._last_status = time.monotonic()
        self.stop_requested = threading.Event()
        self._runners: dict[str, Runner] = {}
        self._handles: dict[str, ProcessHandle] = {}
        self._logs: dict[str, object] = {}
        self._lock = threading.Lock()
        # Workers beat every ~2 s; 20 s of silence plus a 2 s check stays within
        # the 30 s in which a lost host must be noticed.
        self.heartbeat_timeout_s = 20.0
        self.heartbeat_check_s = 2.0
        self._last_heartbeat_check = time.monotonic()

    # ------------------------------------------------------------ start

    def start(self) -> None:
        self.local_run_dir.mkdir(parents=True, exist_ok=True)
        for spec in self.specs:
            host = self.cluster.host(spec.host)
            runner = runner_for(
                host,
                known_hosts=self.connect.known_hosts,
                accept_new_host_keys=self.connect.accept_new_host_keys,
                connect_timeout_s=self.connect.connect_timeout_s,
            )
            self._runners[spec.host] = runner
            runner.run(["mkdir", "-p", spec.run_dir, spec.workdir], timeout_s=60).check()
            runner.put(self.plan_file, spec.plan_path)
            if self.sync_source is not None:
                sent = sync_dir(runner, self.sync_source, spec.workdir)
                self.printer(
                    f"{spec.host}: synced {len(sent)} changed file(s) of "
                    f"{self.sync_source} into {spec.workdir}"
                )
        for spec in self.specs:
            log = (self.local_run_dir / f"{spec.host}.log").open("a", encoding="utf-8")
            self._logs[spec.host] = log
            handle = self._runners[spec.host].start(
                spec.argv, env=spec.env, cwd=spec.workdir, on_line=self._on_line(spec.host)
            )
            self._handles[spec.host] = handle
            deadline = time.monotonic() + 15  # the SSH pid line arrives asynchronously
            while handle.pid is None and handle.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if handle.pid is not None:
                self._runners[spec.host].run(
                    [
                        "sh",
                        "-c",
                        'printf "%s\\n" "$1" > "$2"',
                        "sh",
                        str(handle.pid),
                        spec.pid_file,
                    ],
                    timeout_s=30,
                )
            self.printer(
                f"{spec.host}: started {spec.nproc_per_node} worker(s), "
                f"pid {handle.pid}, log {self.local_run_dir / (spec.host + '.log')}"
            )

    def _on_line(self, host: str) -> Callable[[str, str], None]:
        def on_line(stream: str, line: str) -> None:
            with self._lock:
                log = self._logs[host]
                log.write(f"{stream}: {line}\n")  # type: ignore[attr-defined]
                log.flush()  # type: ignore[attr-defined]
                m = STEP_LINE.search(line)
                if m:
                    self.status.step = int(m.group(1))
                    self.status.loss = float(m.group(2))
                    self.status.tokens_per_s = float(m.group(3))
            self.printer(f"[{host}] {line}")

        return on_line

    # ------------------------------------------------------------ watch

    def watch(self, poll_s: float = 0.5) -> JobOutcome:
        """Block until every host finished, one failed or vanished, or stop was asked."""
        codes: dict[str, int | None] = dict.fromkeys(self._handles)
        while True:
            if self.stop_requested.is_set():
                self.stop_all()
                return self._finish("interrupted", 130, codes, detail="stopped on request")
            for host, handle in self._handles.items():
                if codes[host] is not None:
                    continue
                try:
                    codes[host] = handle.poll()
                except TransportError as exc:
                    self.stop_all(skip={host})
                    return self._finish("host_lost", 1, codes, lost=[host], detail=str(exc))
                if codes[host] not in (None, 0):
                    self.stop_all(skip={host})
                    return self._finish(
                        "failed",
                        int(codes[host] or 1),
                        codes,
                        failed=[host],
                        detail=f"workers on {host} exited with code {codes[host]}",
                    )
            if all(c == 0 for c in codes.values()):
                return self._finish("finished", 0, codes)
            if time.monotonic() - self._last_status >= self.status_every_s:
                self._last_status = time.monotonic()
                self.printer(f"status: {self.status.line()}")
            stale = self._stale_hosts(codes)
            if stale:
                self.printer(f"lost: heartbeats on {', '.join(stale)} are stale; stopping all")
                self.stop_all()
                return self._finish(
                    "host_lost",
                    1,
                    codes,
                    lost=stale,
                    detail=f"heartbeats on {', '.join(stale)} stale for over "
                    f"{self.heartbeat_timeout_s:.0f} s",
                )
            time.sleep(poll_s)

    def _stale_hosts(self, codes: dict[str, int | None]) -> list[str]:
        """Hosts whose running workers' heartbeat files stopped being rewritten.

        Checked every ``heartbeat_check_s`` over the transport: the age comes from
        the host's own clock (``date`` vs the files' mtimes), so clock skew between
        the controller and the hosts does not matter. Hosts that never wrote a
        heartbeat (user scripts) are never judged by it.
        """
        now = time.monotonic()
        if now - self._last_heartbeat_check < self.heartbeat_check_s:
            return []
        self._last_heartbeat_check = now
        stale = []
        for spec in self.specs:
            if codes.get(spec.host) is not None:
                continue
            try:
                res = self._runners[spec.host].run(
                    [
                        "sh",
                        "-c",
                        'now=$(date +%s); for f in "$1"/heartbeat/rank*; do '
                        '[ -f "$f" ] && echo $((now - $(stat -c %Y "$f"))); done; true',
                        "sh",
                        spec.run_dir,
                    ],
                    timeout_s=20,
                )
            except AutohetError:
                continue  # the process poll reports a lost connection
            ages = [int(x) for x in res.stdout.split() if x.lstrip("-").isdigit()]
            if ages and max(ages) > self.heartbeat_timeout_s:
                stale.append(spec.host)
        return stale

    # ------------------------------------------------------------ stop

    def stop_all(self, skip: set[str] | None = None, grace_s: float = 10.0) -> None:
        """TERM every host's process group by pid, KILL what is left after grace_s.

        torchrun starts each worker in a session of its own, so the workers are
        not in the launcher's process group: their pids are collected from the
        process tree under our pid first, and whatever of them outlives the
        group's stop is killed by pid (a stopped or hung worker ignores TERM)."""
        threads = []
        for host, handle in self._handles.items():
            if skip and host in skip:
                continue
            runner = self._runners[host]
            t = threading.Thread(target=_stop_tree, args=(runner, handle, grace_s), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(grace_s + 20)

    def close(self) -> None:
        for log in self._logs.values():
            log.close()  # type: ignore[attr-defined]
        for runner in self._runners.values():
            try:
                runner.close()
            except AutohetError:
                pass

    def _finish(
        self,
        status: str,
        code: int,
        codes: dict[str, int | None],
        *,
        lost: list[str] | None = None,
        failed: list[str] | None = None,
        detail: str = "",
    ) -> JobOutcome:
        outcome = JobOutcome(
            status=status,
            exit_code=code,
            exit_codes=dict(codes),
            lost_hosts=lost or [],
            failed_hosts=failed or [],
            detail=detail,
            local_run_dir=str(self.local_run_dir),
            last_status=self.status.line(),
        )
        events = {
            "status": outcome.status,
            "exit_code": outcome.exit_code,
            "exit_codes": outcome.exit_codes,
            "lost_hosts": outcome.lost_hosts,
            "failed_hosts": outcome.failed_hosts,
            "detail": outcome.detail,
            "last_status": outcome.last_status,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "plan": str(self.plan_file),
        }
        (self.local_run_dir / "events.json").write_text(json.dumps(events, indent=2) + "\n")
        return outcome


def home_directories(plan: Plan, cluster: Cluster, connect: ConnectOptions) -> dict[str, str]:
    """Each plan host's home directory, for workdirs written as ``~/...``."""
    out = {}
    for name in plan.hosts():
        host = cluster.host(name)
        if not host.workdir.startswith("~"):
            continue
        with runner_for(
            host,
            known_hosts=connect.known_hosts,
            accept_new_host_keys=connect.accept_new_host_keys,
            connect_timeout_s=connect.connect_timeout_s,
        ) as runner:
            out[name] = remote_home(runner)
    return out


_TREE = (
    'ps -eo pid=,ppid= | awk -v root="$1" \'{kids[$2]=kids[$2]" "$1} END {n=split(root,q," "); '
    'while (n>0) {p=q[n]; n--; m=split(kids[p],c," "); for (i=1;i<=m;i++) {print c[i]; '
    "q[++n]=c[i]}}}'"
)


def _stop_tree(runner: Runner, handle: ProcessHandle, grace_s: float) -> None:
    try:
        tree: list[str] = []
        if handle.pid is not None and handle.poll() is None:
            res = runner.run(["sh", "-c", _TREE, "sh", str(handle.pid)], timeout_s=20)
            tree = [p for p in res.stdout.split() if p.isdigit() and int(p) > 1]
        handle.kill(grace_s)
        if tree:
            runner.run(["kill", "-KILL", *tree], timeout_s=20)  # by pid; gone ones are fine
    except AutohetError:
        pass  # the host is gone: nothing left to stop there that we could reach


def recover_command(plan_file: Path, cluster_file: str | None, lost: Sequence[str]) -> str:
    argv = ["autohet", "recover", str(plan_file)]
    if cluster_file:
        argv += ["--cluster", cluster_file]
    if lost:
        argv += ["--lost", ",".join(lost)]
    return shlex.join(argv)
