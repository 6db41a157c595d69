"""A save that failed: why, in words a user can act on, and what is left behind.

A periodic save that fails (a full or read-only disk, a quota, a flaky mount) must
not end the run: the steps saved before it are kept, the next save tries again,
and the log says which step was lost and why (Megatron users ask for the same).
A save that ends training (the last step's, a preemption notice's) has no next
save to try, so its failure stops the worker with the same sentence.

DCP and torch report a full disk in their own words ("unexpected pos 704 vs 598"
from torch's zip writer, a bare EFBIG): the checkpoint directory's file system is
asked afterwards whether it is full or read-only, so the cause is named.

The checkpointer hands itself to ``after_failure``; it is typed as ``FailedSaveView``
(what this module reads of it), so this module never imports the checkpointer above
it (``ckpt.view``)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from autohet_cli.ckpt.files import CheckpointError, list_steps
from autohet_cli.ckpt.format import COMPLETE, step_dir_name
from autohet_cli.ckpt.jobdir import clear_step
from autohet_cli.ckpt.state import checkpoint_failure
from autohet_cli.ckpt.view import JobView
from autohet_cli.errors import AutohetError
from autohet_cli.workerbase.records import say

# A file system with less free than this after a failed write was what failed it.
NEARLY_FULL_BYTES = 64 << 20


class FailedSaveView(JobView, Protocol):
    """The checkpointer as ``after_failure`` uses it: the job, the ranks, and the
    list of saves that failed (reported; training went on)."""

    failed_steps: list[int]


def disk_diagnosis(path: Path) -> str:
    """ " (the file system of PATH is full: ...)" or read-only, else ""."""
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
        usage = shutil.disk_usage(where)
    except OSError:
        return ""
    if st.f_flag & os.ST_RDONLY:
        return (
            f" ({where} is on a read-only file system: remount it or pass another --checkpoint-dir)"
        )
    if usage.free < NEARLY_FULL_BYTES:
        return (
            f" (the file system of {where} is full: {_size(usage.free)} free of "
            f"{_size(usage.total)}; free space there or pass another --checkpoint-dir)"
        )
    return ""


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def save_failure(step: int, exc: BaseException, where: Path) -> CheckpointError:
    """``exc`` (an OSError, torch's or DCP's words) as a CheckpointError naming the
    step, the cause and, where the disk is to blame, the disk."""
    if isinstance(exc, CheckpointError):
        text = str(exc)
        prefix = f"step {step} was not saved: "
        if text.startswith(prefix):
            text = text[len(prefix) :]
    elif isinstance(exc, OSError):
        name = errno.errorcode.get(exc.errno or 0, "")
        text = f"{exc.strerror or exc}" + (f" [{name}]" if name else "")
        text += f" ({exc.filename})" if exc.filename else ""
    else:
        text = f"{type(exc).__name__}: {exc}"
    return CheckpointError(f"step {step} was not saved: {text}{disk_diagnosis(where)}")


def after_failure(ckpt: FailedSaveView, step: int, failure: BaseException | None) -> int:
    """Every rank, once every rank knows step ``step`` failed somewhere: agree on its
    cause; raise it when it is not a checkpoint's (a bug), else say it (rank 0),
    clear the step's leftovers and return ``step``: training goes on."""
    mine = None if failure is None else (isinstance(failure, CheckpointError), str(failure))
    done_here = _complete_here(ckpt, step)
    seen: list[Any] = [None] * ckpt.world_size
    dist.all_gather_object(seen, (mine, done_here), group=ckpt.group)
    reported = [m for m, _ in seen if m is not None]
    complete = any(c for _, c in seen)  # only rank 0's host holds COMPLETE
    if failure is not None and not isinstance(failure, CheckpointError):
        raise failure
    if any(not ours for ours, _ in reported):
        raise CheckpointError(
            f"step {step} was not saved: it failed on another rank (its log says why)"
        )
    message = reported[0][1] if reported else f"step {step} was not saved"
    if complete:  # it failed after COMPLETE (pruning, say): the step itself is whole
        if ckpt.rank == 0:
            say(f"warning: step {step} is saved, but what follows a save failed: {message}")
        return step
    if ckpt.owner:  # never COMPLETE: the next save of this step starts afresh
        try:
            clear_step(ckpt.plan_dir, step)
        except OSError:
            pass  # the next start clears leftovers again
    ckpt.failed_steps.append(step)
    if ckpt.rank == 0:
        try:
            complete_steps = [
                s for s, why in list_steps(ckpt.plan_dir, ckpt.key).items() if not why
            ]
            newest = f"step {max(complete_steps)}" if complete_steps else "none"
        except OSError as exc:  # the failing disk itself
            newest = f"unknown ({exc.strerror or exc})"
        say(
            f"warning: {message}; training goes on and the next save tries again (the "
            f"newest complete step on this host: {newest})"
        )
    return step


def _complete_here(ckpt: FailedSaveView, step: int) -> bool:
    try:
        return (ckpt.plan_dir / step_dir_name(step) / COMPLETE).is_file()
    except OSError:
        return False


def caused_by_the_disk(errors: list[BaseException], where: Path) -> bool:
    """Whether every error of a failed DCP save is the storage's (a disk, a mount,
    our own checks), which training may outlive; a bug inside DCP or a model's
    state (a TypeError, say) is not, and stops the run like any bug."""

    def one(e: BaseException) -> bool:
        if isinstance(e, OSError | AutohetError):
            return True
        return isinstance(e, RuntimeError) and bool(disk_diagnosis(where))

    return all(one(e) for e in errors)


def why_not_saved(step: int, exc: BaseException, where: Path) -> BaseException:
    """What a failed second half of a save (``ckpt.finish``) of step ``step`` leaves
    for the training thread to report or raise (``Checkpointer.poll``): a failure of
    the storage (a full or failing disk, our own checks) as a CheckpointError naming
    the step and its cause, which training outlives; anything else (a bug, not the
    disk) as it is, to be raised on every rank."""
    if isinstance(exc, CheckpointException):
        errors = [error for error, _trace in exc.failures.values()]
        if caused_by_the_disk(errors, where):
            return save_failure(step, checkpoint_failure(exc), where)
        return exc
    if isinstance(exc, OSError | CheckpointError):  # a full or failing disk, named
        return save_failure(step, exc, where)
    if isinstance(exc, RuntimeError):  # torch's own words for a short write
        failure = save_failure(step, exc, where)
        return failure if disk_diagnosis(where) else exc
    return exc
