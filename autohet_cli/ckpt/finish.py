"""The second half of a save: this rank's files (hashed on their way out, fsynced),
then with every rank the manifest, COMPLETE, the rename, the figures and pruning.
It runs in the checkpointer's persist thread (or inline, for a synchronous save)
over the persist process group alone (``ckpt.checkpointer``).

The checkpointer hands itself to ``write_and_finish``, typed as ``SaveView`` (what
the second half of a save reads and sets of it), so this module never imports the
checkpointer above it (``ckpt.view``)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from autohet_cli.ckpt import sums
from autohet_cli.ckpt.files import CheckpointError, sha256_file, write_atomic
from autohet_cli.ckpt.format import COMPLETE, MANIFEST, METADATA, Manifest, signed_manifest_text
from autohet_cli.ckpt.notice import LAST_SAVE_FILE, LAST_SAVE_RECORD
from autohet_cli.ckpt.persist import SaveRecord, fsync_dir, hashing_writer
from autohet_cli.ckpt.prune import Retention
from autohet_cli.ckpt.remote import Uploader, UploadJob
from autohet_cli.ckpt.state import manifest_files, stored_layers, tied_layer_groups
from autohet_cli.ckpt.view import CheckpointedTrainer, JobView
from autohet_cli.peer.placement import Placement
from autohet_cli.peer.replicate import Replicator
from autohet_cli.peer.tally import Tally, summary
from autohet_cli.workerbase.records import say


class SaveView(JobView, Protocol):
    """The checkpointer as the second half of a save uses it: the job and the ranks,
    the persist group and writer threads, what the manifest records (the trainer's
    lineage and ties, the plan), where the step goes next (uploader, replicator,
    retention), who hears of it (``listeners``), and ``last_record``, which it sets."""

    trainer: CheckpointedTrainer
    plan_ref: str
    plan_sha256: str
    persist_group: Any
    writer_threads: int
    shared_dir: bool
    uploader: Uploader | None
    replicator: Replicator | None
    retention: Retention
    listeners: list[Callable[[SaveRecord], None]]
    last_record: SaveRecord | None


@dataclass(slots=True, kw_only=True)
class SaveJob:
    """A save between its snapshot and its COMPLETE."""

    step: int
    state: dict[str, Any]
    tmp: Path
    final: Path
    started: float  # time.monotonic() when training stopped for it
    inline: bool  # written synchronously (no snapshot)
    alloc_s: float = 0.0  # of the blocked time: new snapshot buffers (once per run)
    blocked_s: float = 0.0


def write_and_finish(ckpt: SaveView, job: SaveJob) -> None:
    """The second half of a save, on every rank (see ``ckpt.checkpointer``)."""
    group, tmp, step = ckpt.persist_group, job.tmp, job.step
    writer, fs = hashing_writer(tmp, thread_count=ckpt.writer_threads)
    dcp_save(job.state, storage_writer=writer, process_group=group)
    job.state = {}  # the snapshot's tensors stay in the reused buffers
    entries: list[dict[str, Any]] | str
    try:
        entries = _entries(ckpt, tmp, fs.written())
        fsync_dir(tmp)  # the files' directory entries, before COMPLETE can exist
    except OSError as exc:
        entries = f"cannot finish {tmp}: {exc.strerror or exc}"
    if job.inline:
        job.blocked_s = time.monotonic() - job.started
    gathered: list[Any] = [None] * ckpt.world_size
    peer = ckpt.replicator.info() if ckpt.replicator is not None else None
    dist.all_gather_object(gathered, (entries, job.blocked_s, job.alloc_s, peer), group=group)
    problems = [e for e, *_ in gathered if isinstance(e, str)]
    if problems:
        raise CheckpointError(f"step {step} was not saved: {problems[0]}")
    files = [e for rank_entries, *_ in gathered for e in rank_entries]
    placement, receivers = (
        ckpt.replicator.placement([g[3] for g in gathered], files)
        if ckpt.replicator is not None
        else (None, {})
    )
    # Every host's files are durable: the step directories go into place first, and
    # COMPLETE comes last, so no crash leaves a COMPLETE step whose files some host
    # still holds under its temporary name (a directory without COMPLETE is skipped).
    not_saved = f"step {step} was not saved: "
    problem = _rename(ckpt, tmp, job.final) if ckpt.owner else None
    if ckpt.owner and problem is None:  # what recover would otherwise read back
        sums.record(str(job.final), {str(e["path"]): str(e["sha256"]) for e in files})
    ckpt.agree_no_problem(problem and not_saved + problem, group=group)
    manifest = None
    if ckpt.rank == 0:
        try:
            manifest = _write_manifest(ckpt, job, files, placement)
        except OSError as exc:
            problem = f"cannot write the manifest of {job.final}: {exc.strerror or exc}"
        except Exception as exc:  # any other failure: the other ranks must not wait for it
            problem = f"cannot write the manifest of {job.final}: {type(exc).__name__}: {exc}"
    ckpt.agree_no_problem(problem and not_saved + problem, group=group)
    persist_s = time.monotonic() - job.started
    record = SaveRecord(
        step=step,
        # A synchronous save holds training until COMPLETE and the manifest are
        # written, not only until the data files are: it blocked for all of it.
        blocked_s=persist_s if job.inline else max(g[1] for g in gathered),
        persist_s=persist_s,
        nbytes=sum(int(e["bytes"]) for e in files),
        synchronous=job.inline,
        alloc_s=max(g[2] for g in gathered),
    )
    ckpt.last_record = record
    if ckpt.owner:
        _record_save(ckpt, record)
    if ckpt.uploader is not None:
        mine = tuple(str(e["path"]) for e in files if e["rank"] == ckpt.rank)
        ckpt.uploader.start(
            UploadJob(step=step, local_dir=job.final, names=mine, manifest=manifest)
        )
    # Only now, with this step whole on every host: older ones may go.
    reading = ckpt.uploader.reading() if ckpt.uploader is not None else set()
    ckpt.retention.after_save(step, reading=reading)
    if ckpt.rank == 0:
        _tell_listeners(ckpt, record)
    if placement is not None:
        _replicate(ckpt, job, files, placement, receivers)


def _replicate(
    ckpt: SaveView,
    job: SaveJob,
    files: list[dict[str, Any]],
    placement: Placement,
    receivers: dict[str, dict[str, Any]],
) -> None:
    """The step is saved; now its second copies (``peer.replicate``). A failure
    here is a warning: the step stays saved and COMPLETE."""
    assert ckpt.replicator is not None
    try:
        tally = ckpt.replicator.send(
            job.step,
            job.final,
            files,
            placement,
            receivers,
            rank=ckpt.rank,
            # at least a minute, else twice what the save itself took to be durable
            deadline_s=max(60.0, 2 * (time.monotonic() - job.started)),
        )
    except Exception as exc:  # any failure: the other ranks wait for this one below
        tally = Tally(errors=[f"{ckpt.host}: {type(exc).__name__}: {exc}"])
    tallies: list[Any] = [None] * ckpt.world_size
    dist.all_gather_object(tallies, tally, group=ckpt.persist_group)
    ckpt.replicator.forget(before_step=job.step)
    ckpt.replicator.saves += 1
    if ckpt.rank == 0:
        try:  # no collective follows: rank 0 alone may take its time or fail here
            tallies[0].errors += ckpt.replicator.complete(job.step, job.final, tallies, receivers)
        except Exception as exc:
            tallies[0].errors.append(f"{type(exc).__name__}: {exc}")
        for line in summary(job.step, tallies, placement, first=ckpt.replicator.saves == 1):
            say(line)


def _tell_listeners(ckpt: SaveView, record: SaveRecord) -> None:
    """The step is saved whatever a listener does: a failing one (a full run
    directory, a closed stdout) is named, not turned into a failed save, which
    would stop rank 0 alone while the others train on."""
    for listener in ckpt.listeners:
        try:
            listener(record)
        except Exception as exc:
            with contextlib.suppress(OSError):  # stderr itself may be gone
                say(
                    f"note: step {record.step} is saved; its figures could not be recorded: "
                    f"{type(exc).__name__}: {exc}"
                )


def _entries(ckpt: SaveView, tmp: Path, written: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's files: hashed on their way out (read back only where the
    stream could not be followed)."""
    mine = sorted(p.name for p in tmp.glob(f"__{ckpt.rank}_*.distcp"))
    if ckpt.rank == 0:
        mine.append(METADATA)
    out = []
    for name in mine:
        got = written.get(name)
        sha, nbytes = (
            (got.sha256, got.nbytes)
            if got is not None
            else (sha256_file(tmp / name), (tmp / name).stat().st_size)
        )
        out.append(
            {"path": name, "sha256": sha, "bytes": nbytes, "host": ckpt.host, "rank": ckpt.rank}
        )
    return out


def _write_manifest(
    ckpt: SaveView, job: SaveJob, files: list[dict[str, Any]], placement: Placement | None
) -> Manifest:
    lineage = getattr(ckpt.trainer, "lineage", None)
    model, order = lineage(job.step) if lineage is not None else (None, None)
    manifest = Manifest(
        model=model,
        data_order=order,
        step=job.step,
        plan=ckpt.plan_ref,
        plan_sha256=ckpt.plan_sha256,
        world_size=ckpt.world_size,
        files=manifest_files(
            files,
            # Where entries went, from the .metadata rank 0 (the coordinator) wrote:
            # the Metadata save() returns lacks storage_data under torch 2.11.
            stored_layers(FileSystemReader(job.final).read_metadata()),
        ),
        tied_layers=tied_layer_groups(ckpt.trainer.parts.tied),
        replicas=None if placement is None else dict(placement.partners),
    )
    write_atomic(job.final / MANIFEST, signed_manifest_text(manifest, ckpt.key).encode())
    write_atomic(job.final / COMPLETE, b"")
    fsync_dir(job.final)
    return manifest


def _rename(ckpt: SaveView, tmp: Path, final: Path) -> str | None:
    try:
        tmp.rename(final)
    except OSError as exc:
        if not (ckpt.shared_dir and final.is_dir()):  # another owner's rename (NFS)
            return f"cannot rename {tmp} to {final.name}: {exc.strerror or exc}"
    try:
        fsync_dir(ckpt.plan_dir)
    except OSError as exc:
        return f"cannot sync {ckpt.plan_dir}: {exc.strerror or exc}"
    return None


def _record_save(ckpt: SaveView, record: SaveRecord) -> None:
    """This host's save figures, for the next launch's spot-notice check (the time
    to a durable step, ``LAST_SAVE_FILE``) and the next run's save schedule
    (``LAST_SAVE_RECORD``). Best effort: a full disk here must not fail a save
    that succeeded."""
    try:
        write_atomic(ckpt.plan_dir / LAST_SAVE_FILE, f"{record.persist_s:.3f}\n".encode())
        if not record.synchronous:  # a synchronous save's blocked time says nothing of the next
            schedule = {**record.to_json(), "ckpt_alloc_s": round(record.alloc_s, 4)}
            write_atomic(ckpt.plan_dir / LAST_SAVE_RECORD, json.dumps(schedule).encode())
    except OSError:
        pass


def previous_record(plan_dir: Path) -> dict[str, float] | None:
    """The figures of a job's last asynchronous save on this host (``LAST_SAVE_RECORD``):
    its blocked time less the one-time allocation of the snapshot buffers (what a
    save costs once they exist) and its time to be durable; None when unknown."""
    try:
        got = json.loads((plan_dir / LAST_SAVE_RECORD).read_text(encoding="utf-8"))
        blocked = float(got["ckpt_blocked_s"]) - float(got.get("ckpt_alloc_s", 0.0))
        return {"ckpt_blocked_s": max(0.0, blocked), "ckpt_persist_s": float(got["ckpt_persist_s"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
