"""Worker health: heartbeats, collective timeouts, and naming the peer that was lost.

Heartbeats
    Every rank rewrites ``<run dir>/heartbeat/rank<R>`` (R: the torch.distributed
    rank; temp file + rename, so a reader never sees half a beat) at every step
    start and end and every ``interval_s`` from a background thread. It is one JSON
    object: rank, plan place (host, pipeline, stage, TP rank), pid, machine, the
    step, a beat counter, ``state`` (``running``, ``done``, ``failed``) and the Unix
    time; the launcher reads it (or the file's mtime) to see stale workers. The same
    beat goes to the job's rendezvous store (``MASTER_ADDR:MASTER_PORT``, a TCPStore
    every rank reaches), so ranks on other hosts can be checked as well.

Failing fast
    The default process group gets ``--collective-timeout`` (``runtime.rendezvous``,
    re-exported here; gloo honours it per operation, NCCL aborts on it). The other
    groups keep torch's default, so a watchdog in the same thread covers every
    collective: a step running longer than the timeout (twice that for the first
    step, three times the slowest step if that is more) is declared stuck.
    Checkpoint saves run after the watched part of a step, under their own group's
    longer timeout (``ckpt.checkpointer``).

    A stuck step, an exception from a collective (gloo reports a dead peer's closed
    connection at once) or a peer process gone from this machine (checked every
    beat) all lead to one diagnosis. A peer is lost when its process on this
    machine is gone without having said ``done`` or ``failed``; or when its beat
    counter stands still for ``confirm_s`` (in its file, or in the store: any
    host); or, last, when the store stops answering (rank 0's host is gone). The
    first rank to find a lost peer publishes the verdict in the store, and every
    other rank adopts it at its next beat. Each prints
    ``autohet runtime: error: lost contact with rank R (host H, pipeline P stage S)
    at step N``, marks its heartbeat ``failed`` and exits with status 1 at once
    (``os._exit``: a thread stuck in a collective cannot be joined).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autohet_cli.errors import AutohetError
from autohet_cli.runtime.context import Runtime
from autohet_cli.runtime.hooks import Hook
from autohet_cli.runtime.metrics import StepResult
from autohet_cli.runtime.rendezvous import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from autohet_cli.runtime.rendezvous import connect_store, job_token, pid_alive
from autohet_cli.runtime.rendezvous import default_timeout_s as default_timeout_s
from autohet_cli.runtime.rendezvous import init_process_group as init_process_group
from autohet_cli.runtime.trainer_api import TrainerView
from autohet_cli.runtime.worker_defaults import HEARTBEAT_INTERVAL_S
from autohet_cli.workerbase.records import first_line, write_error

HEARTBEAT_DIR = "heartbeat"
DEFAULT_INTERVAL_S = HEARTBEAT_INTERVAL_S
EXIT_LOST = 1
RUNNING, DONE, FAILED = "running", "done", "failed"


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return run_dir / HEARTBEAT_DIR / f"rank{rank}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Lost:
    rank: int
    host: str
    pipeline: int
    stage: int
    why: str


class HealthMonitor(Hook):
    """Heartbeats and the watchdog of one rank, a trainer hook: the watched part of a
    step runs from its ``on_step_start`` to its ``on_step_end``, so the hooks after
    it (a checkpoint save) are not watched."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        run_dir: Path | None,
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S["cpu"],
        confirm_s: float | None = None,
        exit_fn: Callable[[int], Any] = os._exit,
    ) -> None:
        self.runtime = runtime
        self.rank = runtime.global_rank
        self.world_size = len(runtime.to_global)
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.confirm_s = confirm_s if confirm_s is not None else max(3.0, 2.5 * interval_s)
        self.exit_fn = exit_fn
        self.run_dir = run_dir
        self.path = heartbeat_path(run_dir, self.rank) if run_dir is not None else None
        self.token = job_token()
        self.machine = socket.gethostname()
        self._logical = {g: lr for lr, g in enumerate(runtime.to_global)}
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats = 0
        self._state = RUNNING
        self._step = 0
        self._busy_since: float | None = None
        self._slowest_s = 0.0
        self._steps_done = 0
        self._exiting = False
        self._store: Any = None
        self._verdict: list[Lost] = []

    # ----------------------------------------------------------------- life cycle

    def start(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.world_size > 1:
            self._store = connect_store()
        self.beat(store=True)
        self._thread = threading.Thread(target=self._loop, name="autohet-health", daemon=True)
        self._thread.start()

    def stop(self, state: str = DONE) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 5)
        with self._lock:
            self._state = state
        self.beat(store=True)

    # ----------------------------------------------------------------- hook

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        self._step = step
        self._busy_since = time.monotonic()
        self.beat()

    def on_step_end(self, trainer: TrainerView, result: StepResult) -> None:
        if self._busy_since is not None:
            self._slowest_s = max(self._slowest_s, time.monotonic() - self._busy_since)
        self._busy_since = None
        self._steps_done += 1
        self._step = result.step + 1
        self.beat()

    # ----------------------------------------------------------------- beats

    def beat(self, *, store: bool = False) -> None:
        """Rewrite the heartbeat file; ``store``: publish to the rendezvous store too (the
        background thread does, every ``interval_s``; per-step beats only touch the file)."""
        with self._lock:
            self._beats += 1
            info = self.runtime.info
            record = {
                "rank": self.rank,
                "logical_rank": info.rank,
                "host": info.device.host,
                "pipeline": info.pipeline,
                "stage": info.stage,
                "tp_rank": info.tp_rank,
                "pid": os.getpid(),
                "machine": self.machine,
                "token": self.token,
                "state": self._state,
                "step": self._step,
                "beats": self._beats,
                "time": round(time.time(), 3),
            }
            text = json.dumps(record)
            if self.path is not None:
                tmp = self.path.with_name(f".{self.path.name}.tmp")
                try:
                    tmp.write_text(text + "\n", encoding="utf-8")
                    tmp.replace(self.path)
                except OSError:
                    pass  # a full or vanished run directory must not stop training
        if store and self._store is not None:
            try:
                with self._store_lock:
                    self._store.set(self._key(self.rank), text)
            except Exception:
                self._store = None  # the store is gone; files still work

    def _key(self, rank: int) -> str:
        return f"autohet/health/{self.token}/rank{rank}"

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat(store=True)
            lost = self._dead_local_peers() or self._read_verdict()
            if lost:
                self._report(lost, None)
            elif self._stuck():
                self._report(self.diagnose(), f"step {self._step} is stuck")

    def _stuck(self) -> bool:
        since = self._busy_since
        if since is None or self.world_size == 1:
            return False
        allowed = self.timeout_s * (2 if self._steps_done == 0 else 1)
        return time.monotonic() - since > max(allowed, 3 * self._slowest_s)

    # ----------------------------------------------------------------- diagnosis

    def _peer_records(self) -> dict[int, dict[str, Any]]:
        """This job's heartbeat files in the run directory (peers on this host)."""
        out: dict[int, dict[str, Any]] = {}
        if self.path is None:
            return out
        for f in self.path.parent.glob("rank*"):
            try:
                record = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            rank = record.get("rank")
            if isinstance(rank, int) and rank != self.rank and record.get("token") == self.token:
                out[rank] = record
        return out

    def _dead_local_peers(self) -> list[Lost]:
        lost = []
        for rank, r in sorted(self._peer_records().items()):
            same_machine = r.get("machine") == self.machine
            pid = r.get("pid")
            if r.get("state") == RUNNING and same_machine and isinstance(pid, int):
                if not pid_alive(pid) and self._still_running(rank):
                    lost.append(self._lost(rank, f"its process {pid} on this machine is gone"))
        return lost

    def _still_running(self, rank: int) -> bool:
        """Read again after its process was found gone: a peer that saw the loss too
        marks itself ``failed`` and exits between our read and our look at its pid,
        and is then no culprit (under load a survivor was blamed that way)."""
        return self._peer_records().get(rank, {}).get("state") == RUNNING

    def _store_beats(self) -> dict[int, tuple[int, str]] | None:
        """Rank -> (beats, state) from the store; None if the store does not answer."""
        if self._store is None:
            return {}
        out = {}
        try:
            with self._store_lock:
                for rank in range(self.world_size):
                    key = self._key(rank)
                    if rank != self.rank and self._store.check([key]):
                        r = json.loads(self._store.get(key))
                        out[rank] = (int(r["beats"]), str(r["state"]))
        except Exception:
            return None
        return out

    def diagnose(self) -> list[Lost]:
        """The peers lost, by process, then by beats that stand still for ``confirm_s``."""
        if self.world_size == 1:
            return []
        lost = self._dead_local_peers() or self._read_verdict()
        if lost:
            return lost
        before_files = {r: rec.get("beats") for r, rec in self._peer_records().items()}
        before_store = self._store_beats()
        deadline = time.monotonic() + self.confirm_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if lost := self._dead_local_peers() or self._read_verdict():
                return lost
        after_store = self._store_beats()
        found: dict[int, Lost] = {}
        quiet = f"no heartbeat for {self.confirm_s:.0f} s"
        records = self._peer_records()
        for rank, rec in records.items():
            if rec.get("state") == RUNNING and before_files.get(rank) == rec.get("beats"):
                found[rank] = self._lost(rank, quiet)
        for rank, (beats, state) in (after_store or {}).items():
            old = (before_store or {}).get(rank)
            if state == RUNNING and old is not None and old[0] == beats and rank not in found:
                found[rank] = self._lost(rank, quiet)
        if found:
            return [found[r] for r in sorted(found)]
        rank0_left = records.get(0, {}).get("state") in (DONE, FAILED)
        if after_store is None and self.rank != 0 and not rank0_left:
            return [self._lost(0, "the rendezvous store on its host does not answer")]
        return []

    def _verdict_key(self) -> str:
        return f"autohet/health/{self.token}/lost"

    def _read_verdict(self) -> list[Lost]:
        """The lost peers another rank found first (kept once read: the store may go)."""
        if self._verdict or self._store is None:
            return self._verdict
        try:
            with self._store_lock:
                if not self._store.check([self._verdict_key()]):
                    return []
                raw = json.loads(self._store.get(self._verdict_key()))
            self._verdict = [
                self._lost(int(r["rank"]), f"rank {raw['by']} found: {r['why']}")
                for r in raw["lost"]
            ]
        except Exception:
            return []
        return self._verdict

    def _publish_verdict(self, lost: list[Lost]) -> None:
        """Tell every rank who was lost (the first verdict stays), so all exit at once."""
        if self._store is None:
            return
        text = json.dumps({"by": self.rank, "lost": [{"rank": p.rank, "why": p.why} for p in lost]})
        try:
            with self._store_lock:
                self._store.compare_set(self._verdict_key(), "", text)
        except Exception:
            pass

    def _lost(self, rank: int, why: str) -> Lost:
        info = self.runtime.topology.ranks[self._logical[rank]]
        return Lost(
            rank=rank, host=info.device.host, pipeline=info.pipeline, stage=info.stage, why=why
        )

    # ----------------------------------------------------------------- failure

    def fail(self, exc: BaseException) -> None:
        """Called with the exception that ended training on this rank.

        Our own errors (every rank raises them alike) just mark the heartbeat
        ``failed``; anything else may be a lost peer, which is then reported and
        the process ends here.
        """
        if not isinstance(exc, AutohetError | ValueError | KeyboardInterrupt):
            lost = self.diagnose()
            if lost:
                self._report(lost, f"{type(exc).__name__}: {first_line(str(exc))}")
        self.stop(FAILED)

    def _report(self, lost: list[Lost], cause: str | None) -> None:
        with self._lock:
            if self._exiting:
                return
            self._exiting = True
        step = self._step
        if lost:
            self._publish_verdict(lost)
            for peer in lost:
                print(
                    f"autohet runtime: error: lost contact with rank {peer.rank} (host "
                    f"{peer.host}, pipeline {peer.pipeline} stage {peer.stage}) at step {step}",
                    file=sys.stderr,
                )
            detail = "; ".join(f"rank {p.rank}: {p.why}" for p in lost)
            print(f"autohet runtime: rank {self.rank}: {detail}", file=sys.stderr)
        else:
            print(
                f"autohet runtime: error: rank {self.rank}: {cause}: no progress for "
                f"{self.timeout_s:.0f} s and no peer known to be lost",
                file=sys.stderr,
            )
        if cause and lost:
            print(f"autohet runtime: rank {self.rank}: {cause}", file=sys.stderr)
        self._record(lost, cause)
        sys.stderr.flush()
        sys.stdout.flush()
        self._stop.set()
        with self._lock:
            self._state = FAILED
        self.beat(store=True)
        if self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # Started without torchrun, rank 0's process serves the rendezvous store:
            # keep it up while the others diagnose, or they would blame rank 0.
            time.sleep(self.confirm_s + 1)
        self.exit_fn(EXIT_LOST)

    def _record(self, lost: list[Lost], cause: str | None) -> None:
        """The failure record the launcher reads (``workerbase.records``)."""
        info = self.runtime.info
        if lost:
            peer = lost[0]
            message = (
                f"lost contact with rank {peer.rank} (host {peer.host}, pipeline "
                f"{peer.pipeline} stage {peer.stage}) at step {self._step}: {peer.why}"
            )
        else:
            message = f"{cause}: no progress for {self.timeout_s:.0f} s, no peer known lost"
        write_error(
            self.run_dir,
            kind="peer_lost" if lost else "stuck",
            message=message,
            host=info.device.host,
            rank=self.rank,
            place=f"pipeline {info.pipeline} stage {info.stage}",
        )
