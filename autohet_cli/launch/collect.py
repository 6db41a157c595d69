"""The run folder's metrics when rank 0 runs on another machine: collected from its output.

Rank 0 on a remote host prints each metrics line after ``METRIC_PREFIX``
(``runfiles.metricsfile``); the launcher reads that host's output anyway (its log), and
appends the lines to the run folder's ``metrics.jsonl`` and TensorBoard events as
they come. Why the stream and not a copy of the host's file at the end: a copy
needs the host to answer when the run ends, and the run that most needs its curve
read, one whose host was lost, would have none; the streamed lines arrive with the
steps, over the connection already open, and are there up to the last step the
host reported. The host keeps its own ``metrics.jsonl`` as before.

TensorBoard events are written with tensorboard's own event writer (no torch in
the launcher) when tensorboard is installed here; otherwise JSON lines only.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from autohet_cli.runfiles.metricsfile import METRICS_FILE, TENSORBOARD_DIR, tb_scalars


class MetricsCollector:
    """Appends streamed metrics lines to ``folder``; safe from several threads."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / METRICS_FILE
        self.tensorboard_dir = folder / TENSORBOARD_DIR
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        self._events: _Events | None = None
        self._events_tried = False
        self.failed = ""  # why the folder could not be written (then lines are dropped)

    def add(self, payload: str) -> None:
        """One streamed line (after its prefix); anything but a metrics object is ignored."""
        try:
            record = json.loads(payload)
        except ValueError:
            return
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            return
        with self._lock:
            if self.failed:
                return
            try:
                if self._file is None:
                    self._file = self.path.open("a", encoding="utf-8")
                self._file.write(payload.strip() + "\n")
                self._file.flush()
            except OSError as exc:
                self.failed = f"{self.path}: {exc.strerror or exc}"
                return
            self._tensorboard(record)

    def _tensorboard(self, record: dict[str, Any]) -> None:
        if not self._events_tried:
            self._events_tried = True
            self._events = _Events.open(self.tensorboard_dir)
        if self._events is not None:
            for tag, value in tb_scalars(record):
                self._events.add(tag, value, int(record["step"]))

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._events is not None:
                self._events.close()
                self._events = None


class _Events:
    """Scalars into a TensorBoard event file, as torch's SummaryWriter writes them."""

    def __init__(self, writer: Any, event: Any, summary: Any) -> None:
        self._writer, self._event, self._summary = writer, event, summary

    @classmethod
    def open(cls, logdir: Path) -> _Events | None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:  # an optional extra: metrics.jsonl alone
            return None
        try:
            return cls(EventFileWriter(str(logdir)), Event, Summary)
        except OSError:
            return None

    def add(self, tag: str, value: float, step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value)])
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self._writer.close()
