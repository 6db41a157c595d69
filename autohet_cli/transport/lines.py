"""Line streaming shared by the local and SSH processes.

A :class:`LineLog` receives decoded lines from one pump thread per stream, hands
each to the caller's ``on_line(stream, line)`` as it arrives (calls serialised, so
the callback need not be thread-safe), keeps a bounded tail for the result and for
:meth:`LineLog.follow`, and records a callback's exception to re-raise on ``wait``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Protocol

LineCallback = Callable[[str, str], None]
"""``on_line(stream, line)``: stream is ``"stdout"`` or ``"stderr"``; no trailing newline."""

STREAMS = ("stdout", "stderr")
DEFAULT_MAX_LINES = 200_000


class ReadsLines(Protocol):
    def readline(self) -> bytes: ...


def strip_newline(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    if text.endswith("\n"):
        text = text[:-1]
        if text.endswith("\r"):
            text = text[:-1]
    return text


class LineLog:
    """Collects ``(stream, line)`` events in arrival order, keeping the newest ``max_lines``."""

    def __init__(self, on_line: LineCallback | None, *, max_lines: int = DEFAULT_MAX_LINES):
        self._on_line = on_line
        self._max_lines = max_lines
        self._cond = threading.Condition()
        self._callback_lock = threading.Lock()
        self._events: list[tuple[str, str]] = []
        self._first = 0  # absolute index of _events[0]; older lines were dropped
        self._open_streams = 0
        self.callback_error: BaseException | None = None

    def add(self, stream: str, line: str) -> None:
        with self._cond:
            self._events.append((stream, line))
            if len(self._events) > 2 * self._max_lines:
                drop = len(self._events) - self._max_lines
                del self._events[:drop]
                self._first += drop
            self._cond.notify_all()
        if self._on_line is None or self.callback_error is not None:
            return
        with self._callback_lock:
            try:
                self._on_line(stream, line)
            except Exception as exc:  # re-raised by wait(); the pump must keep draining
                self.callback_error = exc

    def pump(self, stream: str, source: ReadsLines, *, name: str) -> threading.Thread:
        """Read ``source`` line by line in a daemon thread until EOF."""
        with self._cond:
            self._open_streams += 1

        def loop() -> None:
            try:
                while raw := source.readline():
                    self.add(stream, strip_newline(raw))
            except (OSError, ValueError, EOFError):
                pass  # the pipe or channel was closed under us: the process is gone
            finally:
                with self._cond:
                    self._open_streams -= 1
                    self._cond.notify_all()

        thread = threading.Thread(target=loop, name=name, daemon=True)
        thread.start()
        return thread

    def text(self, stream: str) -> str:
        """The kept lines of one stream, each ending in a newline."""
        with self._cond:
            return "".join(line + "\n" for s, line in self._events if s == stream)

    def follow(self) -> Iterator[tuple[str, str]]:
        """Yield every kept event from the start, then new ones, until both streams end."""
        i = 0
        while True:
            with self._cond:
                while i >= self._first + len(self._events) and self._open_streams > 0:
                    self._cond.wait()
                i = max(i, self._first)
                if i >= self._first + len(self._events):
                    return
                event = self._events[i - self._first]
            i += 1
            yield event
