"""The launcher's side of the run folder: its record, and the lines that point at it.

Every attempt of a plan (``autohet launch``, recover's relaunch, both backends) runs
inside ``recorded``: it prints the folder, writes ``run.json`` (status ``running``)
before any worker starts and replaces it when the job ended, however it ended (an
exception too), with the status, the last step and loss (from the folder's metrics,
else from the last step line the launcher saw) and the end time. The record names
the job and the checkpoint step the run resumed from (recover names it; a plain
``--resume`` takes the newest, which the run's first logged step tells at the end):
that is what links the runs of one job (``runfiles.jobs``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from autohet_cli.errors import ConfigError
from autohet_cli.launch.jobs import resume_of
from autohet_cli.launch.specs import DEFAULT_MODULE, LaunchSpec
from autohet_cli.runfiles.metricsfile import (
    FOLDER_ENV,
    METRICS_FILE,
    STREAM_ENV,
    TAIL_BYTES,
    TENSORBOARD_DIR,
    first_train_step,
    read_series,
)
from autohet_cli.runfiles.record import RunRecord, RunRecordError, write_record

if TYPE_CHECKING:
    from autohet_cli.launch.attempt import Prepared
    from autohet_cli.launch.attempt import RunningJob as Job
    from autohet_cli.launch.executor import JobOutcome

Printer = Callable[[str], None]


@dataclasses.dataclass(slots=True)
class Recorded:
    """Set ``outcome`` once the job ended; ``recorded`` writes it into ``run.json``."""

    record: RunRecord
    outcome: JobOutcome | None = None


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def start_record(job: Job, p: Prepared, folder: Path) -> RunRecord:
    """The record of a run about to start (pure but for the clock and our pid)."""
    first = job.specs[0]
    builtin = DEFAULT_MODULE in first.argv
    job_name = _arg(first, "--job") if builtin else None
    checkpoints: dict[str, str] = {}
    remote = None
    if job_name is not None:
        for spec in job.specs:
            root = _arg(spec, "--checkpoint-dir")
            if root is not None:
                checkpoints[spec.host] = f"{root.rstrip('/')}/{p.plan.name}/{job_name}/"
        if p.remote_storage:
            remote = f"{p.remote_storage.rstrip('/')}/{p.plan.name}/{job_name}/"
    resume = resume_of(first.argv) if builtin else None
    return RunRecord(
        run_id=folder.name,
        plan=f"{p.plan.name}.v{p.plan.version}",
        plan_file=str(p.plan_file.resolve()),
        cluster=p.cluster.name,
        cluster_file=p.cluster_path,
        backend=p.cluster.backend,
        trainer="built-in" if builtin else "script",
        job=job_name,
        hosts=tuple(s.host for s in job.specs),
        checkpoints=checkpoints,
        remote_checkpoints=remote,
        started_at=now_iso(),
        launcher_host=socket.gethostname(),
        launcher_pid=os.getpid(),
        resumed_from_step=resume if isinstance(resume, int) else None,
    )


def end_record(
    record: RunRecord, outcome: JobOutcome | None, job: Job, folder: Path, error: str = ""
) -> RunRecord:
    """``record`` once the job ended: ``outcome``, or the exception that ended it."""
    try:
        series = read_series(folder / METRICS_FILE, tail_bytes=TAIL_BYTES)  # last step, loss
    except RunRecordError:  # unreadable: the record still says how the run ended
        series = None
    step, loss = (series.last_step, series.last_loss) if series and series.train else (None, None)
    status = getattr(job, "status", None)
    if step is None and status is not None and status.loss is not None:
        step, loss = status.step, status.loss  # a user script, or no metrics reached us
    resumed = record.resumed_from_step
    if resumed is None and record.trainer == "built-in" and resume_of(job.specs[0].argv):
        resumed = first_train_step(folder / METRICS_FILE)  # "the newest": it ran that first
    return dataclasses.replace(
        record,
        status=outcome.status if outcome else "failed",
        detail=outcome.detail if outcome else error or "the launcher stopped",
        exit_code=outcome.exit_code if outcome else None,
        ended_at=now_iso(),
        last_step=step,
        last_loss=loss,
        resumed_from_step=resumed,
    )


@contextmanager
def recorded(job: Job, p: Prepared, folder: Path, printer: Printer) -> Iterator[Recorded]:
    """Print the folder, record the start, and the end however the block ends.

    A start that failed before anything of the job ran anywhere (``sbatch`` refused
    the job, no host's workers started) is no run: its folder is removed instead of
    being kept as a "failed" run in ``autohet runs``; the error says what failed."""
    state = Recorded(record=start_record(job, p, folder))
    printer(start_line(folder))
    _write(folder, state.record, printer)
    error, removed = "", False
    try:
        yield state
    except KeyboardInterrupt:
        error = "interrupted (Ctrl-C)"
        raise
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        if not job.started_anything:
            shutil.rmtree(folder, ignore_errors=True)
            removed = True
            printer(f"nothing was started: run folder {folder} removed")
        raise
    finally:
        if not removed:
            _write(folder, end_record(state.record, state.outcome, job, folder, error), printer)


def _write(folder: Path, record: RunRecord, printer: Printer) -> None:
    """A record that cannot be written (a full disk) is said, not raised: the run's
    own outcome matters more."""
    try:
        write_record(folder, record)
    except ConfigError as exc:
        printer(f"note: the run record was not written: {exc}")


def start_line(folder: Path) -> str:
    return (
        f"run folder: {folder}/ (logs, {METRICS_FILE}, {TENSORBOARD_DIR}/, run.json; "
        f"the loss curve: autohet runs show {folder.name})"
    )


def end_line(folder: str | Path) -> str:
    """The last line of a launch or recover: where everything of the run is."""
    return (
        f"run folder: {folder}/ (logs: one file per host, events.json; {METRICS_FILE}, "
        f"prediction-check.json, run.json); the loss curve: autohet runs show "
        f"{Path(folder).name}"
    )


def metrics_line(first: LaunchSpec, folder: Path | None) -> str:
    """Where rank 0's metrics go (it runs on the first plan host)."""
    where = first.run_dir.replace("$HOME", "~")
    if folder is None or first.env.get(FOLDER_ENV):
        into = folder or Path(where)
        return (
            f"metrics: {into}/{METRICS_FILE}; TensorBoard (if installed): "
            f"tensorboard --logdir {into}/{TENSORBOARD_DIR}"
        )
    if first.env.get(STREAM_ENV):
        return (
            f"metrics: {folder}/{METRICS_FILE}, streamed from {first.host} (which keeps "
            f"{where}/{METRICS_FILE}); TensorBoard (if installed here): "
            f"tensorboard --logdir {folder}/{TENSORBOARD_DIR}"
        )
    return (
        f"metrics: {first.host}:{where}/{METRICS_FILE}; TensorBoard (if installed there): "
        f"tensorboard --logdir {where}/{TENSORBOARD_DIR} (on {first.host})"
    )


def _arg(spec: LaunchSpec, flag: str) -> str | None:
    argv = list(spec.argv)
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None
