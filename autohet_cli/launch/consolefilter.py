"""What of a host's output the launcher echoes to the console (pure but for the printer).

When a worker fails, torchrun (the agent) ends with its own traceback, raised from
its ``launch_agent`` and ending in ``ChildFailedError``, then a ``====`` box that
lists every failed rank and the "Root Cause (first observed failure)". That is
about 45 lines saying what the launcher's verdict already says in one (``failed:
... root cause: ...``, from ``triage``), and it buries the worker's own line
(``autohet runtime: error: ...``) on the console. So the console leaves out that
traceback and its box, and only them:

- a ``Traceback (most recent call last):`` block is held until its exception line
  (the first line after it that is not indented) says what it is: torchrun's
  ``ChildFailedError`` is dropped with the box that follows it, anything else (a
  worker's own crash, which is worth reading) is echoed whole, in order;
- a held block that grows past ``MAX_HELD_LINES`` or is still open when the job
  closes is echoed as it is: nothing is ever lost from the console but torchrun's.

Every rank of a host that refuses the same thing (a config.json of another model:
each reads it) prints the same ``autohet runtime: error: ...`` line; the console
shows a host's line once.

Only the console is filtered: each host's log file in the run folder and the
output tail that ``triage`` and ``logcause`` read get every line (the executor
writes those before calling :meth:`Console.echo`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

TRACEBACK = "Traceback (most recent call last):"
AGENT_EXCEPTION = "ChildFailedError"
BOX_RULE = "=" * 20  # torchrun's box starts and ends with a rule of 60 '='
MAX_HELD_LINES = 400  # a traceback longer than this is echoed rather than held
MAX_BOX_LINES = 400  # a box that never closes stops hiding lines after this many
RUNTIME_ERROR = "autohet runtime: error: "

_ECHO, _HELD, _BOX_NEXT, _IN_BOX = range(4)


class StreamFilter:
    """One stream of one host: :meth:`feed` takes a line and returns the lines to echo
    now (none while a traceback is held); :meth:`flush` returns what is still held."""

    def __init__(self) -> None:
        self._state = _ECHO
        self._held: list[str] = []
        self._box_lines = 0
        self._errors_shown: set[str] = set()

    def feed(self, line: str) -> list[str]:
        if line.startswith(RUNTIME_ERROR):
            if line in self._errors_shown:
                return []  # another rank's copy of a refusal already shown
            self._errors_shown.add(line)
        if self._state == _BOX_NEXT:
            if line.startswith(BOX_RULE):
                self._state, self._box_lines = _IN_BOX, 0
                return []
            self._state = _ECHO  # no box after all: an agent that prints none
        if self._state == _IN_BOX:
            self._box_lines += 1
            if line.startswith(BOX_RULE) or self._box_lines > MAX_BOX_LINES:
                self._state = _ECHO
            return []
        if line.rstrip() == TRACEBACK:
            out = self.flush()  # a traceback inside a traceback: the first is not torchrun's
            self._held, self._state = [line], _HELD
            return out
        if self._state == _ECHO:
            return [line]
        if line[:1] in (" ", "\t") or not line.strip():
            self._held.append(line)
            if len(self._held) > MAX_HELD_LINES:
                return self.flush()
            return []
        # The exception line: whose traceback this was.
        if AGENT_EXCEPTION in line.split(":", 1)[0]:
            self._held, self._state = [], _BOX_NEXT
            return []
        out = [*self._held, line]
        self._held, self._state = [], _ECHO
        return out

    def flush(self) -> list[str]:
        out, self._held = self._held, []
        if self._state == _HELD:
            self._state = _ECHO
        return out


class Console:
    """Every host's output to ``printer`` as ``[host] line``, torchrun's failure
    traceback left out (see the module docstring). Thread-safe: each host's streams
    are read by their own threads."""

    def __init__(self, printer: Callable[[str], None]) -> None:
        self._printer = printer
        self._filters: dict[tuple[str, str], StreamFilter] = {}
        self._lock = threading.Lock()

    def echo(self, host: str, stream: str, line: str) -> None:
        with self._lock:
            shown = self._filters.setdefault((host, stream), StreamFilter()).feed(line)
        for text in shown:
            self._printer(f"[{host}] {text}")

    def flush(self) -> None:
        """Echo what is still held (a traceback cut off when the job ended)."""
        with self._lock:
            held = [(host, text) for (host, _), f in self._filters.items() for text in f.flush()]
        for host, text in held:
            self._printer(f"[{host}] {text}")
