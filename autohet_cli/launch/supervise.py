"""What every backend does around a running job: announce, watch, stop, compare.

A backend (``launch.backend``) builds and starts its hosts its own way (SSH and
torchrun, or one Slurm batch job), then hands the job to ``supervise``: Ctrl-C
and SIGTERM stop every host, the run folder records the start and the end, and
the run is compared with its plan. The lines that say where checkpoints and
metrics go are the same for every backend too.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from autohet_cli.ckpt.notice import notice_warnings
from autohet_cli.ckpt.policy import checkpoint_every_of, describe_every, saves_anything
from autohet_cli.ckpt.retention import describe_keep, keep_of
from autohet_cli.cluster import Cluster
from autohet_cli.launch import compare, runfolder
from autohet_cli.launch.attempt import Prepared, RunningJob
from autohet_cli.launch.executor import JobOutcome, Printer
from autohet_cli.launch.specs import LaunchSpec
from autohet_cli.runtime.agent import REPEAT_WINDOW_S


def supervise(
    job: RunningJob,
    p: Prepared,
    local_dir: Path,
    printer: Printer,
    stop: threading.Event | None,
    cleanup: Callable[[], None] | None = None,
) -> JobOutcome:
    """Start, watch and always stop ``job`` (any backend); Ctrl-C/SIGTERM or ``stop``
    stop it. ``cleanup`` runs after the stop, whatever happened. Then the run is
    compared with its plan. The run folder's ``run.json`` records its start and end
    however it ends (``runfolder``)."""
    with runfolder.recorded(job, p, local_dir, printer) as run:
        outcome = _supervise(job, p, local_dir, printer, stop, cleanup)
        run.outcome = outcome
    return outcome


def _supervise(
    job: RunningJob,
    p: Prepared,
    local_dir: Path,
    printer: Printer,
    stop: threading.Event | None,
    cleanup: Callable[[], None] | None,
) -> JobOutcome:
    if stop is not None:
        job.stop_requested = stop
    with stop_on_signals(job.stop_requested, getattr(job, "kill_requested", None), job):
        try:
            job.start()
            outcome = job.watch()
        finally:
            job.stop_all()
            job.close()
            if cleanup is not None:
                cleanup()
    if job.run_report is not None:
        check_against_plan(p, job.run_report, local_dir, printer)
    return outcome


def check_against_plan(
    p: Prepared, report: dict[str, Any], local_dir: Path, printer: Printer
) -> None:
    """Print and keep (``prediction-check.json``) the run against its plan."""
    try:
        ranks = report.get("ranks") or [{}]
        sends = compare.link_send_ms(p.plan, p.cluster, ranks[0].get("device"))
        links = compare.shard_links(p.plan, p.cluster)
        check = compare.compare(p.plan, report, sends, links)
        check["plan_file"] = str(p.plan_file.resolve())
    except (KeyError, TypeError, ValueError) as exc:  # a report from another version
        printer(f"note: the run report could not be compared with the plan: {exc}")
        return
    (local_dir / "run-report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    (local_dir / "prediction-check.json").write_text(json.dumps(check, indent=1), encoding="utf-8")
    printer(compare.render(check))
    printer(
        f"(kept in {local_dir}/prediction-check.json; `autohet profile calibrate {local_dir} "
        "--profile P --out P2` refits a profile from it)"
    )


def announce_checkpoints(
    specs: Sequence[LaunchSpec],
    train_args: Sequence[str],
    p: Prepared,
    printer: Printer,
    measured: Mapping[str, float] | None = None,
) -> None:
    """Where checkpoints go and when; spot hosts whose save (``measured``: the job's
    last, per host; else estimated) would not fit a preemption notice."""
    every = checkpoint_every_of(train_args)
    emergency = "--no-emergency-save" not in train_args
    if emergency:
        is_spot = _spot_test(p.cluster)
        for warning in notice_warnings(p.plan, is_spot, measured_s=measured):
            printer(warning)
    if not saves_anything(every, emergency=emergency):
        printer(f"checkpoints: {describe_every(every, emergency=emergency)}")
        return
    where = ", ".join(
        f"{s.host}:{s.argv[s.argv.index('--checkpoint-dir') + 1]}/{p.plan.name}/"
        f"{s.argv[s.argv.index('--job') + 1]}/"
        for s in specs
    )
    remote = p.remote_storage or (
        "none (set remote_storage in the cluster file: a shard whose every host copy is "
        "lost cannot be recovered without one)"
    )
    keep = describe_keep(keep_of(train_args))
    what = describe_every(every, emergency=emergency)
    printer(f"checkpoints: {what}; {keep}; in {where}; remote copy: {remote}")


def _spot_test(cluster: Cluster) -> Callable[[str], bool]:
    """Hosts that get preemption notices: ``spot: true`` or a preemption check."""
    spot = {h.name for h in cluster.hosts if h.spot or h.preemption_check is not None}
    return lambda name: name in spot


def announce_metrics(first: LaunchSpec, printer: Printer, folder: Path | None = None) -> None:
    """Rank 0 runs on the first plan host; its metrics reach the run folder (``runfolder``)."""
    printer(runfolder.metrics_line(first, folder))


@contextmanager
def stop_on_signals(
    event: threading.Event, again: threading.Event | None = None, job: object = None
) -> Iterator[None]:
    """Ctrl-C and SIGTERM ask the job to stop every host (main thread only); a second
    one sets ``again`` (stop at once, without waiting for the workers' save). The
    first signal's number goes to ``job.stop_signal``: a SIGTERM is this machine
    shutting down (the launcher shares a spot VM with its workers), a preemption."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    first: list[float] = []

    def on_signal(number: int, _frame: object) -> None:
        now = time.monotonic()
        if not event.is_set():
            first.append(now)
            if job is not None and hasattr(job, "stop_signal"):
                job.stop_signal = number
            event.set()
        elif number == signal.SIGTERM and first and now - first[0] <= REPEAT_WINDOW_S:
            return  # a shutdown signalling again: the same notice (runtime.agent's rule)
        elif again is not None:
            again.set()

    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in old:
        signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
