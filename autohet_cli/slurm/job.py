"""A plan running as one Slurm heterogeneous job: submit, follow, judge, cancel (effects).

It is ``launch.executor.Job`` with Slurm underneath, so watching and judging are
the SSH backend's own (``triage``: lost host, failed workers, preempted, not
started). What differs is how the launcher sees the hosts. It cannot reach
compute nodes, so everything comes through the run directory the nodes share
with it, and through Slurm:

* the nodes' output: ``slurm/<node>.out|.err``, followed here and printed like
  the SSH backend's streams (step lines, reports, preemption lines);
* heartbeats, boot marks and error records, in that same directory, are read
  with the SSH backend's probe, run on this machine;
* each node's exit code: ``exit/<node>``, written by the batch script;
* the job's and the nodes' state: ``scontrol show job`` and ``sinfo``. A node
  Slurm reports down, or a component that ended ``NODE_FAIL``/``PREEMPTED``
  without an exit code, is a lost host; so is a node whose workers' heartbeats
  stand still (frozen or gone before slurmctld noticed: its timeout is minutes).

Stopping is ``scancel`` (Slurm signals and then kills every step on every node),
waiting until Slurm says the job ended; the first Ctrl-C's notice is ``scancel
--signal=TERM`` (the steps' processes only: they save the step and exit).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

from autohet_cli.errors import HostUnreachable
from autohet_cli.launch import triage
from autohet_cli.launch.executor import Job, LaunchError
from autohet_cli.slurm import ctl
from autohet_cli.slurm.script import SCRIPT_NAME
from autohet_cli.transport.base import ProcessHandle, Runner
from autohet_cli.transport.local import LocalRunner

STATE_EVERY_S = 1.0
PENDING_SAY_EVERY_S = 30.0
CANCEL_WAIT_S = 120.0


class SlurmJob(Job):
    """``Job`` with Slurm between the launcher and the nodes: built as a ``Job`` is
    (``_init_backend`` adds what only Slurm needs), watched and judged as one."""

    def _init_backend(self) -> None:
        self.job_id: str | None = None
        self._local = LocalRunner()
        self._job_state: ctl.JobState | None = None
        self._nodes: dict[str, str] = {}
        self._state_at = 0.0
        self._state_lock = threading.Lock()
        self._tail_stop = threading.Event()
        self._tail_thread: threading.Thread | None = None
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self._no_exit_file: set[str] = set()  # hosts whose wrapper never wrote one

    def runner(self, host: str) -> Runner:
        """Probes read the shared run directory here; nodes are never reached."""
        return self._local

    @property
    def started_anything(self) -> bool:
        """Only a submitted job ran (or may run) anything: a job sbatch refused is no run."""
        return self.job_id is not None

    # ------------------------------------------------------------ start

    def start(self) -> None:
        """Submit, wait in the queue (Ctrl-C cancels), then follow the running job."""
        run = self.local_run_dir
        for sub in ("slurm", "exit"):
            (run / sub).mkdir(parents=True, exist_ok=True)
        self._open_logs(run, [s.host for s in self.specs])
        self.job_id = ctl.submit(str(run / SCRIPT_NAME))
        self.printer(
            f"submitted: Slurm job {self.job_id} ({run / SCRIPT_NAME}); Ctrl-C here, or "
            f"scancel {self.job_id}, stops it"
        )
        self._tail_thread = threading.Thread(target=self._follow, daemon=True)
        self._tail_thread.start()
        self._wait_running()
        for spec in self.specs:
            self._handles[spec.host] = _NodeHandle(self, spec.host)
            self.printer(
                f"{spec.host}: running {spec.nproc_per_node} worker(s), log "
                f"{run / (spec.host + '.log')}"
            )
        self._started_at = time.monotonic()

    def _wait_running(self) -> None:
        said = 0.0
        while not self.stop_requested.is_set():
            st = self.refresh(force=True)
            if st is not None and (st.running or st.ended):
                ran = any((self.local_run_dir / "exit").iterdir())
                if st.ended and not st.running and not ran:
                    # Nothing ran on any node: the batch step failed (srun refused,
                    # a node could not start it); its output says why.
                    time.sleep(0.5)
                    self._drain()
                    raise LaunchError(
                        f"Slurm job {self.job_id} ended before any node ran: "
                        + "; ".join(f"{c} {s} ({st.reasons[c]})" for c, s in st.components.items())
                        + f"; its output: {self.local_run_dir / 'slurm'}"
                    )
                return
            now = time.monotonic()
            if st is not None and now - said >= PENDING_SAY_EVERY_S:
                said = now
                reasons = set(st.reasons.values()) - {"None"}
                why = ", ".join(sorted(reasons)) or "waiting for the scheduler"
                self.printer(f"queued: Slurm job {self.job_id} is pending ({why})")
            time.sleep(STATE_EVERY_S)

    # ------------------------------------------------------------ state

    def refresh(self, *, force: bool = False) -> ctl.JobState | None:
        """The job's state (and its nodes'), asked of Slurm at most once a second."""
        with self._state_lock:
            if not force and time.monotonic() - self._state_at < STATE_EVERY_S:
                return self._job_state
            assert self.job_id is not None
            state = ctl.job_state(self.job_id)
            nodes = [s.host for s in self.specs]
            try:
                self._nodes = ctl.node_states(nodes)
            except ctl.SlurmError:
                self._nodes = {}
            self._job_state, self._state_at = state, time.monotonic()
            return state

    def exit_code(self, host: str) -> int | None:
        """The node's exit code; HostUnreachable when Slurm says the node is gone."""
        path = self.local_run_dir / "exit" / host
        if path.exists():
            text = path.read_text().strip()
            if text.lstrip("-").isdigit():
                return int(text)
        st = self.refresh()
        node = self._nodes.get(host, "")
        if node and ctl.is_down(node):
            raise HostUnreachable(f"Slurm reports node {host} {node}", host=host)
        if st is None or st.ended:
            states = st.states if st is not None else {"(forgotten by Slurm)"}
            lost = states & ctl.NODE_LOST
            if lost:
                raise HostUnreachable(
                    f"Slurm job {self.job_id} ended {'/'.join(sorted(lost))} on {host}", host=host
                )
            if path.exists():  # written while we asked
                return self.exit_code(host)
            self._no_exit_file.add(host)
            return 128 + 9  # ended by Slurm (cancel, time limit) before torchrun did
        return None

    def _second_look(self, state: triage.HostState, probes: dict[str, object]) -> triage.HostState:
        """What only the peers can tell here: a node whose ranks their peers lost
        contact with (``peer_lost`` records naming it) and that left no exit code is
        gone, even before slurmctld notices (minutes)."""
        name = state.name
        no_code = state.exit_code is None or name in self._no_exit_file
        if state.unreachable or not no_code:
            return state
        for host, got in probes.items():
            text = getattr(got, "errors", "")
            for err in triage.parse_records(host, text) if isinstance(text, str) else ():
                if err.kind == "peer_lost" and f"(host {name}," in err.message:
                    why = f"its peers lost contact with it ({err.message}); no exit code"
                    return dataclasses.replace(state, unreachable=why, exit_code=None)
        return state

    # ------------------------------------------------------------ output

    def _follow(self) -> None:
        while not self._tail_stop.is_set():
            self._drain()
            self._tail_stop.wait(0.2)
        self._drain()

    def _drain(self) -> None:
        slurm_dir = self.local_run_dir / "slurm"
        for spec in self.specs:
            for stream in ("out", "err"):
                path = slurm_dir / f"{spec.host}.{stream}"
                name = "stdout" if stream == "out" else "stderr"
                for line in self._new_lines(path):
                    self._on_line(spec.host)(name, line)
        for path in sorted(slurm_dir.glob("batch-*.out")):
            for line in self._new_lines(path):
                self.printer(f"[slurm] {line}")

    def _new_lines(self, path: Path) -> list[str]:
        try:
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
        except FileNotFoundError:
            return []
        self._offsets[path] = self._offsets.get(path, 0) + len(data)
        text = self._partial.pop(path, "") + data.decode("utf-8", "replace")
        lines = text.split("\n")
        if lines[-1]:
            self._partial[path] = lines[-1]
        return [ln.rstrip("\r") for ln in lines[:-1]]

    # ------------------------------------------------------------ stop

    def notify_all(self) -> None:
        """The stop request's notice (the first Ctrl-C): the executor's SIGTERM to each
        host's torchrun needs a pid, which the nodes' processes have none of here, so
        Slurm sends it: every agent and worker of every node gets one SIGTERM, the
        notice that saves the step every rank is on (runtime.agent, runtime.preempt)."""
        if self.job_id is None:
            return
        st = self.refresh(force=True)
        if st is not None and st.pending:
            # Still queued: nothing runs, so nothing to save (and Slurm signals no
            # pending job): stop at once, which cancels it.
            self.kill_requested.set()
            return
        try:
            ctl.signal_steps(self.job_id, "TERM")
        except ctl.SlurmError as exc:
            self.printer(f"warning: {exc}")  # ended already, or Slurm did not answer

    def stop_all(self, skip: set[str] | None = None, grace_s: float = 10.0) -> None:
        """scancel the job (Slurm TERMs, then KILLs every step on every node) and wait
        until Slurm says it ended, so nothing of it is left when we return."""
        if self.job_id is None:
            return
        st = self.refresh(force=True)
        if st is not None and not st.ended:
            try:
                ctl.cancel(self.job_id)
            except ctl.SlurmError as exc:
                self.printer(f"warning: {exc}")
            deadline = time.monotonic() + CANCEL_WAIT_S
            while time.monotonic() < deadline:
                st = self.refresh(force=True)
                if st is None or st.ended:
                    break
                time.sleep(0.5)
            else:
                self.printer(
                    f"warning: Slurm job {self.job_id} has not ended {CANCEL_WAIT_S:.0f} s "
                    f"after scancel; check squeue -j {self.job_id}"
                )

    def close(self) -> None:
        self._tail_stop.set()
        if self._tail_thread is not None:
            self._tail_thread.join(5)
        super().close()


class _NodeHandle(ProcessHandle):
    """One node's torchrun as the executor sees it: its exit code, from Slurm's side."""

    def __init__(self, job: SlurmJob, host: str) -> None:
        super().__init__(host=host, argv=(), on_line=None)
        self._job = job

    @property
    def pid(self) -> int | None:
        return None  # on a node we cannot reach: stopping is scancel

    def poll(self) -> int | None:
        return self._job.exit_code(self.host)

    def _wait_exit(self, timeout_s: float | None) -> int | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            code = self.poll()
            if code is not None:
                return code
            time.sleep(0.5)
        return None

    def _kill_group(self, grace_s: float) -> None:
        self._job.stop_all(grace_s=grace_s)
