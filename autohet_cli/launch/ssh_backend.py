"""The ``ssh`` backend: every host reached over SSH (localhost runs here), torchrun on each.

One attempt (``run``): sync ``--sync-dir``, the preflight on every host
(interpreter, torch, autohet, home directory, every path the workers read, a
free rendezvous port on the master host), what ``--init-from`` and ``--data``
hold there (``inputcheck``), the job and its key on every host, then start
torchrun per host, stream the logs and watch (``launch.executor.Job``) under
``launch.supervise``. ``dry_run_text`` prints each host's exact command and
``check`` runs the same checks read only (``--dry-run``).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence
from pathlib import Path

from autohet_cli.ckpt.format import new_key
from autohet_cli.cluster import Cluster
from autohet_cli.launch import inputcheck, jobs, pathargs
from autohet_cli.launch.attempt import (
    Attempt,
    JobChoice,
    Prepared,
    caller,
    check_sync_dir,
    host_paths,
    local_run_dir,
)
from autohet_cli.launch.executor import Job, JobOutcome, Printer
from autohet_cli.launch.preflight import PREFLIGHT_TIMEOUT_S, preflight, version_warnings
from autohet_cli.launch.specs import LaunchOptions, build_launch_specs
from autohet_cli.launch.supervise import announce_checkpoints, announce_metrics, supervise
from autohet_cli.launch.sync import sync_dir as sync_directory
from autohet_cli.transport.pool import ConnectOptions, HostPool

DEFAULT_PORT_SHOWN = 29500


def free_local_port() -> int:
    """A TCP port free on every interface of this machine now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class SshBackend:
    name = "ssh"

    def checkpoint_pool(self, cluster: Cluster, connect: ConnectOptions) -> HostPool:
        return HostPool(cluster, connect)

    def dry_run_text(
        self, p: Prepared, attempt: Attempt, job: str | None, who: pathargs.Caller
    ) -> str:
        port = attempt.master_port
        master = p.cluster.host(p.plan.hosts()[0])
        note = ""
        if port is None:
            if master.is_local:
                port = free_local_port()
            else:
                port = DEFAULT_PORT_SHOWN
                note = (
                    f"# master port: a free port is picked on {master.name} at launch; "
                    f"{port} is shown (pass --master-port to fix it)\n"
                )
        assert attempt.run_id is not None  # the session chose it
        options = LaunchOptions(
            run_id=attempt.run_id,
            master_port=port,
            script=attempt.script,
            train_args=attempt.train_args,
            remote_storage=p.remote_storage,
            job=job,
            caller=who,
        )
        specs = build_launch_specs(p.plan, p.cluster, options)
        sync_dir = attempt.sync_dir
        if sync_dir is not None:
            note += (
                f"# --sync-dir {sync_dir} -> {Path(who.cwd) / sync_dir} (copied into "
                "each host's workdir first)\n"
            )
        paths = (
            {} if attempt.script else host_paths(p.cluster, p.plan.hosts(), options.train_args, who)
        )
        return note + "\n".join(
            f"# {s.host} ({s.address}), node {s.node_rank}, {s.nproc_per_node} worker(s)\n"
            + "".join(
                f"{ln}\n" for ln in pathargs.listing(paths.get(s.host), p.cluster.host(s.host))
            )
            + s.command_line()
            for s in specs
        )

    def check(
        self, p: Prepared, attempt: Attempt, connect: ConnectOptions, who: pathargs.Caller
    ) -> list[str]:
        hosts = p.plan.hosts()
        args = list(attempt.train_args)
        paths = {} if attempt.script else host_paths(p.cluster, hosts, args, who)
        if attempt.sync_dir is not None:
            check_sync_dir(attempt.sync_dir)
            paths = {h: _not_synced(hp) for h, hp in paths.items()}
        said: list[str] = []
        with HostPool(p.cluster, connect) as pool:
            reports = preflight(
                pool,
                hosts,
                needs_autohet=not attempt.script and attempt.sync_dir is None,
                port_host=None,  # the launch picks it then
                timeout_s=min(PREFLIGHT_TIMEOUT_S, attempt.start_timeout_s),
                paths={h: hp.paths for h, hp in paths.items()},
            )
            said += version_warnings(reports)
            if not attempt.script:
                inputcheck.check_inputs(pool, p.plan, paths, args)
                choice = attempt.job_choice
                if choice.resume or choice.job is not None:
                    said += _job(pool, hosts, p.plan.name, choice, args)
        return [
            *said,
            f"dry run: checked {len(hosts)} host(s): interpreter, torch"
            + ("" if attempt.script else ", autohet, paths, --init-from and --data")
            + "; nothing was started",
        ]

    def run(self, p: Prepared, pool: HostPool, attempt: Attempt) -> JobOutcome:
        a, printer = attempt, attempt.printer
        hosts = p.plan.hosts()
        who = caller()
        paths = {} if a.script else host_paths(p.cluster, hosts, a.train_args, who)
        if a.sync_dir is not None:
            check_sync_dir(a.sync_dir)
        for line in pathargs.notes(list(paths.values()), {h.name: h for h in p.cluster.hosts}):
            printer(line)
        if a.sync_dir is not None:
            for name in hosts:
                sent = sync_directory(
                    pool.runner(name), a.sync_dir, pool.workdir(name), warn=printer
                )
                printer(f"{name}: synced {len(sent)} changed file(s) of {a.sync_dir}")
        master = hosts[0]
        reports = preflight(
            pool,
            hosts,
            needs_autohet=not a.script,
            port_host=master if a.master_port is None else None,
            timeout_s=min(PREFLIGHT_TIMEOUT_S, a.start_timeout_s),
            paths={h: hp.paths for h, hp in paths.items()},
        )
        for warning in version_warnings(reports):
            printer(warning)
        # What --init-from and --data hold, as the workers would refuse it; not again for
        # a relaunch with the job's key (recover), whose launch checked them: healing is
        # timed.
        if not a.script and a.job_choice.key is None:
            inputcheck.check_inputs(pool, p.plan, paths, a.train_args)
        port = a.master_port if a.master_port is not None else reports[master].free_port
        assert port is not None
        local_dir, rid = local_run_dir(a.runs_root, p.plan, a.run_id)  # refuses a reused id
        try:
            job_name, measured = (
                (None, {})
                if a.script
                else prepare_job(p, pool, hosts, a.job_choice, printer, run_id=rid)
            )
        except jobs.NothingToTrain:
            local_dir.rmdir()  # just made, still empty: no run to list (nor a --run-id used)
            raise
        options = LaunchOptions(
            run_id=rid,
            master_port=port,
            script=a.script,
            train_args=a.train_args,
            remote_storage=p.remote_storage,
            job=job_name,
            run_folder=str(local_dir.resolve()),
            caller=who,
        )
        homes = {h: r.home for h, r in reports.items()}
        specs = build_launch_specs(p.plan, p.cluster, options, homes)
        printer(f"rendezvous: {specs[0].address}:{port}; run {rid}; logs in {local_dir}")
        if not a.script:
            announce_checkpoints(specs, a.train_args, p, printer, measured)
            announce_metrics(specs[0], printer, local_dir)
        job = Job(
            specs,
            pool,
            p.plan_file,
            local_dir,
            printer=printer,
            shares=tuple(pl.num_microbatches for pl in p.plan.pipelines),
            start_timeout_s=None if a.script else a.start_timeout_s,
        )
        return supervise(job, p, local_dir, printer, a.stop)


def prepare_job(
    p: Prepared,
    pool: HostPool,
    hosts: Sequence[str],
    choice: JobChoice,
    printer: Printer,
    *,
    run_id: str | None = None,
) -> tuple[str, dict[str, float]]:
    """The job to run in, with its key on every host, and the seconds its hosts' last
    saves took (a job run before: for the spot-notice check). A new job's id reuses
    ``run_id``'s UTC second (``jobs.stamp_of``)."""
    name = p.plan.name
    if choice.key is not None and choice.job is not None:
        jobs.distribute_key(pool, hosts, name, choice.job, choice.key)
        return choice.job, {}
    found = jobs.list_jobs(pool, hosts, name)
    job, is_new = jobs.choose_job(
        found,
        resume=choice.resume,
        job=choice.job,
        plan_name=name,
        say=printer,
        steps=choice.steps,
        stamp=jobs.stamp_of(run_id),
    )
    if choice.resume and choice.key is None and len(hosts) > 1 and p.remote_storage is None:
        printer(
            "note: each rank may read shards other hosts wrote; without remote_storage "
            f"they are not there: if loading fails, run autohet recover {p.plan_file} "
            "(it copies them peer to peer first)"
        )
    if is_new:
        key = new_key()
    else:
        holders = found[job].key_hosts if job in found else ()
        if not holders:
            raise jobs.JobError(
                f"job {job} of plan {name} has no key on any host (written by an older "
                "autohet?): its checkpoints cannot be authenticated; start a new job"
            )
        key = jobs.fetch_key(pool, holders[0], name, job)
    jobs.distribute_key(pool, hosts, name, job, key)
    return job, dict(found[job].save_s) if job in found else {}


def _not_synced(hp: pathargs.HostPaths) -> pathargs.HostPaths:
    """Without the paths under a remote host's workdir, where ``--sync-dir`` copies."""
    kept = tuple(a for a in hp.paths if a.how != pathargs.WORKDIR)
    return dataclasses.replace(hp, paths=kept)


def _job(
    pool: HostPool, hosts: list[str], plan_name: str, choice: JobChoice, args: list[str]
) -> list[str]:
    """The job ``--resume``/``--job`` continues, as the launch chooses it (read only)."""
    said: list[str] = []
    found = jobs.list_jobs(pool, hosts, plan_name)
    try:
        jobs.choose_job(
            found,
            resume=choice.resume,
            job=choice.job,
            plan_name=plan_name,
            say=said.append,
            steps=jobs.steps_of(args),
        )
    except jobs.NothingToTrain as done:  # the launch exits 0 then, starting nothing
        said.append(f"nothing to train: {done}")
    return said


BACKEND = SshBackend()
