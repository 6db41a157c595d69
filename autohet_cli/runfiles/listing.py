"""Runs under a runs folder: find them, summarise them, pick one by id, prefix or path.

A run is a folder ``<runs dir>/<plan>.v<N>/<run id>/`` that holds a run record, a
metrics file, an ``events.json`` or a host log (runs from before run records are
listed too, from what they have). Run ids are unique within a plan version only
(two plans launched in the same second share one), so a run is also named
``<plan>.v<N>/<run id>``. The last step and loss come from the folder's metrics
(exact, and current while the run goes on), else from the record.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autohet_cli.errors import AutohetError
from autohet_cli.pids import process_gone
from autohet_cli.runfiles.metricsfile import (
    METRICS_FILE,
    TAIL_BYTES,
    LossSeries,
    first_train_step,
    read_series,
)
from autohet_cli.runfiles.record import RECORD_FILE, RUNNING, RunRecord, RunRecordError, read_record

LATEST = "latest"
UNFINISHED = "unfinished"  # the record says running, but its launcher is gone


class RunsError(AutohetError):
    """No such run, an ambiguous name, or a run without what was asked of it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSummary:
    run_id: str
    plan: str  # "<name>.v<N>"
    folder: Path
    status: str
    started_at: str | None  # UTC ISO 8601
    ended_at: str | None = None
    last_step: int | None = None
    last_loss: float | None = None
    last_eval_loss: float | None = None
    checkpoints: dict[str, str] = field(default_factory=dict)
    remote_checkpoints: str | None = None
    detail: str = ""
    record: RunRecord | None = None
    series: LossSeries | None = None
    problem: str = ""  # why the record could not be read
    first_step: int | None = None  # the first step it logged (links a job's runs)

    @property
    def name(self) -> str:
        return f"{self.plan}/{self.run_id}"

    @property
    def job(self) -> str | None:
        """The job it ran in (the checkpoint namespace); None: a user script, or a run
        of an autohet that kept no record."""
        return self.record.job if self.record is not None else None

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "plan": self.plan,
            "name": self.name,
            "folder": str(self.folder),
            "status": self.status,
            "detail": self.detail,
            "job": self.job,
            "resumed_from_step": self.record.resumed_from_step if self.record else None,
            "first_step": self.first_step,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "last_step": self.last_step,
            "last_loss": _finite(self.last_loss),
            "last_eval_loss": _finite(self.last_eval_loss),
            "checkpoints": dict(self.checkpoints),
            "remote_checkpoints": self.remote_checkpoints,
            "metrics": str(self.folder / METRICS_FILE) if self.series is not None else None,
            "problem": self.problem or None,
        }


def summarize(
    folder: Path,
    record: RunRecord | None,
    series: LossSeries | None,
    *,
    events: dict[str, Any] | None = None,
    modified_at: str | None = None,
    launcher_alive: bool = True,
    problem: str = "",
    first_step: int | None = None,
) -> RunSummary:
    """What ``autohet runs`` shows of one folder (pure: every input is given)."""
    status = record.status if record else str((events or {}).get("status") or "unknown")
    if status == RUNNING and not launcher_alive:
        status = UNFINISHED
    step = series.last_step if series and series.train else (record.last_step if record else None)
    loss = series.last_loss if series and series.train else (record.last_loss if record else None)
    detail = record.detail if record else str((events or {}).get("detail") or "")
    return RunSummary(
        run_id=record.run_id if record else folder.name,
        plan=record.plan if record else folder.parent.name,
        folder=folder,
        status=status,
        started_at=record.started_at if record else modified_at,
        ended_at=record.ended_at if record else None,
        last_step=step,
        last_loss=loss,
        last_eval_loss=series.last_eval_loss if series else None,
        checkpoints=dict(record.checkpoints) if record else {},
        remote_checkpoints=record.remote_checkpoints if record else None,
        detail=detail,
        record=record,
        series=series,
        problem=problem,
        first_step=first_step,
    )


def checkpoints_text(run: RunSummary) -> str:
    """Where the run's checkpoints are, short: ``host:dir`` (hosts sharing a path are
    named together), then the remote copy."""
    by_dir: dict[str, list[str]] = {}
    for host, path in run.checkpoints.items():
        by_dir.setdefault(path, []).append(host)
    parts = [f"{','.join(hosts)}:{path}" for path, hosts in by_dir.items()]
    if run.remote_checkpoints:
        parts.append(f"remote {run.remote_checkpoints}")
    return "; ".join(parts) or "-"


def load_run(folder: Path, *, full: bool = False) -> RunSummary:
    """One folder's summary, read from disk; a broken record is a note, not an error.
    ``full``: the whole loss series (to plot it); else the metrics' tail only (and its
    head's first step, which links the runs of a job)."""
    problem = ""
    try:
        record = read_record(folder)
    except RunRecordError as exc:
        record, problem = None, str(exc)
    alive = True
    if record is not None and record.status == RUNNING:
        alive = _launcher_alive(record)
    try:
        series = read_series(folder / METRICS_FILE, tail_bytes=None if full else TAIL_BYTES)
    except RunRecordError as exc:
        series, problem = None, "; ".join(x for x in (problem, str(exc)) if x)
    if full:
        first = series.train[0][0] if series is not None and series.train else None
    else:
        first = first_train_step(folder / METRICS_FILE) if series is not None else None
    return summarize(
        folder,
        record,
        series,
        events=_events(folder) if record is None else None,
        modified_at=_iso(folder.stat().st_mtime),
        launcher_alive=alive,
        problem=problem,
        first_step=first,
    )


def find_runs(root: Path) -> list[RunSummary]:
    """Every run under ``root``, newest first (by start; a run without a record by the
    time its folder last changed)."""
    if not root.is_dir():
        return []
    runs = [
        load_run(folder)
        for plan_dir in root.iterdir()
        if plan_dir.is_dir()
        for folder in plan_dir.iterdir()
        if folder.is_dir() and is_run_folder(folder)
    ]
    return sorted(runs, key=lambda r: (r.started_at or "", r.name), reverse=True)


def is_run_folder(folder: Path) -> bool:
    if (folder / RECORD_FILE).is_file() or (folder / METRICS_FILE).is_file():
        return True
    return (folder / "events.json").is_file() or any(folder.glob("*.log"))


def resolve(root: Path, query: str, runs: Sequence[RunSummary] | None = None) -> RunSummary:
    """The run ``query`` names: ``latest``, a run folder's path, a run id or
    ``<plan>.v<N>/<run id>``, or a unique prefix of either."""
    path = Path(query).expanduser()
    if query != LATEST and path.is_dir() and is_run_folder(path):
        return load_run(path)
    found = list(runs) if runs is not None else find_runs(root)
    if not found:
        raise RunsError(f"no run {query!r}: {no_runs_text(root)}")
    if query == LATEST:
        return found[0]
    exact = [r for r in found if query in (r.run_id, r.name)]
    matches = exact or [r for r in found if r.run_id.startswith(query) or r.name.startswith(query)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        shown = ", ".join(r.name for r in found[:5])
        raise RunsError(
            f"no run {query!r} in {root.resolve()} (newest: {shown}); `autohet runs` lists "
            "them all; give a run id or a job id, a unique prefix of one, a run folder's path "
            "or 'latest'"
        )
    shown = ", ".join(r.name for r in matches[:8]) + (" ..." if len(matches) > 8 else "")
    raise RunsError(
        f"{query!r} names {len(matches)} runs: {shown}; give more of the id, or "
        "<plan>.v<N>/<run id>"
    )


def no_runs_text(root: Path) -> str:
    """Where we looked, and why a run may be elsewhere."""
    return (
        f"no runs in {root.resolve()}: `autohet launch` keeps each run in runs/ of the "
        "directory it was started from; run this there, or pass --runs-dir DIR"
    )


def _events(folder: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads((folder / "events.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _launcher_alive(record: RunRecord) -> bool:
    """False only when the launcher ran on this machine and its process is gone."""
    return not process_gone(record.launcher_pid, record.launcher_host)


def _iso(unix_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None
