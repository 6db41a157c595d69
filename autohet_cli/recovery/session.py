"""`autohet recover` as a domain object: detect, choose, replan, move, resume.

The command (cli/recover.py) parses options into a ``RecoverRequest`` and prints;
this module runs the phases and names the real cause whenever one cannot go on:
a ``--lost`` host the plan does not have, survivors that refuse us (key, auth,
permissions: not loss), no survivor at all, a run that never checkpointed, a
requested step that is not usable (and why newer steps were skipped). Which job
and which step it resumes is ``recovery.choose``'s part; what a dry run reports,
``recovery.dryrun``'s.

Once the job is known, its recover lock is taken on every survivor (and on any
new host before a byte moves; ``hostlock.py``), so a second recover of the same
job, from any directory or machine, stops naming the first. A step whose files
have no intact copy left (``StepLost``) makes recover fall back to the next older
usable step, unless ``--step`` asked for that one.

The new plan version is written only after every shard has landed and been
verified, so a failed recovery leaves no plan behind; the relaunch goes through
``launch.session.run_job``, exactly like ``autohet launch``; the lock is held
until it ends.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autohet_cli.ckpt.format import namespace
from autohet_cli.ckpt.retention import DEFAULT_KEEP
from autohet_cli.ckpt.steptext import after
from autohet_cli.cluster import Cluster, load_cluster
from autohet_cli.errors import TransportError
from autohet_cli.launch import jobs, runfolder
from autohet_cli.launch.preflight import preflight_ahead
from autohet_cli.launch.session import (
    JobChoice,
    Prepared,
    caller,
    host_paths,
    resolve_cluster,
    run_job,
)
from autohet_cli.plan import Plan, load_plan, write_plan
from autohet_cli.recovery import copies
from autohet_cli.recovery import executor as rx
from autohet_cli.recovery.choose import choose_checkpoint, job_and_key
from autohet_cli.recovery.dryrun import dry_run_report
from autohet_cli.recovery.errors import RecoveryError, StepLost
from autohet_cli.recovery.hostlock import HostLock
from autohet_cli.recovery.lock import recover_lock
from autohet_cli.recovery.manifest import CheckpointChoice, remote_root
from autohet_cli.recovery.pins import pinned_step
from autohet_cli.recovery.replan import CopyHolders, Replan, replan
from autohet_cli.recovery.report import PhaseClock, build_report
from autohet_cli.recovery.transfer import TransferPlan, plan_transfers
from autohet_cli.runtime.train_args import check_flags
from autohet_cli.slurmconf import backend_from
from autohet_cli.transport.pool import ConnectOptions, HostPool
from autohet_cli.yamlio import sha256_file

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoverRequest:
    plan_file: Path
    lost: tuple[str, ...] = ()  # empty: probe every host
    cluster: str | None = None
    step: int | None = None  # None: the newest usable checkpoint
    job: str | None = None  # None: the newest job of the plan on the survivors
    steps: int = 100
    checkpoint_every: str = "auto"
    keep_checkpoints: int = DEFAULT_KEEP
    train_args: tuple[str, ...] = ()
    time_limit_s: float = 30.0
    dry_run: bool = False
    resume: bool = True
    master_port: int | None = None
    backend: str | None = None  # None: the cluster file's
    connect: ConnectOptions = field(default_factory=ConnectOptions)
    runs_root: Path = Path("runs")
    break_lock: bool = False  # break another recover's lock once it is old (hostlock.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoverResult:
    exit_code: int
    report: dict[str, Any]  # the recovery report, or the dry run's plan


def recover(req: RecoverRequest, say: Say) -> RecoverResult:
    if req.resume:  # the relaunch's flags, refused as its workers would, before any host
        check_flags(relaunch_args(req, None))
    old = load_plan(req.plan_file)
    cluster_path = resolve_cluster(old, req.cluster)
    cl = load_cluster(cluster_path)
    if req.backend is not None:
        cl = dataclasses.replace(cl, backend=backend_from(req.backend, "--backend"))
    rx.check_lost_names(old, cl, req.lost, rx.earlier_hosts(req.plan_file.parent, old.name))
    clock = PhaseClock()
    moves: list[dict[str, Any]] = []  # each file that arrived: which way, how fast
    root = rx.remote_root_for(cl)
    with (
        recover_lock(req.plan_file.parent, old.name),
        HostPool(cl, req.connect) as pool,
        ExitStack() as held,
    ):
        with clock.phase("detect"):
            gone = rx.probe_survivors(old, pool, req.lost, say)
            # Probed, not remembered: an earlier wave's host joins only if it answers.
            absent = rx.probe_additions(old, cl, pool, gone, say)
        survivors = [h for h in old.hosts() if h not in gone]
        with clock.phase("checkpoint"):
            job, key = job_and_key(old, survivors, pool, req.job, say)
            ns = namespace(old.name, job)
            # Before anything is read for copying: one recover of this job at a time,
            # whichever directory or machine it runs from.
            lock = held.enter_context(HostLock(pool, ns, break_lock=req.break_lock, say=say))
            lock.take(survivors)
        r: Replan | None = None
        before: int | None = None  # after a step turned out to be lost: older ones only
        while True:
            with ExitStack() as pins:
                with clock.phase("checkpoint"):
                    choice, remote, text = choose_checkpoint(
                        old, survivors, pool, root, ns, key, req.step, before, say
                    )
                    # No prune (--keep-checkpoints) may remove it while it is copied.
                    holders = sorted({h for hs in choice.holders.values() for h in hs})
                    in_remote = root if choice.step_dir in remote else None
                    pins.enter_context(pinned_step(pool, holders, ns, choice.step, in_remote, say))
                say(
                    f"lost: {', '.join(gone) or 'none'}; resuming job {job} from "
                    f"{choice.step_dir} ({after(choice.step)})"
                )
                if r is None:
                    with clock.phase("replan"):
                        r = _replan(old, cl, cluster_path, [*gone, *absent], req, choice)
                    for note in r.plan.notes:
                        say(f"plan: {note}")
                    say(f"using: {', '.join(r.plan.hosts())}")
                    paths = host_paths(cl, r.plan.hosts(), req.train_args, caller())
                    if req.resume and not req.dry_run:  # done while the checkpoint moves
                        preflight_ahead(
                            pool,
                            r.plan.hosts(),
                            needs_autohet=True,
                            paths={h: hp.paths for h, hp in paths.items()},
                        )
                try:
                    with clock.phase("transfer"):
                        where = _Where(pool=pool, ns=ns, root=root, survivors=survivors, lost=gone)
                        tp = _transfer_plan(where, choice, remote, r.plan)
                        say(f"transfer rule {tp.rule}: {tp.rule_reason}")
                        if req.dry_run:
                            planned = dry_run_report(old, r.plan, gone, choice, tp) | {
                                "job": job,
                                "paths": {
                                    h: {a.flag: a.path for a in hp.paths} for h, hp in paths.items()
                                },
                            }
                            return RecoverResult(exit_code=0, report=planned)
                        lock.take(r.plan.hosts())  # new hosts too, before a byte moves
                        jobs.distribute_key(pool, r.plan.hosts(), old.name, job, key)
                        peers, from_remote = _move(where, tp, text, say, moves)
                except StepLost as exc:
                    if req.step is not None:
                        raise RecoveryError(f"--step {req.step}: {exc}") from None
                    say(f"{exc}; trying an older checkpoint")
                    before = exc.step
                    continue
                except (RecoveryError, TransportError) as exc:
                    # A wave goes on while we copy: a host of the new plan (a survivor,
                    # or one just added) stopped answering. Recover from its loss too.
                    newly = rx.unreachable(pool, [h for h in r.plan.hosts() if h not in gone])
                    if not newly:
                        raise
                    say(
                        f"{', '.join(newly)}: lost during the copy ({exc}); recovering "
                        "without them too"
                    )
                    gone += newly
                    survivors = [h for h in survivors if h not in newly]
                    absent = [h for h in absent if h not in newly]
                    if not survivors:
                        raise RecoveryError(
                            f"every host of plan {old.name}.v{old.version} is lost now "
                            f"({', '.join(gone)}); once some answer again, run recover again"
                        ) from None
                    r = None
                    continue
            break  # pins gone: the relaunched run keeps the step until it saved K newer
        new_plan, new_path = write_plan(r.plan, req.plan_file.parent)
        say(
            f"wrote {new_path}; {len(tp.items)} file(s) copied "
            f"({peers} B from peers, {from_remote} B from remote; "
            f"rule {tp.rule}: {tp.bytes_skipped} B in {len(tp.skipped)} file(s) not needed)"
        )
        report = build_report(
            replan=r,
            transfer=tp,
            new_plan_path=str(new_path),
            old_plan_path=str(req.plan_file),
            phases=clock.phases,
            resumed_step=choice.step,
            moved=(peers, from_remote),
            transfers=moves,
        )
        code = 0
        relaunch: dict[str, Any] | None = None
        if req.resume:
            prepared = Prepared(
                plan=new_plan,
                plan_file=new_path,
                cluster=cl,
                cluster_path=cluster_path,
                # As the cluster file writes it: each host expands its own ``~``.
                remote_storage=remote_root(cl.remote_storage, os.environ),
            )
            with clock.phase("relaunch"):
                try:
                    outcome = run_job(
                        prepared,
                        pool,
                        train_args=relaunch_args(req, choice.step),
                        master_port=req.master_port,
                        runs_root=req.runs_root,
                        printer=say,
                        job_choice=JobChoice(resume=True, job=job, key=key),
                    )
                except TransportError as exc:
                    relaunch = _lost_before_start(pool, new_plan, new_path, exc, say)
                    report = dataclasses.replace(report, phases=clock.phases)
                    return RecoverResult(
                        exit_code=3, report={**report.to_dict(), "job": job, "relaunch": relaunch}
                    )
            say(f"{outcome.status}: {outcome.detail or outcome.last_status}")
            say(runfolder.end_line(outcome.local_run_dir))
            code = outcome.exit_code
            report = dataclasses.replace(report, phases=clock.phases)
            relaunch = {
                "status": outcome.status,
                "lost_hosts": list(outcome.lost_hosts),
                "recoverable": outcome.recoverable and bool(outcome.lost_hosts),
            }
    return RecoverResult(
        exit_code=code, report={**report.to_dict(), "job": job, "relaunch": relaunch}
    )


def _lost_before_start(
    pool: HostPool, plan: Plan, path: Path, exc: TransportError, say: Say
) -> dict[str, Any]:
    """A host of the plan just written stopped answering after the copy, before the
    resumed run started (its preflight): the wave goes on, and the relaunch is
    reported as one that lost that host, which ``--auto-recover`` recovers from."""
    newly = rx.unreachable(pool, plan.hosts())
    if not newly:
        raise exc
    rest = [h for h in plan.hosts() if h not in newly]
    say(
        f"{', '.join(newly)}: lost after the copy, before the resumed run started ({exc}); "
        + (
            f"the checkpoint is in place on {', '.join(rest)}: autohet recover {path} "
            "(--auto-recover does it at once)"
            if rest
            else "every host of the new plan is lost; once some answer again, run recover again"
        )
    )
    return {"status": "host_lost", "lost_hosts": newly, "recoverable": bool(rest)}


def next_wave(req: RecoverRequest, result: RecoverResult) -> RecoverRequest | None:
    """The recover that follows a relaunch that lost hosts too (``--auto-recover``): the
    plan just written, its newly lost hosts, the same job; None when there is none."""
    relaunch = result.report.get("relaunch") or {}
    new_plan = result.report.get("new_plan_path")
    if not relaunch.get("recoverable") or not new_plan:
        return None
    return dataclasses.replace(
        req,
        plan_file=Path(new_plan),
        lost=tuple(relaunch["lost_hosts"]),
        step=None,
        job=str(result.report["job"]),
    )


def relaunch_args(req: RecoverRequest, step: int | None) -> list[str]:
    """The relaunched trainer's flags; ``step`` None: not chosen yet (the newest)."""
    return [
        f"--steps={req.steps}",
        "--resume" if step is None else f"--resume={step}",
        f"--checkpoint-every={req.checkpoint_every}",
        f"--keep-checkpoints={req.keep_checkpoints}",
        *req.train_args,
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Where:
    """Where the job's checkpoints are: hosts, namespace, remote root, who is gone."""

    pool: HostPool
    ns: str
    root: str | None
    survivors: list[str]
    lost: list[str]


def _transfer_plan(
    w: _Where, choice: CheckpointChoice, remote: dict[str, set[str]], new: Plan
) -> TransferPlan:
    """What to copy where, from what the new plan's hosts hold now (by sha256)."""
    new_hosts = new.hosts()
    expanded = rx.expanded_cluster(w.pool, sorted(set(new_hosts) | set(w.survivors)))
    return plan_transfers(
        choice.manifest,
        new,
        expanded,
        rx.hashes_present(new_hosts, w.ns, choice.step_dir, w.pool),
        remote_root=w.root or "",
        remote_files=set(remote.get(choice.step_dir, set())),
        lost=w.lost,
        namespace=w.ns,
    )


def _move(
    w: _Where, tp: TransferPlan, manifest_text: str, say: Say, moves: list[dict[str, Any]]
) -> tuple[int, int]:
    """Copy and verify every file, then mark the step complete where it was not:
    bytes from peers, bytes from remote storage."""
    hosts = list(tp.needs)
    copies.remove_partials(w.pool, hosts, w.ns, tp.step_dir)
    moves.clear()  # a fall back to an older step starts over
    moved = copies.execute_transfers(tp, w.pool, say, moves)
    copies.finalize(tp, manifest_text, w.pool)
    copies.remove_partials(w.pool, hosts, w.ns, tp.step_dir)
    return moved


def _replan(
    old: Plan,
    cl: Cluster,
    cluster_path: str,
    gone: list[str],
    req: RecoverRequest,
    choice: CheckpointChoice,
) -> Replan:
    inputs = {
        **old.inputs,
        "cluster": {"path": cluster_path, "sha256": sha256_file(cluster_path)},
    }
    return replan(
        old,
        cl,
        gone,
        old_path=str(req.plan_file),
        tables=rx.plan_inputs_tables(old, cluster_path),
        time_limit_s=req.time_limit_s,
        inputs=inputs,
        copies=CopyHolders(manifest=choice.manifest, holders=choice.holders),
    )
