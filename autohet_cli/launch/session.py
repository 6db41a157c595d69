"""`autohet launch` as a domain object: prepare, dry-run or run, and say what happened.

The command (cli/launch.py) only parses options into a ``LaunchRequest`` and
prints; everything a launch does is here, so recover's relaunch and the tests
use exactly the same path:

1. load the plan and its cluster, refuse a changed cluster file (unless forced);
2. (dry run: build the specs with no I/O and print them, runnable as printed);
3. sync ``--sync-dir``, then the preflight on every host (interpreter, torch,
   autohet, home directory, a free rendezvous port on the master host) and what
   ``--init-from`` and ``--data`` hold there (``inputcheck``); ``--dry-run`` runs
   these checks too, after printing (``dry_check``), through the backend;
4. announce where checkpoints go, start torchrun on every host, watch, judge
   (``triage``), stop; a lost host yields the ``autohet recover`` command.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from autohet_cli.ckpt.format import remote_root
from autohet_cli.ckpt.retention import DEFAULT_KEEP
from autohet_cli.cluster import load_cluster
from autohet_cli.defaults import resolve_cluster_path
from autohet_cli.errors import ConfigError, PlanError
from autohet_cli.launch import jobs
from autohet_cli.launch.attempt import (
    Attempt,
    JobChoice,
    Prepared,
    caller,
    check_sync_dir,
    host_paths,
    run_id_of,
)
from autohet_cli.launch.backend import backend_for
from autohet_cli.launch.executor import JobOutcome, Printer
from autohet_cli.plan import Plan, check_against_cluster, load_plan
from autohet_cli.runtime.train_args import check_flags
from autohet_cli.slurmconf import backend_from
from autohet_cli.transport.pool import ConnectOptions, HostPool
from autohet_cli.yamlio import sha256_file

# Names that moved below the session (``launch.attempt``), importable from here too.
__all__ = ["JobChoice", "Prepared", "caller", "check_sync_dir", "host_paths"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchRequest:
    plan_file: Path
    cluster: str | None = None
    steps: int = 100
    checkpoint_every: str = "auto"
    keep_checkpoints: int = DEFAULT_KEEP
    train_args: tuple[str, ...] = ()
    script: tuple[str, ...] = ()
    master_port: int | None = None  # None: a free port on the master host
    run_id: str | None = None
    sync_dir: Path | None = None
    force: bool = False
    connect: ConnectOptions = field(default_factory=ConnectOptions)
    start_timeout_s: float = 300.0
    runs_root: Path = Path("runs")
    resume: bool = False  # continue a job (the newest, or --job) from its newest checkpoint
    job: str | None = None
    init_from: str | None = None  # a HuggingFace model directory present on every host
    backend: str | None = None  # None: the cluster file's (ssh unless it says slurm)


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchResult:
    outcome: JobOutcome
    recover_command: str | None  # only when a host was lost and another survives
    # Every host of the cluster left: resume there (or anywhere) once they are back.
    resume_command: str | None = None


def resolve_cluster(plan: Plan, cluster: str | None) -> str:
    """``--cluster``, else the plan's own cluster file, else the embedded localhost.

    The plan keeps its cluster path as ``autohet plan`` was given it: a relative one
    is read from the current directory, so a launch or recover from elsewhere says
    so and how to point at the file (the launch ended in a FileNotFoundError)."""
    path = resolve_cluster_path(cluster or plan.inputs.get("cluster", {}).get("path"))
    if not cluster and not path.is_absolute() and not path.exists():
        raise ConfigError(
            f"{path}: file not found (plan {plan.name}.v{plan.version}'s cluster file, "
            f"named relative to where it was planned; read from {Path.cwd()}): run from "
            "the directory you planned in, or pass --cluster PATH"
        )
    return str(path)


def prepare(
    plan_file: Path, cluster: str | None, *, force: bool = False, backend: str | None = None
) -> Prepared:
    plan = load_plan(plan_file)
    cluster_path = resolve_cluster(plan, cluster)
    cl = load_cluster(cluster_path)  # its errors name the file (a --cluster typo)
    _check_fingerprint(plan, plan_file, cluster_path, force)
    if backend is not None:
        cl = dataclasses.replace(cl, backend=backend_from(backend, "--backend"))
    check_against_cluster(
        plan, {h.name: (h.gpu_type, h.num_gpus) for h in cl.hosts}, str(plan_file)
    )
    return Prepared(
        plan=plan,
        plan_file=plan_file,
        cluster=cl,
        cluster_path=cluster_path,
        remote_storage=remote_root(cl.remote_storage, os.environ),
    )


def worker_args(req: LaunchRequest) -> list[str]:
    """The built-in trainer's arguments: ours first, so ``--train-arg`` can override."""
    resume = ["--resume"] if req.resume else []
    init = [f"--init-from={req.init_from}"] if req.init_from else []
    return [
        f"--steps={req.steps}",
        f"--checkpoint-every={req.checkpoint_every}",
        f"--keep-checkpoints={req.keep_checkpoints}",
        *resume,
        *init,
        *req.train_args,
    ]


def check_worker_flags(req: LaunchRequest) -> None:
    """Refuse the built-in trainer's flags as its workers would, before any host is
    asked (``runtime.train_args``): one line in a second instead of argparse's usage
    on every worker. A user script's own arguments are its own."""
    if not req.script:
        check_flags(worker_args(req))


def dry_run(req: LaunchRequest) -> str:
    """Every host's exact command, with no I/O; pasted into a shell on the host it runs.
    On Slurm: the complete batch script, as it would be written and submitted."""
    check_worker_flags(req)
    p = prepare(req.plan_file, req.cluster, force=req.force, backend=req.backend)
    rid = run_id_of(req.run_id)
    job = None if req.script else (req.job or jobs.new_job_id(jobs.stamp_of(rid)))
    return backend_for(p.cluster.backend).dry_run_text(p, _attempt(req, rid), job, caller())


def dry_check(req: LaunchRequest) -> list[str]:
    """The launch's checks for ``req``, read only (``--dry-run`` after printing): the
    lines to show; raises the launch's own error where the launch would refuse."""
    check_worker_flags(req)
    p = prepare(req.plan_file, req.cluster, force=req.force, backend=req.backend)
    attempt = _attempt(req, run_id_of(req.run_id))
    return backend_for(p.cluster.backend).check(p, attempt, req.connect, caller())


def _attempt(req: LaunchRequest, run_id: str) -> Attempt:
    return Attempt(
        train_args=worker_args(req),
        script=req.script,
        master_port=req.master_port,
        run_id=run_id,
        sync_dir=req.sync_dir,
        start_timeout_s=req.start_timeout_s,
        runs_root=req.runs_root,
        job_choice=JobChoice(resume=req.resume, job=req.job),
    )


def launch(req: LaunchRequest, printer: Printer) -> LaunchResult:
    """Run the plan to its end (or its failure); Ctrl-C/SIGTERM stop every host."""
    check_worker_flags(req)
    p = prepare(req.plan_file, req.cluster, force=req.force, backend=req.backend)
    train_args = worker_args(req)
    with HostPool(p.cluster, req.connect) as pool:
        outcome = run_job(
            p,
            pool,
            train_args=train_args,
            script=req.script,
            master_port=req.master_port,
            run_id=req.run_id,
            sync_dir=req.sync_dir,
            start_timeout_s=req.start_timeout_s,
            runs_root=req.runs_root,
            printer=printer,
            job_choice=JobChoice(resume=req.resume, job=req.job, steps=jobs.steps_of(train_args)),
        )
    hint, resume = next_commands(req, p.plan, outcome)
    return LaunchResult(outcome=outcome, recover_command=hint, resume_command=resume)


def next_commands(
    req: LaunchRequest, plan: Plan, outcome: JobOutcome
) -> tuple[str | None, str | None]:
    """What to run after a job stopped: ``(recover, resume)``, at most one of them.

    ``autohet recover`` when a host of the *plan* survives; else ``autohet launch
    --resume`` (not for a user script), for when the hosts answer again. Recover
    needs a surviving host of the plan: the job's key and checkpoints are on those
    hosts, and a host that is only in the cluster file has neither. Neither for a
    failure that running on fewer hosts would not heal.
    """
    if not outcome.recoverable:
        return None, None
    if survivors(plan.hosts(), outcome.lost_hosts):
        # With the training options: a recover without --data/--config would resume
        # on other data (refused) or another learning-rate schedule.
        return shlex.join(["autohet", *recover_argv(req, outcome.lost_hosts, full=True)]), None
    if req.script:
        return None, None
    return None, shlex.join(["autohet", *resume_argv(req)])


def survivors(hosts: Sequence[str], lost: Sequence[str]) -> list[str]:
    """The plan's hosts that were not lost (recover needs one of them)."""
    return [h for h in hosts if h not in set(lost)]


def resume_argv(req: LaunchRequest) -> list[str]:
    """``launch PLAN --resume`` with the training options: the same run, same hosts."""
    argv = ["launch", str(req.plan_file)]
    if req.cluster:
        argv += ["--cluster", req.cluster]
    if req.backend:
        argv += ["--backend", req.backend]
    argv += ["--resume", *(["--job", req.job] if req.job else [])]
    argv += ["--steps", str(req.steps), "--checkpoint-every", req.checkpoint_every]
    argv += ["--keep-checkpoints", str(req.keep_checkpoints)]
    argv += req.connect.argv()
    argv += [f"--train-arg={a}" for a in req.train_args]
    return argv


def recover_argv(req: LaunchRequest, lost: Sequence[str], *, full: bool = False) -> list[str]:
    """``recover PLAN [--cluster C] --lost H`` (``full``: with the training options too)."""
    argv = ["recover", str(req.plan_file)]
    if req.cluster:
        argv += ["--cluster", req.cluster]
    if req.backend:
        argv += ["--backend", req.backend]
    argv += ["--lost", ",".join(lost), *(["--job", req.job] if req.job else [])]
    argv += req.connect.argv()
    if full:  # what --auto-recover runs: it recovers from later waves too
        argv += ["--auto-recover"]
        argv += ["--steps", str(req.steps), "--checkpoint-every", req.checkpoint_every]
        argv += ["--keep-checkpoints", str(req.keep_checkpoints)]
        argv += [f"--train-arg={a}" for a in req.train_args]
    return argv


def run_job(
    p: Prepared,
    pool: HostPool,
    *,
    train_args: Sequence[str],
    script: Sequence[str] = (),
    master_port: int | None = None,
    run_id: str | None = None,
    sync_dir: Path | None = None,
    start_timeout_s: float = 300.0,
    runs_root: Path = Path("runs"),
    printer: Printer = print,
    job_choice: JobChoice | None = None,
    stop: threading.Event | None = None,
) -> JobOutcome:
    """Sync, preflight, job and key, announce, start, watch, stop: one attempt of a plan,
    by the backend the cluster file names (``launch.backend``).

    ``stop``: set by the caller to stop every host (Ctrl-C and SIGTERM do the same
    when this runs in the main thread)."""
    attempt = Attempt(
        train_args=train_args,
        script=script,
        master_port=master_port,
        run_id=run_id,
        sync_dir=sync_dir,
        start_timeout_s=start_timeout_s,
        runs_root=runs_root,
        printer=printer,
        job_choice=job_choice or JobChoice(),
        stop=stop,
    )
    return backend_for(p.cluster.backend).run(p, pool, attempt)


def _check_fingerprint(plan: Plan, plan_file: Path, cluster_path: str, force: bool) -> None:
    want = plan.inputs.get("cluster", {}).get("sha256")
    if not want or force:
        return
    have = sha256_file(cluster_path)
    if have != want:
        raise PlanError(
            f"{plan_file}: made for a cluster file with sha256 {want[:12]}…, but "
            f"{cluster_path} now has {have[:12]}…; re-plan (autohet plan) or pass --force"
        )
