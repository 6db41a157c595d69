"""What ``autohet runs`` prints: table rows, a run's summary and its job's, why a run
has no curve (pure)."""

from __future__ import annotations

import calendar
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tabulate import tabulate

from autohet_cli.ckpt.steptext import ran
from autohet_cli.runfiles.jobs import (
    JobCurve,
    Lineage,
    afresh_text,
    by_run,
    continued_by_text,
    continues_text,
)
from autohet_cli.runfiles.listing import RunSummary, checkpoints_text
from autohet_cli.runfiles.metricsfile import METRICS_FILE

_ENDED = {
    "failed": "failed",
    "host_lost": "lost a host",
    "interrupted": "was stopped",
    "preempted": "was preempted",
}
COLUMNS = ("run", "plan", "status", "step", "loss", "started (UTC)", "job", "checkpoints")
_ALIGN = ("left", "left", "left", "right", "right", "left", "left", "left")


def when(iso: str | None) -> str:
    """``2026-11-25T14:03:05Z`` as ``2026-11-25 14:03``; "-" when unknown."""
    return iso[:16].replace("T", " ") if iso else "-"


def loss_text(value: float | None) -> str:
    """Four decimals for a loss in the usual range (the column lines up), else four
    significant digits: a diverged run's 1e308 reads as ``1e+308``, not 309 digits."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)  # inf, -inf, nan
    return f"{value:.4f}" if value == 0 or 1e-3 <= abs(value) < 1e5 else f"{value:.4g}"


def table_row(run: RunSummary, lineage: Lineage | None = None) -> tuple[str, ...]:
    """One run as the table's cells, in ``COLUMNS`` order."""
    return (
        run.run_id,
        run.plan,
        run.status,
        "-" if run.last_step is None else str(run.last_step),
        loss_text(run.last_loss),
        when(run.started_at),
        job_cell(run, lineage),
        checkpoints_text(run),
    )


def job_cell(run: RunSummary, lineage: Lineage | None) -> str:
    """The job, and which of its runs this is when it has several: ``J (2 of 2)``."""
    if lineage is None or len(lineage.runs) < 2:
        return run.job or "-"
    at = [r.name for r in lineage.runs].index(run.name) + 1
    return f"{lineage.job} ({at} of {len(lineage.runs)})"


def table(runs: list[RunSummary], root: Path) -> str:
    """The runs as a plain table, nothing cut (ids and paths are what users copy)."""
    lineages: Mapping[str, Lineage] = by_run(runs)
    rows = [table_row(r, lineages.get(r.name)) for r in runs]
    return f"runs in {root}:\n" + tabulate(
        rows, headers=COLUMNS, disable_numparse=True, colalign=_ALIGN
    )


def duration_text(start: str | None, end: str | None) -> str:
    if not start or not end:
        return ""
    try:
        seconds = _unix(end) - _unix(start)
    except ValueError:
        return ""
    if seconds < 0:
        return ""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def summary_lines(run: RunSummary, lineage: Lineage | None = None) -> list[str]:
    """The head of ``runs show``: what ran, how it ended, where everything is, and
    the runs of its job either side (``lineage``)."""
    ended = f"{run.status}"
    if run.last_step is not None:
        ended += f" at step {run.last_step}, loss {loss_text(run.last_loss)}"
        if run.last_eval_loss is not None:
            ended += f" (validation {loss_text(run.last_eval_loss)})"
    lines = [f"run {run.run_id} of plan {run.plan}: {ended}"]
    if run.detail:
        lines.append(f"  detail: {run.detail}")
    took = duration_text(run.started_at, run.ended_at)
    span = f"  started {_clock(run.started_at)} UTC"
    if run.ended_at:
        same_day = run.started_at and run.started_at[:10] == run.ended_at[:10]
        end = _clock(run.ended_at)[11:] if same_day else _clock(run.ended_at)
        span += f", ended {end} UTC" + (f" ({took})" if took else "")
    lines += [span, f"  folder: {run.folder}/"]
    if run.job is not None:
        lines.append(f"  job: {run.job}")
    if lineage is not None:
        links = (
            continues_text(run, lineage),
            continued_by_text(run, lineage),
            afresh_text(run, lineage),
        )
        lines += [f"  {t}" for t in links if t]
    if run.checkpoints or run.remote_checkpoints:
        lines.append(f"  checkpoints: {checkpoints_text(run)}")
    if check := prediction_text(run.folder):
        lines.append(f"  {check}")
    if run.problem:
        lines.append(f"  note: {run.problem}")
    return lines


def job_lines(lineage: Lineage, curve: JobCurve) -> list[str]:
    """The head of a job's curve: each run and the steps it logged, each break."""
    steps = [s for s, _, _ in curve.train]
    span = f", {ran(min(steps), max(steps))} logged" if steps else ""
    last = f", last loss {loss_text(curve.train[-1][1])}" if curve.train else ""
    lines = [
        f"job {lineage.job} of plan {lineage.plan_name}: {len(lineage.runs)} runs{span}{last} "
        "(the curve below is the whole job's; --run-only for one run's)"
    ]
    for run in lineage.runs:
        first, end = run.first_step, run.last_step
        did = ran(first, end) if first is not None and end is not None else "no step logged"
        lines.append(f"  {run.name}: {run.status}, {did}")
    lines += [f"  break at {b.text()}" for b in curve.breaks]
    return lines


def prediction_text(folder: Path) -> str:
    """The step time against the plan's, from ``prediction-check.json`` ("" if none)."""
    try:
        check = json.loads((folder / "prediction-check.json").read_text(encoding="utf-8"))
        step: dict[str, Any] = check["step"]
        predicted, measured = step["predicted_ms"], step["measured_ms"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    if not isinstance(predicted, int | float) or not isinstance(measured, int | float):
        return ""
    ratio = f" ({predicted / measured:.2f}x)" if measured else ""
    return (
        f"step time: {predicted:.1f} ms predicted, {measured:.1f} ms measured{ratio} "
        "(prediction-check.json)"
    )


def no_metrics_text(run: RunSummary) -> str:
    """Why a run has no loss curve, and where to look instead."""
    logs = sorted(str(p) for p in run.folder.glob("*.log"))
    see = f"; see its log: {', '.join(logs)}" if logs else ""
    head = f"run {run.name} has no metrics ({run.folder / METRICS_FILE} is missing)"
    if run.record is not None and run.record.trainer == "script":
        return f"{head}: it ran a user script, and only autohet's built-in trainer writes them{see}"
    if run.record is None:
        return (
            f"{head}: a run from before run folders kept its metrics on rank 0's host, in "
            f"its workdir's runs/{run.plan}/{run.run_id}/{see}"
        )
    if run.status in ("running", "unfinished"):
        return f"{head}: it has not finished a step yet (status {run.status}){see}"
    why = f" ({run.detail})" if run.detail else ""
    if run.status == "finished":
        return f"{head}: it finished without reporting a step{why}{see}"
    if run.status == "not_started":
        return f"{head}: its workers never started{why}{see}"
    ended = _ENDED.get(run.status, f"ended ({run.status})")
    return f"{head}: it {ended} before its first step{why}{see}"


def _clock(iso: str | None) -> str:
    """``2026-11-25T14:03:05Z`` as ``2026-11-25 14:03:05``."""
    return iso[:19].replace("T", " ") if iso else "-"


def _unix(iso: str) -> float:
    return float(calendar.timegm(time.strptime(iso, "%Y-%m-%dT%H:%M:%SZ")))
