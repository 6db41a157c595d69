"""`autohet launch` as a domain object: prepare, dry-run or run, and say what happened.

The command (cli/launch.py) only parses options into a ``LaunchRequest`` and
prints; everything a launch does is here, so recover's relaunch and the tests
use exactly the same path:

1. load the plan and its cluster, refuse a changed cluster file (unless forced);
2. (dry run: build the specs with no I/O and print them, runnable as printed);
3. sync ``--sync-dir``, then the preflight on every host (interpreter, torch,
   autohet, home directory, a free rendezvous port on the master host) and what
   ``--init-from`` and ``--data`` hold there (``inputcheck``); ``--dry-run`` runs
   these checks too, after printing (``drycheck``);
4. announce where checkpoints go, start torchrun on every host, watch, judge
   (``triage``), stop; a lost host yields the ``autohet recover`` command.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autohet_cli.ckpt.format import new_key
from autohet_cli.ckpt.notice import notice_warnings
from autohet_cli.ckpt.policy import checkpoint_every_of, describe_every, saves_anything
from autohet_cli.ckpt.retention import DEFAULT_KEEP, describe_keep, keep_of
from autohet_cli.cluster import Cluster, load_cluster
from autohet_cli.defaults import resolve_cluster_path
from autohet_cli.errors import ConfigError, PlanError
from autohet_cli.launch import compare, inputcheck, jobs, pathargs, runfolder
from autohet_cli.launch.executor import Job, JobOutcome, LaunchError
from autohet_cli.launch.preflight import PREFLIGHT_TIMEOUT_S, preflight, version_warnings
from autohet_cli.launch.specs import LaunchOptions, LaunchSpec, build_launch_specs
from autohet_cli.launch.sync import sync_dir as sync_directory
from autohet_cli.plan import Plan, check_against_cluster, load_plan
from autohet_cli.recovery.manifest import remote_root
from autohet_cli.runtime.agent import REPEAT_WINDOW_S
from autohet_cli.runtime.train_args import check_flags
from autohet_cli.slurm.settings import backend_from
from autohet_cli.transport.pool import ConnectOptions, HostPool
from autohet_cli.yamlio import sha256_file

Printer = Callable[[str], None]
DEFAULT_PORT_SHOWN = 29500
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")


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
class LaunchResult:
    outcome: JobOutcome
    recover_command: str | None  # only when a host was lost and another survives
    # Every host of the cluster left: resume there (or anywhere) once they are back.
    resume_command: str | None = None


def resolve_cluster(plan: Plan, cluster: str | None) -> str:
    """``--cluster``, else the plan's own cluster file, else the embedded localhost."""
    return str(resolve_cluster_path(cluster or plan.inputs.get("cluster", {}).get("path")))


def prepare(
    plan_file: Path, cluster: str | None, *, force: bool = False, backend: str | None = None
) -> Prepared:
    plan = load_plan(plan_file)
    cluster_path = resolve_cluster(plan, cluster)
    _check_fingerprint(plan, plan_file, cluster_path, force)
    cl = load_cluster(cluster_path)
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
    if p.cluster.backend == "slurm":
        from autohet_cli.slurm.run import build

        rid = _run_id(req.run_id)
        return build(
            p.plan,
            p.cluster,
            run_dir=(req.runs_root / f"{p.plan.name}.v{p.plan.version}" / rid).resolve(),
            run_id=rid,
            master_port=req.master_port,
            script=req.script,
            train_args=worker_args(req),
            remote_storage=p.remote_storage,
            job=None if req.script else (req.job or jobs.new_job_id(jobs.stamp_of(rid))),
        ).script
    port = req.master_port
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
    who = caller()
    rid = _run_id(req.run_id)
    options = LaunchOptions(
        run_id=rid,
        master_port=port,
        script=req.script,
        train_args=worker_args(req),
        remote_storage=p.remote_storage,
        job=None if req.script else (req.job or jobs.new_job_id(jobs.stamp_of(rid))),
        caller=who,
    )
    specs = build_launch_specs(p.plan, p.cluster, options)
    if req.sync_dir is not None:
        note += (
            f"# --sync-dir {req.sync_dir} -> {Path(who.cwd) / req.sync_dir} (copied into "
            "each host's workdir first)\n"
        )
    paths = {} if req.script else host_paths(p.cluster, p.plan.hosts(), options.train_args, who)
    return note + "\n".join(
        f"# {s.host} ({s.address}), node {s.node_rank}, {s.nproc_per_node} worker(s)\n"
        + "".join(f"{ln}\n" for ln in pathargs.listing(paths.get(s.host), p.cluster.host(s.host)))
        + s.command_line()
        for s in specs
    )


def caller() -> pathargs.Caller:
    """This process's directory and home: where this machine's relative paths start."""
    return pathargs.Caller(cwd=os.getcwd(), home=os.path.expanduser("~"))


def host_paths(
    cluster: Cluster, hosts: Sequence[str], train_args: Sequence[str], who: pathargs.Caller
) -> dict[str, pathargs.HostPaths]:
    """Each host's worker arguments with their paths as it reads them (``pathargs``)."""
    return {h: pathargs.resolve(train_args, cluster.host(h), who) for h in hosts}


def check_sync_dir(sync_dir: Path) -> None:
    """``--sync-dir`` is read here: a missing one would sync nothing, silently."""
    if not sync_dir.is_dir():
        what = "not a directory" if sync_dir.exists() else "no such directory"
        raise ConfigError(
            f"--sync-dir {sync_dir}: {what} (read as {sync_dir.absolute()}: it is read on "
            "this machine, from the current directory); pass the folder to copy"
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
    """Sync, preflight, job and key, announce, start, watch, stop: one attempt of a plan.

    ``stop``: set by the caller to stop every host (Ctrl-C and SIGTERM do the same
    when this runs in the main thread)."""
    if p.cluster.backend == "slurm":
        from autohet_cli.slurm.run import run_slurm_job  # imports this module

        return run_slurm_job(
            p,
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
    hosts = p.plan.hosts()
    who = caller()
    paths = {} if script else host_paths(p.cluster, hosts, train_args, who)
    if sync_dir is not None:
        check_sync_dir(sync_dir)
    for line in pathargs.notes(list(paths.values()), {h.name: h for h in p.cluster.hosts}):
        printer(line)
    if sync_dir is not None:
        for name in hosts:
            sent = sync_directory(pool.runner(name), sync_dir, pool.workdir(name), warn=printer)
            printer(f"{name}: synced {len(sent)} changed file(s) of {sync_dir}")
    master = hosts[0]
    reports = preflight(
        pool,
        hosts,
        needs_autohet=not script,
        port_host=master if master_port is None else None,
        timeout_s=min(PREFLIGHT_TIMEOUT_S, start_timeout_s),
        paths={h: hp.paths for h, hp in paths.items()},
    )
    for warning in version_warnings(reports):
        printer(warning)
    # What --init-from and --data hold, as the workers would refuse it; not again for a
    # relaunch with the job's key (recover), whose launch checked them: healing is timed.
    if not script and (job_choice is None or job_choice.key is None):
        inputcheck.check_inputs(pool, p.plan, paths, train_args)
    port = master_port if master_port is not None else reports[master].free_port
    assert port is not None
    local_dir, rid = _local_run_dir(runs_root, p.plan, run_id)  # refuses a reused run id
    try:
        job_name, measured = (
            (None, {})
            if script
            else _prepare_job(p, pool, hosts, job_choice or JobChoice(), printer, run_id=rid)
        )
    except jobs.NothingToTrain:
        local_dir.rmdir()  # just made, still empty: no run to list (nor a --run-id used up)
        raise
    options = LaunchOptions(
        run_id=rid,
        master_port=port,
        script=script,
        train_args=train_args,
        remote_storage=p.remote_storage,
        job=job_name,
        run_folder=str(local_dir.resolve()),
        caller=who,
    )
    specs = build_launch_specs(p.plan, p.cluster, options, {h: r.home for h, r in reports.items()})
    printer(f"rendezvous: {specs[0].address}:{port}; run {rid}; logs in {local_dir}")
    if not script:
        _announce_checkpoints(specs, train_args, p, printer, measured)
        _announce_metrics(specs[0], printer, local_dir)
    job = Job(
        specs,
        pool,
        p.plan_file,
        local_dir,
        printer=printer,
        shares=tuple(pl.num_microbatches for pl in p.plan.pipelines),
        start_timeout_s=None if script else start_timeout_s,
    )
    return supervise(job, p, local_dir, printer, stop)


def supervise(
    job: Job,
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
    job: Job,
    p: Prepared,
    local_dir: Path,
    printer: Printer,
    stop: threading.Event | None,
    cleanup: Callable[[], None] | None,
) -> JobOutcome:
    if stop is not None:
        job.stop_requested = stop
    with _stop_on_signals(job.stop_requested, getattr(job, "kill_requested", None), job):
        try:
            job.start()
            outcome = job.watch()
        finally:
            job.stop_all()
            job.close()
            if cleanup is not None:
                cleanup()
    if job.run_report is not None:
        _check_against_plan(p, job.run_report, local_dir, printer)
    return outcome


def _check_against_plan(
    p: Prepared, report: dict[str, Any], local_dir: Path, printer: Printer
) -> None:
    """Print and keep (``prediction-check.json``) the run against its plan."""
    try:
        ranks = report.get("ranks") or [{}]
        sends = compare.link_send_ms(p.plan, p.cluster, ranks[0].get("device"))
        check = compare.compare(p.plan, report, sends)
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


def _prepare_job(
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


def _announce_checkpoints(
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


def _announce_metrics(first: LaunchSpec, printer: Printer, folder: Path | None = None) -> None:
    """Rank 0 runs on the first plan host; its metrics reach the run folder (``runfolder``)."""
    printer(runfolder.metrics_line(first, folder))


def free_local_port() -> int:
    """A TCP port free on every interface of this machine now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _run_id(raw: str | None) -> str:
    if raw is None:
        return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if not _RUN_ID.match(raw) or ".." in raw:
        raise ConfigError(
            f"--run-id {raw!r}: use letters, digits, '.', '_' and '-' only (no '/', no '..'), "
            "starting with a letter or digit"
        )
    return raw


def _local_run_dir(root: Path, plan: Plan, run_id: str | None) -> tuple[Path, str]:
    """``runs/<plan>.v<N>/<run id>``, new: a given run id already used is refused; a
    default one (the UTC second) gets a suffix when two launches share a second."""
    rid = _run_id(run_id)
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


@contextmanager
def _stop_on_signals(
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
