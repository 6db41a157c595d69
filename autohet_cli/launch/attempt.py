"""What one attempt of a plan is given, whichever backend runs it (pure data, one rule).

``launch.session`` (and recover's relaunch) prepare a plan and its cluster
(``Prepared``), say which job it checkpoints into (``JobChoice``) and how to run
it (``Attempt``); a backend (``launch.backend``) runs that. These types live
below both the session and the backends so that neither imports the other: a
backend is one module that imports downwards only.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from autohet_cli.cluster import Cluster
from autohet_cli.errors import ConfigError
from autohet_cli.launch import pathargs
from autohet_cli.launch.executor import JobOutcome, LaunchError, Printer
from autohet_cli.plan import Plan

if TYPE_CHECKING:
    from autohet_cli.launch.specs import LaunchSpec

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    plan: Plan
    plan_file: Path
    cluster: Cluster
    cluster_path: str
    remote_storage: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class JobChoice:
    """Which run namespace the built-in trainer checkpoints into (``launch.jobs``)."""

    resume: bool = False
    job: str | None = None  # None: new (or, resuming, the newest)
    key: bytes | None = None  # known already (recover): distribute it as is
    steps: int | None = None  # where training ends: resuming a job already there stops


@dataclass(frozen=True, slots=True, kw_only=True)
class Attempt:
    """How to run one attempt: the same for every backend (each ignores what it has no
    use for, or refuses it by name, as Slurm does ``--sync-dir``)."""

    train_args: Sequence[str]
    script: Sequence[str] = ()
    master_port: int | None = None  # None: a free one, found by the backend
    run_id: str | None = None
    sync_dir: Path | None = None
    start_timeout_s: float = 300.0
    runs_root: Path = Path("runs")
    printer: Printer = print
    job_choice: JobChoice = field(default_factory=JobChoice)
    stop: threading.Event | None = None  # set by the caller: stop every host


class RunningJob(Protocol):
    """What ``launch.supervise`` and ``launch.runfolder`` need of a backend's job
    (``launch.executor.Job``, ``slurm.job.SlurmJob``): its hosts' specs, start it,
    watch it to its end, stop and close it, and what it reported."""

    specs: list[LaunchSpec]
    stop_requested: threading.Event
    run_report: dict[str, Any] | None

    @property
    def started_anything(self) -> bool: ...
    def start(self) -> None: ...
    def watch(self) -> JobOutcome: ...
    def stop_all(self) -> None: ...
    def close(self) -> None: ...


def run_id_of(raw: str | None) -> str:
    """``--run-id``, checked; else the UTC second."""
    if raw is None:
        return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if not _RUN_ID.match(raw) or ".." in raw:
        raise ConfigError(
            f"--run-id {raw!r}: use letters, digits, '.', '_' and '-' only (no '/', no '..'), "
            "starting with a letter or digit"
        )
    return raw


def local_run_dir(root: Path, plan: Plan, run_id: str | None) -> tuple[Path, str]:
    """``runs/<plan>.v<N>/<run id>``, new: a given run id already used is refused; a
    default one (the UTC second) gets a suffix when two launches share a second."""
    rid = run_id_of(run_id)
    base = root / f"{plan.name}.v{plan.version}"
    base.mkdir(parents=True, exist_ok=True)
    candidate, n = rid, 1
    while True:
        try:
            (base / candidate).mkdir()  # exclusive: two launches in one second race here
            return base / candidate, candidate
        except FileExistsError:
            if run_id is not None:
                raise LaunchError(
                    f"run directory {base / candidate} already exists: a run id is used "
                    "once (old heartbeats and logs would mix with the new run); pick "
                    "another --run-id"
                ) from None
            n += 1
            candidate = f"{rid}-{n}"


def caller() -> pathargs.Caller:
    """This process's directory and home: where this machine's relative paths start."""
    return pathargs.Caller(cwd=os.getcwd(), home=os.path.expanduser("~"))


def check_sync_dir(sync_dir: Path) -> None:
    """``--sync-dir`` is read here: a missing one would sync nothing, silently."""
    if not sync_dir.is_dir():
        what = "not a directory" if sync_dir.exists() else "no such directory"
        raise ConfigError(
            f"--sync-dir {sync_dir}: {what} (read as {sync_dir.absolute()}: it is read on "
            "this machine, from the current directory); pass the folder to copy"
        )


def host_paths(
    cluster: Cluster, hosts: Sequence[str], train_args: Sequence[str], who: pathargs.Caller
) -> dict[str, pathargs.HostPaths]:
    """Each host's worker arguments with their paths as it reads them (``pathargs``)."""
    return {h: pathargs.resolve(train_args, cluster.host(h), who) for h in hosts}
