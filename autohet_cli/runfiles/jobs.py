"""The runs of one job, linked, and the job's loss curve across them (no torch; the
folders are read through ``listing``).

A job is what a user follows: ``autohet launch`` starts one (its id names the
checkpoint namespace ``<plan>/<job>/``), and each ``launch --resume`` or ``autohet
recover`` after it continues it in a run folder of its own, under a new plan
version when a recovery replanned (``runs/lab.v1/R1``, then ``runs/lab.v2/R2``).

The links are derived when read, from what each ``run.json`` says (plan name, job,
start time, the checkpoint step it resumed from) and where each run's metrics begin;
no record is rewritten when a later run continues it, so a crash can never leave two
records that disagree, and runs of older autohets link too. A run that began at
step 0 started the job afresh (``launch --job J`` without ``--resume``): the runs
before it are another attempt, a *lineage* of their own.

Merging a lineage: a run resumed from checkpoint step N ran step N first, so every
step N or later that earlier runs logged was done again, or thrown away with the
state it led to; the curve keeps the newest run's values and each break says which
steps it replaced (``ckpt.steptext`` on the two step numberings).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autohet_cli.ckpt.steptext import after, ran
from autohet_cli.runfiles.listing import (
    LATEST,
    RunsError,
    RunSummary,
    find_runs,
    is_run_folder,
)
from autohet_cli.runfiles.listing import resolve as listing_resolve
from autohet_cli.runfiles.metricsfile import LossSeries

Point = tuple[int, float, str]  # step, loss, the run (its name) that logged it
_STOPPED = ("host_lost", "preempted", "failed", "interrupted", "unfinished")


@dataclass(frozen=True, slots=True, kw_only=True)
class Lineage:
    """Runs of one job that continue each other, oldest first."""

    plan_name: str  # the plan's name, without its version
    job: str
    runs: tuple[RunSummary, ...]
    earlier: tuple[RunSummary, ...] = ()  # the job's runs before a fresh start

    @property
    def name(self) -> str:
        return f"{self.plan_name}/{self.job}"

    def before(self, run: RunSummary) -> RunSummary | None:
        i = self._index(run)
        return self.runs[i - 1] if i > 0 else None

    def after(self, run: RunSummary) -> RunSummary | None:
        i = self._index(run)
        return self.runs[i + 1] if i + 1 < len(self.runs) else None

    def _index(self, run: RunSummary) -> int:
        return [r.name for r in self.runs].index(run.name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Break:
    """Where one run ended and the next went on, from checkpoint ``step``."""

    step: int  # the checkpoint step the next run loaded: the first step it ran
    ended: str  # the run before (its name)
    resumed: str  # the run that went on
    replaced: tuple[int, int] | None  # logged steps >= step of earlier runs, superseded

    def text(self) -> str:
        out = f"step {self.step}: {self.resumed} resumed from checkpoint step {self.step}"
        out += f" ({after(self.step)}) where {self.ended} ended"
        if self.replaced is not None:
            out += f"; {ran(*self.replaced)} logged before were replaced by its values"
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "ended": self.ended,
            "resumed": self.resumed,
            "replaced_steps": None if self.replaced is None else list(self.replaced),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class JobCurve:
    train: tuple[Point, ...]
    eval: tuple[Point, ...]
    breaks: tuple[Break, ...]

    @property
    def series(self) -> LossSeries:
        return LossSeries(
            train=tuple((s, v) for s, v, _ in self.train),
            eval=tuple((s, v) for s, v, _ in self.eval),
        )

    def to_json(self) -> dict[str, Any]:
        as_json = self.series.to_json()  # NaN as null, as a run's series
        for key, points in (("train", self.train), ("eval", self.eval)):
            for row, (_, _, run) in zip(as_json[key], points, strict=True):
                row["run"] = run
        return {**as_json, "breaks": [b.to_json() for b in self.breaks]}


def plan_name(plan: str) -> str:
    """``lab.v2`` -> ``lab``: a recovery's new plan version keeps the job."""
    base, dot_v, version = plan.rpartition(".v")
    return base if dot_v and version.isdigit() else plan


def resumed_from(run: RunSummary) -> int | None:
    """The step ``run`` began at: 0 afresh, else the checkpoint's step; its record's,
    else its first logged step; None when neither says."""
    if run.record is not None and run.record.resumed_from_step is not None:
        return run.record.resumed_from_step
    return run.first_step


def lineages(runs: Iterable[RunSummary]) -> list[Lineage]:
    """Every lineage of every job, each with the job's runs before it (``earlier``)."""
    by_job: dict[tuple[str, str], list[RunSummary]] = {}
    for run in runs:
        if run.job is not None:
            by_job.setdefault((plan_name(run.plan), run.job), []).append(run)
    out = []
    for (plan, job), members in by_job.items():
        members.sort(key=lambda r: (r.started_at or "", r.name))
        for group in _split(members):
            out.append(Lineage(plan_name=plan, job=job, runs=tuple(group[1]), earlier=group[0]))
    return out


def _split(members: list[RunSummary]) -> list[tuple[tuple[RunSummary, ...], list[RunSummary]]]:
    """(runs before, lineage) for each lineage: a run that began at step 0 starts one."""
    groups: list[list[RunSummary]] = []
    for run in members:
        if not groups or resumed_from(run) == 0:
            groups.append([run])
        else:
            groups[-1].append(run)
    done: list[RunSummary] = []
    out = []
    for group in groups:
        out.append((tuple(done), group))
        done += group
    return out


def by_run(runs: Iterable[RunSummary]) -> dict[str, Lineage]:
    """Each run's lineage, by the run's name (runs without a job have none)."""
    return {run.name: ln for ln in lineages(runs) for run in ln.runs}


def resolve(root: Path, query: str) -> tuple[RunSummary, Lineage | None]:
    """The run ``query`` names, and its lineage. A job id (``J`` or ``<plan>/J``)
    names its newest run; a run id, a run's name, a folder or ``latest`` as
    ``listing.resolve``; a prefix names a run first, else a job."""
    path = Path(query).expanduser()
    folder = query != LATEST and path.is_dir() and is_run_folder(path)
    runs = find_runs(path.resolve().parent.parent if folder else root)
    exact_run = any(query in (r.run_id, r.name) for r in runs)
    if not (folder or exact_run or query == LATEST):
        job = find_job(query, runs, prefix=False)
        if job is not None:
            return job.runs[-1], job
    try:
        run = listing_resolve(root, query, runs)
    except RunsError:
        job = find_job(query, runs, prefix=True)
        if job is None:
            raise
        return job.runs[-1], job
    if not any(r.name == run.name for r in runs):
        runs.append(run)
    return run, by_run(runs).get(run.name)


def find_job(query: str, runs: Sequence[RunSummary], *, prefix: bool) -> Lineage | None:
    """The lineage a job id names (``J`` or ``<plan>/J``; ``prefix``: or a unique
    prefix of one): the newest one when the job started afresh; None when no job
    matches."""
    found = [ln for ln in lineages(runs) if query in (ln.job, ln.name)]
    if not found and prefix:
        found = [ln for ln in lineages(runs) if ln.job.startswith(query)]
    names = sorted({ln.name for ln in found})
    if len(names) > 1:
        raise RunsError(f"{query!r} names {len(names)} jobs: {', '.join(names)}; give <plan>/<job>")
    return max(found, key=lambda ln: ln.runs[-1].started_at or "") if found else None


def merge(lineage: Lineage) -> JobCurve:
    """The lineage's loss curve, newest values kept, breaks marked (see above)."""
    train: dict[int, tuple[float, str]] = {}
    evals: dict[int, tuple[float, str]] = {}
    breaks: list[Break] = []
    for before, run in zip((None, *lineage.runs), lineage.runs, strict=False):
        start = resumed_from(run)
        if before is not None and start is not None:
            gone = sorted({s for s in train if s >= start} | {s for s in evals if s >= start})
            for points in (train, evals):
                for step in [s for s in points if s >= start]:
                    del points[step]
            replaced = (gone[0], gone[-1]) if gone else None
            breaks.append(Break(step=start, ended=before.name, resumed=run.name, replaced=replaced))
        if run.series is not None:
            train.update((s, (v, run.name)) for s, v in run.series.train)
            evals.update((s, (v, run.name)) for s, v in run.series.eval)
    return JobCurve(
        train=tuple((s, v, r) for s, (v, r) in sorted(train.items())),
        eval=tuple((s, v, r) for s, (v, r) in sorted(evals.items())),
        breaks=tuple(breaks),
    )


def continued_by_text(run: RunSummary, lineage: Lineage) -> str:
    """``continued by lab.v2/R2 (recovered into plan lab.v2 from checkpoint step 50,
    after step 49)``; "" for the lineage's newest run."""
    nxt = lineage.after(run)
    if nxt is None:
        return ""
    how = "resumed"
    if nxt.plan != run.plan:
        how = f"recovered into plan {nxt.plan}" if run.status in _STOPPED else f"on plan {nxt.plan}"
    start = resumed_from(nxt)
    if start is not None and start > 0:
        how += f" from checkpoint step {start}, {after(start)}"
    return f"continued by {nxt.name} ({how})"


def continues_text(run: RunSummary, lineage: Lineage) -> str:
    """``continues lab.v1/R1 (host_lost at step 59)``; "" for the lineage's first run."""
    prev = lineage.before(run)
    if prev is None:
        return ""
    ended = prev.status + ("" if prev.last_step is None else f" at step {prev.last_step}")
    return f"continues {prev.name} ({ended})"


def afresh_text(run: RunSummary, lineage: Lineage) -> str:
    """For the first run of a lineage after others of its job: those are another
    curve, not this run's past, and ``runs show`` would not show them otherwise."""
    if not lineage.earlier or lineage.runs[0].name != run.name:
        return ""
    gone = lineage.earlier[-1].name
    return (
        f"began job {lineage.job} afresh at step 0 after {gone}: the job's earlier runs "
        f"are another curve (autohet runs show {gone})"
    )


def link_json(run: RunSummary, lineage: Lineage | None) -> dict[str, Any]:
    """The links ``--json`` adds to a run: its job's name and the runs either side."""
    if lineage is None:
        return {"job_name": None, "continues": None, "continued_by": None}
    prev, nxt = lineage.before(run), lineage.after(run)
    return {
        "job_name": lineage.name,
        "continues": prev.name if prev is not None else None,
        "continued_by": nxt.name if nxt is not None else None,
    }
