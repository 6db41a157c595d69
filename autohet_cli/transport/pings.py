"""Ask an SSH connection for a sign of life, over and over (one daemon thread each).

A host that dies with its kernel (powered off, a kernel panic, its network gone)
sends no FIN or RST: its TCP connection looks open for minutes, and paramiko's own
keep-alive expects no reply, so it shows nothing either. A keep-alive that wants a
reply does: sshd answers ``keepalive@openssh.com`` (with a "request failed", as
OpenSSH's ``ServerAliveInterval`` relies on) within a round trip, whatever the
host's workers are doing, because sshd is a process of its own. The pinger records
when its oldest unanswered keep-alive went out and when the newest answered one
did; what counts as too long a silence is the caller's rule
(:func:`autohet_cli.launch.liveness.silent_hosts`).
"""

from __future__ import annotations

import threading
import time

import paramiko

from autohet_cli.transport.base import Liveness

KEEPALIVE = "keepalive@openssh.com"


class Pinger:
    """Keep-alives on one connection, each sent once the previous one was answered
    and ``every_s`` has passed; stops when the connection closes or on ``stop()``."""

    def __init__(self, transport: paramiko.Transport, every_s: float, *, name: str) -> None:
        if every_s <= 0:
            raise ValueError(f"ping interval must be positive, got {every_s}")
        self.transport = transport
        self._every_s = every_s
        self._lock = threading.Lock()
        self._state = Liveness()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def liveness(self) -> Liveness:
        with self._lock:
            return self._state

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        t = self.transport
        while not self._stop.is_set() and t.is_active():
            sent = time.monotonic()
            with self._lock:
                self._state = Liveness(
                    waiting_since_s=sent, answered_sent_s=self._state.answered_sent_s
                )
            try:
                # Blocks until the reply (either answer will do) or the connection ends.
                t.global_request(KEEPALIVE, wait=True)
            except (paramiko.SSHException, OSError, EOFError):
                return
            if not t.is_active():
                return  # closed: the channels on it say so (HostUnreachable)
            with self._lock:
                self._state = Liveness(waiting_since_s=None, answered_sent_s=sent)
            self._stop.wait(self._every_s)
