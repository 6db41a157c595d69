"""A job's directory on a host, as the workers keep it: the key every rank agrees
on, checked again at every save; what interrupted saves left behind; and an
unused job removed at the end (``ckpt.checkpointer``).

The key (``<job dir>/.autohet-key``, 0600) signs every manifest. ``autohet launch``
creates it and copies it to every host before the workers start; a worker started
without the launcher (tests, a hand-run torchrun) makes one on rank 0 and sends it
to the ranks that lack it. A key is never made for a job that already holds steps,
and never silently made again when it vanishes during a run (a scratch purge):
steps signed with a key nobody holds can never be verified, so never resumed, and
the run stops saying so instead of writing them.

The checkpointer hands itself to these functions, typed as ``JobDirView`` (what they
read of it), so this module never imports the checkpointer above it (``ckpt.view``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from autohet_cli.ckpt.files import CheckpointError, list_steps, read_key, write_key
from autohet_cli.ckpt.format import (
    ABANDONED_PREFIX,
    COMPLETE,
    KEY_FILE,
    TMP_PREFIX,
    new_key,
    parse_step_dir,
    step_dir_name,
)
from autohet_cli.ckpt.remote import RemoteCopy
from autohet_cli.ckpt.view import JobView
from autohet_cli.errors import ConfigError
from autohet_cli.workerbase.records import say


class JobDirView(JobView, Protocol):
    """The checkpointer as the job directory's keeper uses it: the job, the ranks,
    and the remote copy whose later steps a resume takes back (``set_aside_newer``)."""

    remote: RemoteCopy | None


def has_steps(plan_dir: Path) -> bool:
    """Whether this host holds step directories of the job (complete or not)."""
    try:
        return any(parse_step_dir(e.name) is not None for e in os.scandir(plan_dir))
    except OSError:
        return False


def agree_key(ckpt: JobDirView) -> bytes:
    """This job's key on every rank (collective), checked to agree."""
    try:
        mine: bytes | None = read_key(ckpt.plan_dir)
        problem = None
    except (CheckpointError, ConfigError) as exc:
        mine, problem = None, str(exc)
    ckpt.agree_no_problem(problem)
    gathered: list[Any] = [None] * ckpt.world_size
    digest = hashlib.sha256(mine).hexdigest() if mine is not None else None
    dist.all_gather_object(gathered, (digest, has_steps(ckpt.plan_dir)), group=ckpt.group)
    digests = [d for d, _ in gathered]
    known = {d for d in digests if d is not None}
    if not known and any(h for _, h in gathered):
        raise CheckpointError(
            f"job {ckpt.job} has checkpoints under {ckpt.plan_dir} but its key "
            f"({KEY_FILE}) is on no host: they cannot be verified, and a new key would "
            "make them unusable for good. Restore the key from a backup, or start a "
            "new job (autohet launch starts one by default)"
        )
    if len(known) > 1:
        raise CheckpointError(
            f"the hosts hold different keys for job {ckpt.job} under {ckpt.plan_dir}: "
            "checkpoints of different runs are mixed there; start a new job "
            "(autohet launch starts one by default)"
        )
    if all(d is not None for d in digests):
        assert mine is not None
        return mine
    holder = next((r for r, d in enumerate(digests) if d is not None), 0)
    payload: list[Any] = [
        (mine if mine is not None else new_key()) if ckpt.rank == holder else None
    ]
    dist.broadcast_object_list(payload, src=holder, group=ckpt.group)
    key = payload[0]
    assert isinstance(key, bytes)
    return write_key(ckpt.plan_dir, key) if mine is None else mine


def key_problem(ckpt: JobDirView) -> str | None:
    """Why this host's job key no longer matches the run's (None: it does); asked at
    every save, before anything is written."""
    path = ckpt.plan_dir / KEY_FILE
    try:
        on_disk = read_key(ckpt.plan_dir)
    except (CheckpointError, ConfigError) as exc:
        return f"the job key of {ckpt.plan_dir} is unusable: {exc}"
    except OSError as exc:  # EACCES, EIO, ESTALE: named on every rank, never raised alone
        return f"cannot read the job key {path} on {ckpt.host}: {exc.strerror or exc}"
    if on_disk is None:
        return (
            f"the job key {path} on {ckpt.host} is gone (deleted during the run: a "
            "scratch purge?); without it no step of this job can be verified, so the "
            "run stops rather than save steps nobody could resume. Copy the key back "
            "from another host of the job (they hold the same one, mode 0600) and "
            "resume, or start a new job"
        )
    if on_disk != ckpt.key:
        return (
            f"the job key {path} on {ckpt.host} was replaced during the run: the run "
            "stops rather than mix steps signed with two keys; restore the original "
            "key or start a new job"
        )
    return None


def clear_leftovers(ckpt: JobDirView) -> None:
    """The owner's start: remove what interrupted saves of earlier runs left
    (``.tmp-*``: never COMPLETE, and no save of this job runs before ours)."""
    names = remove_prefixed(ckpt.plan_dir, TMP_PREFIX)
    if names and ckpt.rank == 0:
        listed = ", ".join(names)
        say(f"note: removed the leftovers of interrupted saves in {ckpt.plan_dir}: {listed}")


def remove_prefixed(plan_dir: Path, prefix: str) -> list[str]:
    """Remove the entries of ``plan_dir`` whose names start with ``prefix`` (best
    effort); returns their names, sorted."""
    try:
        entries = [e for e in os.scandir(plan_dir) if e.name.startswith(prefix)]
    except OSError:
        return []
    for e in entries:
        shutil.rmtree(e.path, ignore_errors=True)
    return sorted(e.name for e in entries)


def set_aside_newer(ckpt: JobDirView, step: int) -> list[int]:
    """After loading ``step``: every owner moves the job's steps after it aside
    (``.abandoned-step-<N>-<unix time>``: never loaded or overwritten; removed by
    retention once this run has a complete step of its own, ``Retention``), and
    rank 0 takes their ``COMPLETE`` out of the remote copy.

    They belong to the run the user went back from (``--resume STEP``): left in
    place, ``--resume`` would later pick the newest of them, pruning would count
    them among the newest K and remove this run's steps instead, and this run's save
    of a step number they hold would be skipped as already saved (issue 29: a
    corrupt step 15 kept while the good state was thrown away). They are kept
    until the new run has a durable step (the user may still go back to them), not
    longer, where they would fill the disk. Returns the steps moved here.
    """
    # Only this job's own steps: complete and authentic on some host (rank 0's holds
    # the manifest), never a planted one, which is nobody's to move (as retention).
    try:
        mine = {s for s, why in list_steps(ckpt.plan_dir, ckpt.key).items() if why is None}
    except OSError:
        mine = set()
    views: list[Any] = [None] * ckpt.world_size
    dist.all_gather_object(views, sorted(s for s in mine if s > step), group=ckpt.group)
    newer = {s for view in views for s in view}
    moved = []
    if ckpt.owner and newer:
        stamp = int(time.time())
        try:
            entries = list(os.scandir(ckpt.plan_dir))
        except OSError:
            entries = []
        for e in entries:
            n = parse_step_dir(e.name)
            if n is None or n not in newer:
                continue
            try:
                os.rename(e.path, ckpt.plan_dir / f"{ABANDONED_PREFIX}{e.name}-{stamp}")
                moved.append(n)
            except OSError as exc:
                say(f"warning: cannot set {e.path} aside: {exc.strerror or exc}")
    if ckpt.rank == 0:
        if moved:
            say(
                f"note: steps {', '.join(map(str, sorted(moved)))} of job {ckpt.job} come "
                f"after the resumed step {step}: they belong to the run this one went back "
                f"from, and are set aside as {ABANDONED_PREFIX}step-* in {ckpt.plan_dir} "
                "(never loaded; removed once this run has saved a step of its own, unless "
                "--keep-checkpoints 0)"
            )
        if ckpt.remote is not None:
            _unmark_remote_newer(ckpt, step)
    return moved


def _unmark_remote_newer(ckpt: JobDirView, step: int) -> None:
    remote = ckpt.remote
    assert remote is not None
    try:
        newer = sorted(s for s in remote.complete_steps(ckpt.key, remote.entries()) if s > step)
        for s in newer:
            remote.unmark_complete(s)
    except Exception as exc:  # a remote outage must not stop the resumed run
        say(f"warning: cannot mark the later steps in {remote.url} as abandoned: {exc}")
        return
    if newer:
        say(
            f"note: steps {', '.join(map(str, newer))} in the remote copy {remote.url} are "
            "no longer COMPLETE there (the run this one went back from)"
        )


def clear_step(plan_dir: Path, step: int) -> None:
    """Remove what a failed save of ``step`` left: its temporary directory, and its
    step directory if it never became COMPLETE (never a complete one)."""
    shutil.rmtree(plan_dir / f"{TMP_PREFIX}{step_dir_name(step)}", ignore_errors=True)
    final = plan_dir / step_dir_name(step)
    if final.is_dir() and not (final / COMPLETE).exists():
        shutil.rmtree(final, ignore_errors=True)


def remove_if_unused(plan_dir: Path) -> bool:
    """Remove ``plan_dir`` when it holds the job key and nothing else (the run saved
    nothing there); True when it went. Anything else in it keeps it whole."""
    try:
        names = {e.name for e in os.scandir(plan_dir)}
    except OSError:
        return False
    if names != {KEY_FILE}:
        return False
    try:
        (plan_dir / KEY_FILE).unlink()
        plan_dir.rmdir()
    except OSError:
        return False
    return True
