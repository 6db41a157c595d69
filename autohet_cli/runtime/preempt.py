"""Preemption notices: save at the next step boundary on every rank, then exit cleanly.

A spot host gives warning before it goes (AWS two minutes, GCP 30 seconds): the
machine's shutdown sends SIGTERM to every process, and the clouds' metadata
services announce the reclaim earlier still. Either becomes a *notice* here:

SIGTERM
    to a worker: the shutdown's own, or forwarded by the host's agent
    (``runtime.agent``, torchrun that waits for the save). A shutdown signals every
    process at once, so a worker gets several within milliseconds: all SIGTERMs
    within ``REPEAT_WINDOW_S`` of the first are one notice. One after that ends the
    worker at once (a person or a deadline that will not wait). The catcher is
    installed when the worker starts (``Notices.install``), so a notice during
    start-up or loading is kept and acted on at the first step end.
the host's check
    ``AUTOHET_PREEMPTION_CHECK``, set by ``autohet launch`` from the cluster file's
    ``preemption_check`` (JSON: ``{"command": ...}`` or ``{"url": ..., "headers":
    {...}}``, ``interval_s``). The host's local rank 0 polls it in a daemon thread:
    a command reports a notice when it exits 0 (``curl -sf URL`` on AWS's
    ``spot/instance-action``, which answers 404 until a reclaim is scheduled); a URL
    when it answers 200 with a body other than empty or ``FALSE`` (GCP's
    ``instance/preempted`` answers ``FALSE`` until then, and needs the header
    ``Metadata-Flavor: Google``). A check that fails to run is not a notice.

At every step end all ranks agree on whether any of them has a notice: one
all-reduce (MAX) of one integer on a gloo group of their own (a small message per
step, next to a step's gradient sync; it runs on CPU under NCCL too). When one
has, the trainer stops after that step; the checkpoint hook's final save writes
it on every rank (the step is complete, so nothing is lost), and the worker exits
0. Rank 0 prints two ``autohet-preempt:`` lines for the launcher (the notice with
the hosts that gave it, then the saved step), which makes the job "preempted"
rather than finished, and ``--auto-recover`` resumes it on the other hosts from
exactly that step.

Why not torchrun's own handling: torchrun turns a SIGTERM into killing its workers
(SIGTERM, then SIGKILL after 30 s), which loses the work since the last save; and
the ranks must agree on the step to save, which only a collective gives.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from autohet_cli.ckpt.steptext import after
from autohet_cli.preemption import CheckSpec
from autohet_cli.runtime.agent import REPEAT_WINDOW_S, NoticeClock
from autohet_cli.runtime.hooks import Hook
from autohet_cli.runtime.metrics import StepResult
from autohet_cli.runtime.trainer_api import TrainerView
from autohet_cli.workerbase.records import PREEMPT_PREFIX

CHECK_TIMEOUT_S = 10.0
# How long the ranks wait for each other to name notices that came during the save.
LATE_NOTICE_WAIT_S = 5.0


def poll_once(spec: CheckSpec) -> str | None:
    """Run the check once: the notice's text, or None (no notice, or the check failed)."""
    if spec.command:
        try:
            res = subprocess.run(
                spec.command,
                shell=True,  # the user's own line from their cluster file, run on their host
                capture_output=True,
                text=True,
                timeout=max(CHECK_TIMEOUT_S, spec.interval_s),
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if res.returncode != 0:
            return None
        out = res.stdout.strip().splitlines()
        return f"{spec.describe()} exited 0" + (f": {out[0][:200]}" if out else "")
    assert spec.url is not None
    request = urllib.request.Request(spec.url, headers=dict(spec.headers))
    try:
        with urllib.request.urlopen(request, timeout=CHECK_TIMEOUT_S) as answer:
            status, body = answer.status, answer.read(4096).decode("utf-8", "replace").strip()
    except (OSError, urllib.error.URLError, ValueError):
        return None  # 404 (no notice yet) raises HTTPError, an URLError
    if status != 200 or body.lower() in ("", "false"):
        return None
    return f"{spec.url} answered: {body.splitlines()[0][:200]}"


class Notices:
    """This process's preemption notice: the first one (its text and wall time) wins.

    Process-wide and installed before the model is built (``install``), so a
    notice that comes while the worker starts or loads a checkpoint is kept for
    the trainer's first step end."""

    def __init__(self, window_s: float = REPEAT_WINDOW_S) -> None:
        self._lock = threading.Lock()
        self._first: tuple[str, float] | None = None
        self._clock = NoticeClock(window_s)
        self._stop = threading.Event()
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._old_handler: Any = None
        self._old_wakeup = -1
        self._poller: threading.Thread | None = None

    def notify(self, why: str) -> None:
        """Record a notice (first one wins); acted on at the next step end."""
        with self._lock:
            if self._first is None:
                self._first = (why, time.time())

    def first(self) -> tuple[str, float] | None:
        """(why, unix time) of the notice, or None."""
        with self._lock:
            return self._first

    def on_sigterm(self, now: float) -> bool:
        """One SIGTERM at monotonic ``now``: False when it must end the process."""
        seen = self._clock.absorb(now)
        if seen is None:
            self.notify("SIGTERM")
        return seen is not False

    def install(self) -> None:
        """SIGTERM through a wakeup socket read by a thread of ours (main thread only).

        A Python signal handler runs only when the main thread runs Python code, and
        a rank waiting in a collective (a peer is slow, or stopped) or in a long save
        runs none for as long as it waits; the C-level handler still writes the
        signal's number to the wakeup fd at once, so the notice is recorded at once,
        and a SIGTERM past the window ends the process at once (exit 143, as a killed
        worker's shell reports), whatever the main thread is doing."""
        if self._wake is not None or threading.current_thread() is not threading.main_thread():
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._wake = (reader, writer)
        self._old_handler = signal.signal(signal.SIGTERM, lambda _s, _f: None)
        self._old_wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(
            target=self._signal_loop, args=(reader,), name="sigterm", daemon=True
        ).start()

    def _signal_loop(self, reader: socket.socket) -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for number in data:
                if number == signal.SIGTERM and not self.on_sigterm(time.monotonic()):
                    os._exit(128 + signal.SIGTERM)  # a shutdown that will not wait

    def poll(self, check: CheckSpec) -> None:
        """Poll the host's check in a daemon thread until it gives a notice."""

        def loop() -> None:
            while not self._stop.wait(check.interval_s):
                found = poll_once(check)
                if found is not None:
                    self.notify(f"preemption check: {found}")
                    return

        self._poller = threading.Thread(target=loop, name="preempt", daemon=True)
        self._poller.start()

    def close(self) -> None:
        """Stop polling. The SIGTERM catcher stays for the rest of the process: a
        shutdown's late repeat must not kill a worker that saved and is exiting."""
        self._stop.set()

    def hold_through_exit(self) -> None:
        """Ignore SIGTERM from here to the process's end (main thread, last thing).

        The interpreter's teardown puts every signal with a Python handler back to
        SIG_DFL (CPython's ``_PySignal_Fini``), so the catcher above does not last to
        the end: a shutdown's repeat SIGTERM in the last milliseconds killed a worker
        that had saved its step and returned 0 (exit -15, which torchrun reports as a
        failed worker). SIG_IGN survives the teardown; what is left to run is exiting,
        and SIGKILL still ends it."""
        if self._wake is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


_NOTICES: Notices | None = None


def notices() -> Notices:
    """This process's notices (created on first use)."""
    global _NOTICES
    if _NOTICES is None:
        _NOTICES = Notices()
    return _NOTICES


class PreemptionHook(Hook):
    """Turns notices into a stop after the current step (every rank, same step)."""

    def __init__(
        self,
        *,
        host: str,
        rank: int,
        check: CheckSpec | None = None,
        poll: bool = True,
        say: Callable[[str], None] | None = None,
        emit: Callable[[str], None] | None = None,
        install_signal: bool = True,
        saved_steps: Callable[[], Sequence[int]] | None = None,
        source: Notices | None = None,
    ) -> None:
        self.host, self.rank, self.check = host, rank, check
        self.saved_steps = saved_steps or (lambda: ())
        self.say = say or (lambda _m: None)
        self.emit = emit or (lambda line: print(line, flush=True))
        self.notices = source if source is not None else notices()
        self.stopped_at: int | None = None
        self.notice_at: float | None = None  # unix time of the earliest rank's notice
        self.hosts: dict[str, str] = {}
        self.rank_hosts: list[str] = []  # every rank's host, in rank order (the agreement)
        # One gloo group: the agreement runs on CPU whatever the training backend.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        if install_signal:
            self.notices.install()
        if check is not None and poll:
            self.notices.poll(check)

    def notify(self, why: str) -> None:
        """Record a notice (first one wins); acted on at the next step end."""
        self.notices.notify(why)

    # ----------------------------------------------------------------- agreement

    def on_step_end(self, trainer: TrainerView, result: StepResult) -> None:
        mine = self.notices.first()
        flag = torch.tensor([1 if mine is not None else 0], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not int(flag.item()):
            return
        report = (self.host, *(mine if mine is not None else (None, None)))
        reports: list[Any] = [report]
        if self.group is not None:
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, report, group=self.group)
        self.rank_hosts = [host for host, _why, _at in reports]
        for host, why, at in reports:
            if why is not None:
                self.hosts.setdefault(host, why)
                self.notice_at = at if self.notice_at is None else min(self.notice_at, at)
        self.stopped_at = trainer.step
        trainer.stop_reason = "preempted"
        if self.rank == 0:
            who = "; ".join(f"{h}: {w}" for h, w in self.hosts.items())
            self.say(
                f"preemption notice ({who}): saving step {trainer.step} on every rank, then "
                "stopping"
            )
            self.emit(
                PREEMPT_PREFIX
                + json.dumps({"event": "notice", "step": trainer.step, "hosts": self.hosts})
            )

    def on_train_end(self, trainer: TrainerView) -> None:
        """After the checkpoint hook's final save (this hook comes after it)."""
        self.close()
        if self.stopped_at is None:
            return
        self._late_notices()
        if self.rank != 0:
            return
        saved = self.stopped_at if self.stopped_at in self.saved_steps() else None
        took = round(time.time() - self.notice_at, 3) if self.notice_at is not None else None
        event = {"event": "saved", "step": saved, "hosts": self.hosts, "notice_to_complete_s": took}
        self.emit(PREEMPT_PREFIX + json.dumps(event, sort_keys=True))
        self.say(
            f"preempted: step {saved} saved ({after(saved)}), COMPLETE {took:.1f} s after the "
            "notice; exiting"
            if saved is not None and took is not None
            else "preempted: no checkpoint saved (checkpoints are off, or "
            "--no-emergency-save); exiting"
        )

    def _late_notices(self) -> None:
        """Add the hosts whose notice came after the agreement, during the save.

        A shutdown signals every host at once, but not in the same millisecond: the
        step end that agreed on the first host's notice may come before the second
        host's, which then saves with everyone and leaves too. Asked once more after
        the save, so that the launcher's verdict (and the recover line it prints)
        names every host that is going. Every rank that agreed calls this; a rank
        whose save raised never does, so the gather waits a bounded time and the
        hosts stay as agreed (the notice already named the first ones)."""
        if self.group is None or not self.rank_hosts:
            return
        mine = self.notices.first()
        code = 0 if mine is None else (1 if mine[0] == "SIGTERM" else 2)
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in self.rank_hosts]
        try:
            work = dist.all_gather(
                gathered, torch.tensor([code], dtype=torch.int64), group=self.group, async_op=True
            )
            assert work is not None
            work.wait(timeout=timedelta(seconds=LATE_NOTICE_WAIT_S))
        except RuntimeError:
            return  # a rank did not come (its save failed): the agreed hosts stand
        for host, got in zip(self.rank_hosts, gathered, strict=True):
            if int(got.item()) and host not in self.hosts:
                self.hosts[host] = "SIGTERM" if int(got.item()) == 1 else "preemption check"

    def close(self) -> None:
        self.notices.close()
