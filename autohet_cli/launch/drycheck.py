"""``autohet launch --dry-run``'s checks: what the launch checks before any worker starts.

``session.dry_run`` builds the commands with no I/O (what is printed); this runs,
after it, every check with which the launch itself would refuse before starting
anything, so that a dry run that passes is a launch that gets to its workers, and
one that would be refused exits 1 with the launch's own message:

- SSH: the preflight on every host (interpreter, torch, autohet, each path the
  workers read, ``launch.preflight``), what ``--init-from`` and ``--data`` hold
  (``launch.inputcheck``), ``--sync-dir``, and with ``--resume``/``--job`` the job
  to continue (``launch.jobs``). Nothing is started, synced or sent; the only
  write is the workdir the preflight makes on a host that has none;
- Slurm: the client commands and a run folder the nodes share
  (``slurm.precheck``); the nodes themselves cannot be reached before the job runs.

With ``--sync-dir`` nothing is copied, so what the copy would bring is not asked
for: autohet itself, and paths relative to a remote host's workdir.
"""

from __future__ import annotations

import dataclasses

from autohet_cli.launch import inputcheck, jobs, pathargs, session
from autohet_cli.launch.preflight import PREFLIGHT_TIMEOUT_S, preflight, version_warnings
from autohet_cli.transport.pool import HostPool


def check(req: session.LaunchRequest) -> list[str]:
    """Run the launch's checks for ``req``; the lines to show (what was checked, and
    warnings). Raises the launch's own error where the launch would refuse."""
    session.check_worker_flags(req)
    p = session.prepare(req.plan_file, req.cluster, force=req.force, backend=req.backend)
    hosts = p.plan.hosts()
    if p.cluster.backend == "slurm":
        from autohet_cli.slurm import precheck

        precheck.check(p.cluster, hosts, req.runs_root)
        return [
            "dry run: checked Slurm's commands and the run folder (shared with the nodes); "
            "the nodes are not reached before the job runs; nothing was submitted"
        ]
    args = session.worker_args(req)
    paths = {} if req.script else session.host_paths(p.cluster, hosts, args, session.caller())
    if req.sync_dir is not None:
        session.check_sync_dir(req.sync_dir)
        paths = {h: _not_synced(hp) for h, hp in paths.items()}
    said: list[str] = []
    with HostPool(p.cluster, req.connect) as pool:
        reports = preflight(
            pool,
            hosts,
            needs_autohet=not req.script and req.sync_dir is None,
            port_host=None,  # the launch picks it then
            timeout_s=min(PREFLIGHT_TIMEOUT_S, req.start_timeout_s),
            paths={h: hp.paths for h, hp in paths.items()},
        )
        said += version_warnings(reports)
        if not req.script:
            inputcheck.check_inputs(pool, p.plan, paths, args)
            if req.resume or req.job is not None:
                said += _job(pool, hosts, p.plan.name, req, args)
    return [
        *said,
        f"dry run: checked {len(hosts)} host(s): interpreter, torch"
        + ("" if req.script else ", autohet, paths, --init-from and --data")
        + "; nothing was started",
    ]


def _not_synced(hp: pathargs.HostPaths) -> pathargs.HostPaths:
    """Without the paths under a remote host's workdir, where ``--sync-dir`` copies."""
    kept = tuple(a for a in hp.paths if a.how != pathargs.WORKDIR)
    return dataclasses.replace(hp, paths=kept)


def _job(
    pool: HostPool, hosts: list[str], plan_name: str, req: session.LaunchRequest, args: list[str]
) -> list[str]:
    """The job ``--resume``/``--job`` continues, as the launch chooses it (read only)."""
    said: list[str] = []
    found = jobs.list_jobs(pool, hosts, plan_name)
    try:
        jobs.choose_job(
            found,
            resume=req.resume,
            job=req.job,
            plan_name=plan_name,
            say=said.append,
            steps=jobs.steps_of(args),
        )
    except jobs.NothingToTrain as done:  # the launch exits 0 then, starting nothing
        said.append(f"nothing to train: {done}")
    return said
