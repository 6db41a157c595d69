"""Run namespaces (jobs) and their keys on the hosts (effects, over the host pool).

A fresh launch starts a new job, ``<UTC time>-<4 hex>``, so its checkpoints never
mix with an earlier run of the same plan; ``--resume`` continues the newest job
that has a complete checkpoint (or the one ``--job`` names). Every job has a
random 32-byte key that authenticates its manifests (``autohet_cli.ckpt.format``):
created here, copied over SSH (SFTP) into ``<checkpoint dir>/<plan>/<job>/`` on
every host, mode 0600 in a 0700 directory, before any worker starts.
"""

from __future__ import annotations

import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from autohet_cli.ckpt.format import KEY_FILE, check_job, check_key, parse_step_dir
from autohet_cli.ckpt.notice import LAST_SAVE_FILE
from autohet_cli.ckpt.steptext import after
from autohet_cli.errors import AutohetError, ConfigError
from autohet_cli.transport.fanout import fan_out
from autohet_cli.transport.pool import HostPool

Say = Callable[[str], None]

# For each job directory of a plan on a host: "<job> <newest complete step or -> <key?>
# <creation time: the key's mtime, else the dir's> <last save's seconds or ->".
_JOBS = (
    'cd "$1" 2>/dev/null || exit 0; for j in *; do [ -d "$j" ] || continue; '
    'best=-; for s in "$j"/step-*; do [ -f "$s/COMPLETE" ] && best=${s##*/step-}; done; '
    'k=0; t=$(stat -c %Y -- "$j"); '
    '[ -f "$j/.autohet-key" ] && k=1 && t=$(stat -c %Y -- "$j/.autohet-key"); '
    f'v=-; [ -f "$j/{LAST_SAVE_FILE}" ] && v=$(head -c 16 -- "$j/{LAST_SAVE_FILE}" | tr -cd 0-9.); '
    'echo "$j $best $k $t ${v:--}"; done'
)


class JobError(AutohetError):
    """A job (run namespace) cannot be chosen or prepared; names the host and the fix."""


class NothingToTrain(JobError):
    """``--resume`` of a job whose newest checkpoint is at ``--steps`` or past it.

    Not a failure: the job is where it was asked to end. Raised before any key is
    sent or worker started (workers would load the checkpoint, train no step and
    exit, and the launch could only report ``finished: starting``); ``autohet
    launch`` prints it and exits 0, so a retry loop around ``--resume`` ends."""

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True, slots=True, kw_only=True)
class JobInfo:
    name: str
    newest_step: int | None  # newest COMPLETE step seen on any host
    key_hosts: tuple[str, ...]  # hosts holding its key
    created_unix: int = 0  # when it began (its key's mtime, earliest host)
    save_s: Mapping[str, float] = field(default_factory=dict)  # host -> its last save's s


_STAMP = re.compile(r"^\d{8}T\d{6}Z")  # a default run id's UTC second


def stamp_of(run_id: str | None) -> str | None:
    """The UTC second a default run id was made at (``20261125T140305Z``, also with
    its ``-2`` suffix); None for a run id the user chose."""
    m = _STAMP.match(run_id or "")
    return m.group(0) if m else None


def new_job_id(stamp: str | None = None) -> str:
    """``<UTC second>-<4 hex>``. ``stamp``: the run's second (``stamp_of``), so that a
    new job and the run that starts it read the same time, one clock reading, and a
    user sees which run began which job; else now."""
    when = stamp or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{when}-{secrets.token_hex(2)}"


def list_jobs(pool: HostPool, hosts: Sequence[str], plan_name: str) -> dict[str, JobInfo]:
    """The jobs of ``plan_name`` on the reachable ``hosts``, oldest first (by creation)."""

    def jobs_on(name: str) -> list[tuple[str, int | None, bool, int, float | None]]:
        d = f"{pool.checkpoint_dir(name).rstrip('/')}/{plan_name}"
        res = pool.runner(name).run(["sh", "-c", _JOBS, "sh", d], timeout_s=60)
        out = []
        for line in res.stdout.splitlines():
            parts = line.split()
            if len(parts) != 5 or not _is_job(parts[0]) or not parts[3].isdigit():
                continue  # not a job directory (an old-layout step-N, a temp dir)
            step = parse_step_dir(f"step-{parts[1]}") if parts[1] != "-" else None
            out.append((parts[0], step, parts[2] == "1", int(parts[3]), _seconds(parts[4])))
        return out

    found = fan_out([pool.host(h) for h in hosts], lambda h: jobs_on(h.name))
    merged: dict[str, JobInfo] = {}
    for host, rows in found.items():
        if isinstance(rows, Exception):
            continue
        for job, step, has_key, created, save_s in rows:
            old = merged.get(job, JobInfo(name=job, newest_step=None, key_hosts=()))
            steps = [s for s in (old.newest_step, step) if s is not None]
            merged[job] = JobInfo(
                name=job,
                newest_step=max(steps) if steps else None,
                key_hosts=old.key_hosts + ((host,) if has_key else ()),
                created_unix=min(t for t in (old.created_unix, created) if t) or created,
                save_s={**old.save_s, **({host: save_s} if save_s is not None else {})},
            )
    # Oldest first by when each began: names given by hand need not sort by time.
    return dict(sorted(merged.items(), key=lambda kv: (kv[1].created_unix, kv[0])))


def _seconds(text: str) -> float | None:
    """A save time as the workers wrote it; None for '-' or anything else."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 <= value < 1e7 else None


def _is_job(name: str) -> bool:
    if parse_step_dir(name) is not None:
        return False
    try:
        check_job(name)
    except ConfigError:
        return False
    return True


def job_dir(pool: HostPool, host: str, plan_name: str, job: str) -> str:
    return f"{pool.checkpoint_dir(host).rstrip('/')}/{plan_name}/{check_job(job)}"


def fetch_key(pool: HostPool, host: str, plan_name: str, job: str) -> bytes:
    """The job key from ``host``, refusing a key file others could read or replace."""
    path = f"{job_dir(pool, host, plan_name, job)}/{KEY_FILE}"
    res = pool.runner(host).run(
        ["sh", "-c", 'stat -c "%u %a" -- "$1" && id -u', "sh", path], timeout_s=30
    )
    lines = res.stdout.split("\n")
    if res.exit_code != 0 or len(lines) < 2:
        raise JobError(f"{host}: cannot read the job key {path}: {res.stderr.strip()}")
    owner, mode = lines[0].split()
    if owner != lines[1].strip() or int(mode, 8) & 0o077:
        raise JobError(
            f"{host}: the job key {path} (owner uid {owner}, mode {mode}) could be read or "
            "replaced by others: refusing it (chmod 600 it if it is yours and intact)"
        )
    with tempfile.TemporaryDirectory(prefix="autohet-key-") as tmp:
        local = Path(tmp) / KEY_FILE
        pool.runner(host).get(path, local)
        data = local.read_bytes()
    try:
        return check_key(data, f"{host}:{path}")
    except ConfigError as exc:
        raise JobError(str(exc)) from None


def distribute_key(
    pool: HostPool, hosts: Sequence[str], plan_name: str, job: str, key: bytes
) -> None:
    """Put the key on every host that lacks it (0600 in a 0700 job directory)."""
    with tempfile.TemporaryDirectory(prefix="autohet-key-") as tmp:
        local = Path(tmp) / KEY_FILE
        fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)

        def put(name: str) -> None:
            d = job_dir(pool, name, plan_name, job)
            runner = pool.runner(name)
            res = runner.run(
                [
                    "sh",
                    "-c",
                    'umask 077 && mkdir -p -- "$1" && chmod 700 -- "$1" && '
                    'test ! -e "$1/.autohet-key"',
                    "sh",
                    d,
                ],
                timeout_s=30,
            )
            if res.exit_code != 0:
                if not res.stderr.strip():
                    return  # has one already; the workers check that all agree
                raise JobError(f"{name}: cannot create {d}: {res.stderr.strip()}")
            runner.put(local, f"{d}/{KEY_FILE}")
            runner.run(["chmod", "600", "--", f"{d}/{KEY_FILE}"], timeout_s=30).check()

        results = fan_out([pool.host(h) for h in hosts], lambda h: put(h.name))
        failed = {n: r for n, r in results.items() if isinstance(r, Exception)}
        if failed:
            raise JobError("; ".join(f"{n}: {e}" for n, e in failed.items()))


def steps_of(args: Sequence[str]) -> int | None:
    """The ``--steps`` the built-in trainer will get: the last one in ``args``
    (argparse keeps the last, and ``--train-arg`` comes after ours); None if absent or
    not a number (the workers' own check says so)."""
    value: str | None = None
    for i, arg in enumerate(args):
        if arg == "--steps" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--steps="):
            value = arg.split("=", 1)[1]
    return int(value) if value is not None and value.isdigit() else None


def resume_of(args: Sequence[str]) -> int | str | None:
    """The ``--resume`` the built-in trainer will get, as it parses it (the last one
    wins): a checkpoint step, ``"latest"`` (no value: the newest complete one, which
    only the workers know for sure), or None (no ``--resume``: a fresh start)."""
    value: str | None = None
    for i, arg in enumerate(args):
        if arg == "--resume":
            nxt = args[i + 1] if i + 1 < len(args) else ""
            value = nxt if nxt.isdigit() else "latest"
        elif arg.startswith("--resume="):
            value = arg.split("=", 1)[1]
    if value is None:
        return None
    return int(value) if value.isdigit() else "latest"


def _check_steps_left(info: JobInfo | None, plan_name: str, steps: int | None) -> None:
    """Refuse to resume a job that has reached ``steps`` (see ``NothingToTrain``)."""
    if steps is None or info is None or info.newest_step is None:
        return
    if info.newest_step >= steps:
        raise NothingToTrain(
            f"job {info.name} of plan {plan_name} is already at step {info.newest_step} "
            f"(its newest complete checkpoint, {after(info.newest_step)}), and --steps "
            f"{steps} is the step training ends at: nothing to train, no worker started; "
            f"to train on, pass a --steps above {info.newest_step}",
            step=info.newest_step,
        )


def choose_job(
    jobs: dict[str, JobInfo],
    *,
    resume: bool,
    job: str | None,
    plan_name: str,
    say: Say,
    steps: int | None = None,
    stamp: str | None = None,
) -> tuple[str, bool]:
    """(job, is_new). Fresh runs get a new job unless ``--job`` names one to continue.
    ``steps``: where the workers end training; resuming a job already there raises
    ``NothingToTrain``. ``stamp``: the run's UTC second, for a new job's id."""
    if job is not None:
        check_job(job)
        if resume and job not in jobs:
            raise JobError(f"--job {job}: plan {plan_name} has no such job on any host")
        if resume:
            _check_steps_left(jobs.get(job), plan_name, steps)
        return job, job not in jobs
    if resume:
        usable = [j for j in jobs.values() if j.newest_step is not None]
        if not usable:
            raise JobError(
                f"--resume: no complete checkpoint of plan {plan_name} on any host; launch "
                "without --resume to start afresh"
            )
        newest = usable[-1]
        _check_steps_left(newest, plan_name, steps)
        step = newest.newest_step
        assert step is not None  # usable
        say(f"job: resuming {newest.name} (newest complete step {step}, {after(step)})")
        return newest.name, False
    fresh = new_job_id(stamp)
    earlier = [j for j in jobs.values() if j.newest_step is not None]
    if earlier:
        last = earlier[-1]
        say(
            f"job: {fresh} (new; earlier checkpoints of {plan_name} are kept: newest "
            f"{last.name} at step {last.newest_step}; pass --resume to continue it instead)"
        )
    else:
        say(f"job: {fresh} (new)")
    return fresh, True
