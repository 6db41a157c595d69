"""``--keep-checkpoints`` at the edge: remove what ``ckpt.retention`` chose, on every host.

After every save whose ``COMPLETE`` and rename succeeded (never after a failed
one), :meth:`Retention.after_save` runs on every rank, collectively:

1. each directory's owner rank (one per machine and path, ``Checkpointer.owner``)
   lists its job directory: the entries, the steps it sees complete and
   authentic, and the pins that still hold (lapsed pin files it removes); every
   rank adds the steps its uploader still reads from disk;
2. every rank gathers all of that and so computes the same complete set (the
   union: only rank 0's host holds ``COMPLETE``) and pinned set (every host's
   pins, every rank's uploads in flight, and the step this run resumed from until
   it has saved K newer ones);
3. each owner removes from its own directory only what ``choose_prune`` gives it,
   renaming each step to ``.del-step-*`` before deleting it. Hosts sharing one
   directory (NFS) each have an owner; either may find the other's removal done;
4. rank 0 prints one line: what went, on which hosts, what is kept.

A removal that fails warns (and is retried after the next save); it never stops
training. The remote copy is pruned by rank 0's uploader right after it marks a
step ``COMPLETE`` there (:meth:`Retention.prune_remote`): rank 0 alone marks steps
complete, and does so only once every rank's files of that step arrived, so no
upload of an older complete step can be in flight; incomplete steps (uploads of
other ranks, superseded steps) are never touched.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from autohet_cli.ckpt.files import list_steps, write_atomic
from autohet_cli.ckpt.format import ABANDONED_PREFIX, parse_step_dir, step_dir_name
from autohet_cli.ckpt.jobdir import remove_prefixed
from autohet_cli.ckpt.remote import RemoteCopy
from autohet_cli.ckpt.retention import (
    Pin,
    Prune,
    choose_prune,
    deleting_name,
    parse_pin_name,
    pin_from_text,
    pin_holds,
    pin_name,
    pin_to_text,
    prune_message,
)
from autohet_cli.errors import ConfigError
from autohet_cli.pids import process_gone
from autohet_cli.workerbase.records import say

# How long a reader's pin lasts where its death cannot be seen (another machine on NFS).
READ_PIN_TTL_S = 12 * 3600.0


def writer_gone(pin: Pin, machine: str | None = None) -> bool:
    """Whether the pin's writer ran on this machine (``machine``, default the host
    name) and its process has ended."""
    return process_gone(pin.pid, pin.machine, here=machine)


def read_pins(
    names: Iterable[str], read: Callable[[str], str], *, now_unix: float
) -> tuple[set[int], list[str]]:
    """The steps pinned by the pin files among ``names`` (``read(name)`` gives one's
    text), and the pin files that no longer hold: lapsed, their writer gone, or
    unreadable (pins are written whole, so an unreadable one is junk)."""
    holding: set[int] = set()
    lapsed: list[str] = []
    for name in names:
        step = parse_pin_name(name)
        if step is None:
            continue
        try:
            pin = pin_from_text(read(name), name)
        except (OSError, UnicodeDecodeError, ConfigError):
            lapsed.append(name)
            continue
        if pin.step == step and pin_holds(pin, now_unix=now_unix, writer_gone=writer_gone(pin)):
            holding.add(step)
        else:
            lapsed.append(name)
    return holding, lapsed


def write_pin(job_dir: Path, step: int, *, holder: str, ttl_s: float) -> Path:
    """Pin ``step`` for this process (written whole: temp file + rename)."""
    pin = Pin(
        step=step,
        holder=holder,
        machine=socket.gethostname(),
        pid=os.getpid(),
        expires_unix=time.time() + ttl_s,
    )
    path = job_dir / pin_name(step, secrets.token_hex(6))
    write_atomic(path, pin_to_text(pin).encode())
    return path


@contextmanager
def pinned(job_dir: Path, step: int, *, holder: str, ttl_s: float) -> Iterator[Path]:
    """Keep ``step`` of the job in ``job_dir`` while the block runs."""
    path = write_pin(job_dir, step, holder=holder, ttl_s=ttl_s)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


@contextmanager
def reading_step(step_dir: Path, *, holder: str, ttl_s: float = READ_PIN_TTL_S) -> Iterator[None]:
    """Pin the step ``step_dir`` while this process reads it (``autohet export``), so a
    run of its job does not prune it meanwhile. Best effort: where the job directory
    cannot be written (a read-only copy) no run prunes it either."""
    step = parse_step_dir(step_dir.name)
    try:
        path = (
            write_pin(step_dir.parent, step, holder=holder, ttl_s=ttl_s)
            if step is not None
            else None
        )
    except OSError:
        path = None
    try:
        yield
    finally:
        if path is not None:
            path.unlink(missing_ok=True)


def remove_steps(job_dir: Path, prune: Prune) -> tuple[list[int], list[str]]:
    """Delete ``prune.remove`` and ``prune.leftovers`` from ``job_dir``: the steps this
    call removed, and what could not be removed (retried at the next prune)."""
    removed: list[int] = []
    errors: list[str] = []
    for step in prune.remove:
        src = job_dir / step_dir_name(step)
        doomed = job_dir / deleting_name(step, secrets.token_hex(4))
        try:
            src.rename(doomed)  # from here on no reader takes it for a step
        except FileNotFoundError:
            continue  # another owner of a shared directory took it
        except OSError as exc:
            errors.append(f"cannot remove {src}: {exc.strerror or exc}")
            continue
        removed.append(step)
        _delete(doomed, errors)
    for name in prune.leftovers:
        _delete(job_dir / name, errors)
    return removed, errors


def _delete(path: Path, errors: list[str]) -> None:
    # ignore_errors: another owner of a shared directory may delete the same files.
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        errors.append(f"could not delete all of {path} (it is retried after the next save)")


class Retention:
    """Keep the newest ``keep`` complete steps of one job (0: every step); see above."""

    def __init__(
        self,
        *,
        keep: int,
        job: str,
        plan_dir: Path,
        key: bytes,
        group: Any,
        owner: bool,
        host: str,
        remote: RemoteCopy | None = None,
    ) -> None:
        if keep < 0:
            raise ValueError(f"--keep-checkpoints must be >= 0, got {keep}")
        self.keep, self.job, self.plan_dir, self.key = keep, job, plan_dir, key
        self.group, self.owner, self.host, self.remote = group, owner, host, remote
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.source: int | None = None  # the step this run resumed from, while held
        self._newer_saved = 0
        self._host_pins: frozenset[int] = frozenset()  # from the last prune, every host's

    def hold(self, step: int) -> None:
        """This run resumed from ``step``: keep it until it has saved ``keep`` newer ones."""
        self.source, self._newer_saved = step, 0

    def pinned(self) -> set[int]:
        """Steps no prune of this run removes now (besides the remote copy's own pins)."""
        return set(self._host_pins) | ({self.source} if self.source is not None else set())

    def after_save(self, step: int, *, reading: Collection[int] = ()) -> None:
        """Prune every host's directory after ``step`` was saved whole (collective).
        ``reading``: steps this rank's uploader still reads from disk."""
        if self.source is not None and step > self.source:
            self._newer_saved += 1
            if self._newer_saved >= self.keep:
                self.source = None
        if self.keep == 0:
            return
        views: list[Any] = [None] * self.world_size
        dist.all_gather_object(views, (self._view(), sorted(reading)), group=self.group)
        complete: set[int] = set()
        pins: set[int] = set()
        uploading: set[int] = set()  # local files only: the remote prune needs none of it
        for view, busy in views:
            uploading.update(busy)
            if view is not None:
                complete.update(view["complete"])
                pins.update(view["pins"])
        mine, _ = views[self.rank]
        self._host_pins = frozenset(pins)
        report: tuple[str, list[int], list[str]] | None = None
        names = mine["names"] if mine else ()
        held = self.pinned() | uploading
        prune = choose_prune(names, complete=complete, keep=self.keep, pinned=held)
        if mine is not None:
            report = (self.host, *remove_steps(self.plan_dir, prune))
            if mine["error"]:
                report[2].append(mine["error"])
        reports: list[Any] = [None] * self.world_size
        dist.all_gather_object(reports, report, group=self.group)
        if self.rank == 0:
            self._say_removed(prune, [r for r in reports if r is not None])
        if self.owner:
            self._drop_abandoned(step)

    def _drop_abandoned(self, step: int) -> None:
        """The steps a resume set aside (``jobdir.set_aside_newer``) go once this run
        has a complete step of its own: kept until then (the user may go back to
        them), but never beside the new run's for good, where they would fill the
        disk (15.9 GB each for a 1.2B model) outside ``--keep-checkpoints``."""
        aside = remove_prefixed(self.plan_dir, ABANDONED_PREFIX)
        if aside and self.rank == 0:
            say(
                f"checkpoints: removed {len(aside)} step(s) of the run this one went back "
                f"from ({', '.join(aside)}), now that step {step} of this run is complete"
            )

    def _view(self) -> dict[str, Any] | None:
        """What the owner of this host's directory sees in it (None: not the owner)."""
        if not self.owner:
            return None
        d = self.plan_dir
        try:
            names = [p.name for p in d.iterdir()]
            steps = list_steps(d, self.key)
            pins, lapsed = read_pins(
                names, lambda n: (d / n).read_text(encoding="utf-8"), now_unix=time.time()
            )
        except OSError as exc:
            return {"names": [], "complete": [], "pins": [], "error": f"cannot list {d}: {exc}"}
        for name in lapsed:
            (d / name).unlink(missing_ok=True)
        complete = sorted(s for s, why in steps.items() if why is None)
        return {"names": names, "complete": complete, "pins": sorted(pins), "error": None}

    def _say_removed(self, prune: Prune, reports: list[tuple[str, list[int], list[str]]]) -> None:
        by_host: dict[tuple[int, ...], list[str]] = {}
        for host, removed, errors in reports:
            for error in errors:
                say(f"warning: checkpoints on {host}: {error}")
            if removed:
                by_host.setdefault(tuple(removed), []).append(host)
        for steps, hosts in by_host.items():
            self._say(steps, prune, f" on {', '.join(sorted(set(hosts)))}")

    def prune_remote(self, step: int) -> None:
        """After rank 0's uploader marked ``step`` complete in the remote copy (its thread)."""
        remote = self.remote
        if remote is None or self.keep == 0:
            return
        names = remote.entries()
        complete = remote.complete_steps(self.key, names)
        pins, lapsed = read_pins(names, remote.read_entry, now_unix=time.time())
        for name in lapsed:
            remote.remove_entry(name)
        prune = choose_prune(names, complete=complete, keep=self.keep, pinned=self.pinned() | pins)
        removed = []
        for s in prune.remove:
            remote.remove_step(s)
            removed.append(s)
        if removed:
            where = f" from the remote copy {remote.url}"
            self._say(removed, prune, where)

    def _say(self, removed: Sequence[int], prune: Prune, where: str) -> None:
        say(prune_message(job=self.job, removed=removed, prune=prune, keep=self.keep, where=where))
