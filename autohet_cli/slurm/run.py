"""``autohet launch`` (and recover's relaunch) on Slurm: one attempt of a plan (effects).

The same steps as the SSH backend (``launch.ssh_backend``), Slurm's way:

1. the run directory ``runs/<plan>/<run id>`` (absolute) must be on a file
   system the nodes share with this machine, as home and project directories
   are on Slurm clusters: the batch script, the nodes' output, heartbeats and
   exit codes meet there. Before anything is written, Slurm's commands and a
   folder that is not node-local are checked (``slurm.precheck``);
2. the job (checkpoint namespace) and its key: a new one, or, resuming, the one
   ``--job`` names (or the newest found here when checkpoints are on a shared
   file system too); the key goes into the run directory (0600) and each node
   copies it into its checkpoint directory if it has none;
3. the batch script (``slurm.script``) is written and submitted; the job is
   followed, judged and cancelled by ``slurm.job.SlurmJob``.

No preflight and no ``--sync-dir``: the nodes cannot be reached before the job
runs. A missing interpreter or torch shows up as the nodes' first output.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autohet_cli.ckpt.format import new_key
from autohet_cli.cluster import Cluster
from autohet_cli.launch import jobs
from autohet_cli.launch.attempt import Attempt, Prepared, local_run_dir
from autohet_cli.launch.executor import JobOutcome, LaunchError, Printer
from autohet_cli.launch.specs import LaunchOptions, LaunchSpec, build_launch_specs
from autohet_cli.launch.supervise import announce_checkpoints, announce_metrics, supervise
from autohet_cli.plan import Plan
from autohet_cli.slurm import precheck
from autohet_cli.slurm.job import SlurmJob
from autohet_cli.slurm.script import KEY_NAME, SCRIPT_NAME, check_run_dir, render
from autohet_cli.transport.base import Runner
from autohet_cli.transport.local import LocalRunner
from autohet_cli.transport.pool import ConnectOptions, HostPool

# Static rendezvous on a node we cannot look at first: a random port in a range
# that Linux does not hand out as ephemeral ports (32768-60999), printed, and
# fixed with --master-port where a site reserves one. The master node checks it
# before torchrun starts (``slurm.nodeport``).
PORT_RANGE = (20000, 32000)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmLaunch:
    specs: list[LaunchSpec]
    script: str
    run_dir: Path
    job: str | None


def build(
    plan: Plan,
    cluster: Cluster,
    *,
    run_dir: Path,
    run_id: str,
    master_port: int | None,
    script: Sequence[str],
    train_args: Sequence[str],
    remote_storage: str | None,
    job: str | None,
) -> SlurmLaunch:
    """Specs and batch script (pure: ``--dry-run`` prints exactly what would run)."""
    port = master_port if master_port is not None else random.randint(*PORT_RANGE)
    options = LaunchOptions(
        run_id=run_id,
        master_port=port,
        script=script,
        train_args=train_args,
        remote_storage=remote_storage,
        job=job,
        shared_run_dir=str(run_dir),
        gpus_from_scheduler=True,
    )
    specs = build_launch_specs(plan, cluster, options)
    text = render(
        plan, cluster, specs, run_dir=str(run_dir), job=job, port_fixed=master_port is not None
    )
    return SlurmLaunch(specs=specs, script=text, run_dir=run_dir, job=job)


class LocalPool(HostPool):
    """Every host read on this machine: for checkpoint directories on a shared file
    system, where the login node sees what the nodes wrote."""

    def runner(self, name: str) -> Runner:
        return LocalRunner(name)

    def home(self, name: str) -> str:
        return os.path.expanduser("~")


def choose_job(
    p: Prepared,
    hosts: Sequence[str],
    resume: bool,
    job: str | None,
    key: bytes | None,
    printer: Printer,
    steps: int | None = None,
    *,
    run_id: str | None = None,
) -> tuple[str, bytes]:
    """(job, key): new, or the one to resume with its key when this machine sees it.
    A new job's id reuses ``run_id``'s UTC second (``jobs.stamp_of``)."""
    name = p.plan.name
    if key is not None and job is not None:
        return job, key
    pool = LocalPool(p.cluster, ConnectOptions())
    found = jobs.list_jobs(pool, hosts, name)
    if resume and job is None and not found:
        raise LaunchError(
            f"--resume on Slurm: no job of plan {name} in the checkpoint directories as "
            "this machine sees them (node-local disks?); name it with --job JOB"
        )
    chosen, is_new = jobs.choose_job(
        found,
        resume=resume,
        job=job,
        plan_name=name,
        say=printer,
        steps=steps,
        stamp=jobs.stamp_of(run_id),
    )
    if is_new:
        return chosen, new_key()
    holders = found[chosen].key_hosts if chosen in found else ()
    if holders:
        return chosen, jobs.fetch_key(pool, holders[0], name, chosen)
    printer(
        f"note: job {chosen}'s key is not visible here: each node keeps the key it holds "
        "(a node without one gets a new key, and its workers will refuse the others' shards)"
    )
    return chosen, new_key()


def run_slurm_job(p: Prepared, attempt: Attempt) -> JobOutcome:
    a, printer = attempt, attempt.printer
    script, train_args, master_port = a.script, a.train_args, a.master_port
    if a.sync_dir is not None:
        raise LaunchError(
            "--sync-dir: on Slurm the nodes cannot be reached before the job runs; put "
            "your code on the file system the nodes share and pass --sync-dir no more"
        )
    check_run_dir(str(a.runs_root.resolve()))  # before anything is created under it
    precheck.check(p.cluster, p.plan.hosts(), a.runs_root)  # Slurm's commands, shared folder
    local_dir, rid = local_run_dir(a.runs_root, p.plan, a.run_id)
    run_dir = local_dir.resolve()
    hosts = p.plan.hosts()
    job_name, job_key = (None, None)
    if not script:
        c = a.job_choice
        job_name, job_key = choose_job(
            p, hosts, c.resume, c.job, c.key, printer, c.steps, run_id=rid
        )
    launch = build(
        p.plan,
        p.cluster,
        run_dir=run_dir,
        run_id=rid,
        master_port=master_port,
        script=script,
        train_args=train_args,
        remote_storage=p.remote_storage,
        job=job_name,
    )
    (run_dir / SCRIPT_NAME).write_text(launch.script, encoding="utf-8")
    shutil.copyfile(p.plan_file, launch.specs[0].plan_path)  # one run directory for all
    if job_key is not None:
        fd = os.open(run_dir / KEY_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(job_key)
    first = launch.specs[0]
    port = first.argv[list(first.argv).index("--master-port") + 1]
    other = "" if master_port is not None else "; else another, said in its output"
    printer(
        f"rendezvous: {first.address}:{port} (if free on {first.host} when the job starts"
        f"{other}); run {rid}; logs in {run_dir}"
    )
    if not script:
        announce_checkpoints(launch.specs, train_args, p, printer)
        announce_metrics(launch.specs[0], printer)
    sjob = SlurmJob(
        launch.specs,
        HostPool(p.cluster, ConnectOptions()),
        p.plan_file,
        run_dir,
        printer=printer,
        shares=tuple(pl.num_microbatches for pl in p.plan.pipelines),
        start_timeout_s=None if script else a.start_timeout_s,
    )
    # The key leaves the run directory however the job ends.
    return supervise(
        sjob,
        p,
        run_dir,
        printer,
        a.stop,
        cleanup=lambda: (run_dir / KEY_NAME).unlink(missing_ok=True),
    )
