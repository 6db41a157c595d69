"""What ``autohet runs show`` shows: one run, or its whole job's curve (pure but reads).

A run that continues another (a recovery, a ``--resume``) holds only its own steps;
what a user follows is the job, so a run with others in its lineage is shown with the
job's merged curve (``runfiles.jobs``), unless only the run is asked for. The PNG goes
into the shown run's folder: ``loss.png`` for the run's curve, ``job-loss.png`` for
the job's, so neither replaces the other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autohet_cli.runfiles import describe, jobs
from autohet_cli.runfiles.listing import RunSummary, load_run
from autohet_cli.runfiles.metricsfile import LossSeries
from autohet_cli.runfiles.plot import terminal_plot, write_png

RUN_PNG, JOB_PNG = "loss.png", "job-loss.png"


@dataclass(frozen=True, slots=True, kw_only=True)
class View:
    run: RunSummary  # its whole series
    lineage: jobs.Lineage | None
    curve: jobs.JobCurve | None = None  # the job's, when shown

    @property
    def series(self) -> LossSeries | None:
        return self.curve.series if self.curve is not None else self.run.series

    @property
    def has_points(self) -> bool:
        return self.series is not None and bool(self.series.train or self.series.eval)

    @property
    def png_path(self) -> Path:
        return self.run.folder / (JOB_PNG if self.curve is not None else RUN_PNG)

    @property
    def title(self) -> str:
        if self.curve is not None and self.lineage is not None:
            return f"job {self.lineage.name} ({len(self.lineage.runs)} runs)"
        return f"{self.run.plan} {self.run.run_id}"

    def plot_text(self) -> str:
        assert self.series is not None
        return terminal_plot(self.series, breaks=[b.step for b in self._breaks])

    def write_png(self) -> Path:
        """The curve as a PNG in the run's folder; ``RunsError`` if it cannot be written."""
        assert self.series is not None
        marks = [(b.step, b.resumed) for b in self._breaks]
        spans = [b.replaced for b in self._breaks if b.replaced is not None]
        return write_png(self.series, self.png_path, title=self.title, breaks=marks, replaced=spans)

    @property
    def _breaks(self) -> tuple[jobs.Break, ...]:
        return self.curve.breaks if self.curve is not None else ()

    def head(self) -> list[str]:
        """The summary printed above the curve."""
        lines = describe.summary_lines(self.run, self.lineage)
        if self.curve is not None and self.lineage is not None:
            lines += describe.job_lines(self.lineage, self.curve)
        return lines

    def to_json(self, png: str | None) -> dict[str, Any]:
        out = {**self.run.to_json(), **jobs.link_json(self.run, self.lineage)}
        if self.curve is None or self.lineage is None:
            series = self.run.series.to_json() if self.run.series else {"train": [], "eval": []}
            return {**out, **series, "png": png}
        runs = [{**r.to_json(), **jobs.link_json(r, self.lineage)} for r in self.lineage.runs]
        return {**out, "job_runs": runs, **self.curve.to_json(), "png": png}


def load_view(root: Path, query: str, *, run_only: bool = False) -> View:
    """The run ``query`` names (``jobs.resolve``), with every series read whole, and
    its job's curve when the job has several runs and ``run_only`` is not set."""
    named, lineage = jobs.resolve(root, query)
    run = load_run(named.folder, full=True)
    if lineage is None or len(lineage.runs) < 2 or run_only:
        return View(run=run, lineage=lineage)
    whole = tuple(
        run if r.name == run.name else load_run(r.folder, full=True) for r in lineage.runs
    )
    lineage = dataclasses.replace(lineage, runs=whole)
    return View(run=run, lineage=lineage, curve=jobs.merge(lineage))
