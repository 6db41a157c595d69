"""Preemption notices: save at the next step boundary on every rank, then exit cleanly.

A spot host gives warning before it goes (AWS two minutes, GCP 30 seconds): the
machine's shutdown sends SIGTERM to every process, and the clouds' metadata
services announce the reclaim earlier still. Either becomes a *notice* here:

SIGTERM
    to a worker (torchrun forwards the SIGTERM it gets to its workers). A second
    SIGTERM ends the worker at once, as without this module.
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
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autohet_cli.preemption import CheckSpec
from autohet_cli.runtime.hooks import Hook
from autohet_cli.runtime.metrics import StepResult
from autohet_cli.runtime.records import PREEMPT_PREFIX

CHECK_TIMEOUT_S = 10.0


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
    ) -> None:
        self.host, self.rank, self.check = host, rank, check
        self.saved_steps = saved_steps or (lambda: ())
        self.say = say or (lambda _m: None)
        self.emit = emit or (lambda line: print(line, flush=True))
        self._notice: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stopped_at: int | None = None
        self.hosts: dict[str, str] = {}
        # One gloo group: the agreement runs on CPU whatever the training backend.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._old_handler: Any = None
        self._old_wakeup = -1
        self._wake: tuple[socket.socket, socket.socket] | None = None
        if install_signal and threading.current_thread() is threading.main_thread():
            self._install_sigterm()
        if check is not None and poll:
            self._thread = threading.Thread(target=self._poll_loop, name="preempt", daemon=True)
            self._thread.start()

    # ----------------------------------------------------------------- notices

    def notify(self, why: str) -> None:
        """Record a notice (first one wins); acted on at the next step end."""
        with self._lock:
            if self._notice is None:
                self._notice = why

    def _install_sigterm(self) -> None:
        """SIGTERM through a wakeup socket read by a thread of ours.

        A Python signal handler runs only when the main thread runs Python code, and
        a rank waiting in a collective (a peer is slow, or stopped) runs none for as
        long as it waits; the C-level handler still writes the signal's number to
        the wakeup fd at once, so the notice is recorded at once, and a second
        SIGTERM ends the process at once (exit 143, as a killed worker's shell
        reports), whatever the main thread is doing."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._wake = (reader, writer)
        self._old_handler = signal.signal(signal.SIGTERM, lambda _s, _f: None)
        self._old_wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(
            target=self._signal_loop, args=(reader,), name="sigterm", daemon=True
        ).start()

    def _signal_loop(self, reader: socket.socket) -> None:
        seen = 0
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for number in data:
                if number != signal.SIGTERM:
                    continue
                seen += 1
                if seen == 1:
                    self.notify("SIGTERM")
                else:
                    os._exit(128 + signal.SIGTERM)  # a shutdown that will not wait

    def _poll_loop(self) -> None:
        assert self.check is not None
        while not self._stop.wait(self.check.interval_s):
            found = poll_once(self.check)
            if found is not None:
                self.notify(f"preemption check: {found}")
                return

    # ----------------------------------------------------------------- agreement

    def on_step_end(self, trainer: Any, result: StepResult) -> None:
        with self._lock:
            mine = self._notice
        flag = torch.tensor([1 if mine is not None else 0], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not int(flag.item()):
            return
        reports: list[Any] = [(self.host, mine)]
        if self.group is not None:
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, (self.host, mine), group=self.group)
        for host, why in reports:
            if why is not None:
                self.hosts.setdefault(host, why)
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

    def on_train_end(self, trainer: Any) -> None:
        """After the checkpoint hook's final save (this hook comes after it)."""
        self.close()
        if self.stopped_at is None or self.rank != 0:
            return
        saved = self.stopped_at if self.stopped_at in self.saved_steps() else None
        self.emit(
            PREEMPT_PREFIX
            + json.dumps({"event": "saved", "step": saved, "hosts": self.hosts}, sort_keys=True)
        )
        self.say(
            f"preempted: step {saved} saved, exiting"
            if saved is not None
            else "preempted: no checkpoint saved (checkpoints are off); exiting"
        )

    def close(self) -> None:
        self._stop.set()
        if self._old_handler is not None:
            try:
                signal.signal(signal.SIGTERM, self._old_handler)
                signal.set_wakeup_fd(self._old_wakeup)
            except ValueError:
                pass  # not the main thread
            self._old_handler = None
        if self._wake is not None:
            for sock in self._wake:
                sock.close()
            self._wake = None
