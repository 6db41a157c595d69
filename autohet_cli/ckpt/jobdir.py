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
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from autohet_cli.ckpt.files import CheckpointError, read_key, write_key
from autohet_cli.ckpt.format import (
    COMPLETE,
    KEY_FILE,
    TMP_PREFIX,
    new_key,
    parse_step_dir,
    step_dir_name,
)
from autohet_cli.errors import ConfigError
from autohet_cli.runtime.records import say

if TYPE_CHECKING:
    from autohet_cli.ckpt.checkpointer import Checkpointer


def has_steps(plan_dir: Path) -> bool:
    """Whether this host holds step directories of the job (complete or not)."""
    try:
        return any(parse_step_dir(e.name) is not None for e in os.scandir(plan_dir))
    except OSError:
        return False


def agree_key(ckpt: Checkpointer) -> bytes:
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


def key_problem(ckpt: Checkpointer) -> str | None:
    """Why this host's job key no longer matches the run's (None: it does); asked at
    every save, before anything is written."""
    path = ckpt.plan_dir / KEY_FILE
    try:
        on_disk = read_key(ckpt.plan_dir)
    except (CheckpointError, ConfigError) as exc:
        return f"the job key of {ckpt.plan_dir} is unusable: {exc}"
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


def clear_leftovers(ckpt: Checkpointer) -> None:
    """The owner's start: remove what interrupted saves of earlier runs left
    (``.tmp-*``: never COMPLETE, and no save of this job runs before ours)."""
    try:
        entries = [e for e in os.scandir(ckpt.plan_dir) if e.name.startswith(TMP_PREFIX)]
    except OSError:
        return
    for e in entries:
        shutil.rmtree(e.path, ignore_errors=True)
    if entries and ckpt.rank == 0:
        names = ", ".join(sorted(e.name for e in entries))
        say(f"note: removed the leftovers of interrupted saves in {ckpt.plan_dir}: {names}")


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
