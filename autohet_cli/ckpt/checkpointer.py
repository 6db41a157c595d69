"""Checkpoints: DCP on every host's own disk, an authenticated manifest, COMPLETE last.

The format (layout, manifest, key, authentication) is ``autohet_cli.ckpt.format``
and docs/checkpoint-format.md; files, keys and private directories are
``ckpt.files``; the remote copy is ``ckpt.remote``. This module is the top of the
package: the helpers it hands itself to see it through ``ckpt.view``'s protocols and
never import it, and it sees the runtime's trainer the same way.

Where
    ``<checkpoint dir>/<plan name>/<job>/step-<N:08d>/`` on every host. The job is
    the run namespace (``--job``): a fresh launch starts a new one, a resumed or
    recovered run continues its own, so two runs never mix.

Saving (every rank, collectively; asynchronous)
    Training stops only to agree on the step and to snapshot each rank's state into
    reused host buffers (``ckpt.snapshot``: pinned on GPUs); the rest runs in a
    background thread with a process group of its own, at most one save in flight
    (the next save waits for it). A step is written under ``.tmp-step-<N>`` and
    renamed into place on every host once every rank's files are durable, and
    becomes ``COMPLETE`` only after that, so a complete step is whole on every host.
    A ``COMPLETE`` step is never written again. A resume sets the job's later steps
    aside first (the run it went back from, ``jobdir.set_aside_newer``), so the
    resumed run saves its own. Interrupted saves' leftovers (``.tmp-*``) are removed
    when a run starts (``ckpt.jobdir``). Each rank hands
    ``torch.distributed.checkpoint.save`` a ``FileSystemWriter`` on ITS host's
    directory with several writer threads (``ckpt.persist``): DCP names every rank's
    data files (``__<rank>_<n>.distcp``), only the coordinator writes ``.metadata``,
    and its planner deduplicates replicated entries onto one of their holders, so a
    loading rank may need a file another host wrote. Entries of no layer (``step``,
    ``run``, ...) are saved by rank 0 alone, so they all land in rank 0's files.
    Every file is hashed on its way out and fsynced; rank 0 gathers the entries once
    every rank's files are durable, records which layers each data file holds and
    which holds the shared entries (from the ``.metadata`` it wrote: recovery's
    "layers" rule moves only what a host reads), and once the step directories are
    in place writes ``manifest.json`` signed with the job key (HMAC-SHA256) and
    ``COMPLETE`` last, so a crash mid-save never leaves a COMPLETE step. The final
    and emergency saves write straight from the training state when no snapshot
    buffers exist yet (nothing would overlap the write). Where host memory is short
    for the snapshot the rank writes synchronously, and says why. Every rank learns
    together at each step end whether the save in flight succeeded (one small
    all-reduce while one is in flight, ``ckpt.inflight``). A failed periodic save is
    named with its cause (a full or read-only disk included) and training goes on; a
    failed last or emergency save fails the run (``ckpt.failures``). The state is
    ``Trainer.state_dict`` with the optimizer flattened to one entry per full
    parameter name, and a tied parameter's optimizer state filed under the first
    name of its group whatever copy a rank holds, so every entry has one name in
    every plan. Each save's figures (``ckpt.persist.SaveRecord``) go to the
    listeners (the metrics file and the log, on rank 0).

Keeping (``--keep-checkpoints K``, ``ckpt.prune``)
    After a save whose ``COMPLETE`` and rename succeeded, every host's directory
    owner removes the job's complete steps beyond the newest K, except pinned
    ones (the step this run resumed from, until it saved K newer; steps
    ``autohet recover`` copies); rank 0's uploader does the same in the remote
    copy once a step is complete there. A failed save removes nothing.

The job key
    ``<job dir>/.autohet-key`` (0600). ``autohet launch`` creates it and copies it to
    every host over SSH before the workers start. A worker started without the
    launcher (tests, a hand-run torchrun) makes one on rank 0 and sends it to the
    ranks that lack it over the process group; every rank then checks that all
    hold the same key. It is checked again at every save: a key deleted or
    replaced during the run stops it (``ckpt.jobdir``). A run that saved nothing
    removes its job directory at the end.

Loading (``--resume [STEP]``, ``ckpt.loading``)
    Every rank lists its own job directory and verifies each manifest's HMAC; the
    newest step some rank sees complete and authentic is chosen (an explicit STEP
    that is not is refused, naming the directory and why). The lowest rank holding
    it checks ``.metadata`` against the verified manifest and broadcasts both, so
    nothing unauthenticated is ever unpickled. DCP then plans which stored chunks
    each rank reads (resharding across TP degrees and stage cuts by full names);
    each rank verifies the sha256 of exactly the files it reads before reading
    them, fetching a missing one from the remote copy when that has it.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autohet_cli.ckpt import finish, jobdir, loading
from autohet_cli.ckpt.failures import after_failure, why_not_saved
from autohet_cli.ckpt.files import (
    CheckpointError,
    ensure_private_dir,
    incomplete_reason,
    list_steps,
    sha256_file,
)
from autohet_cli.ckpt.finish import SaveJob
from autohet_cli.ckpt.format import COMPLETE, TMP_PREFIX, check_job, step_dir_name
from autohet_cli.ckpt.inflight import SaveInFlight
from autohet_cli.ckpt.layout import CHECKPOINT_DIR_ENV, DEFAULT_JOB
from autohet_cli.ckpt.memory import available_memory_bytes, memory_verdict, ranks_on_this_host
from autohet_cli.ckpt.persist import SaveRecord, quiet_writer_thread_errors, writer_threads
from autohet_cli.ckpt.prune import Retention
from autohet_cli.ckpt.remote import RemoteCopy, Uploader, remote_url
from autohet_cli.ckpt.retention import DEFAULT_KEEP
from autohet_cli.ckpt.snapshot import Snapshotter
from autohet_cli.ckpt.state import keep_written, rename_optimizer, tied_aliases
from autohet_cli.ckpt.view import CheckpointedTrainer
from autohet_cli.peer.replicate import Replicator
from autohet_cli.workerbase.records import say

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "DEFAULT_JOB",
    "CheckpointError",
    "rename_optimizer",
    "tied_aliases",
    "Checkpointer",
    "RemoteCopy",
    "checkpoint_root",
    "incomplete_reason",
    "list_steps",
    "remote_url",
    "sha256_file",
]

COLLECTIVE_TIMEOUT_S = 1800.0  # for the collectives of a save or load


def checkpoint_root(explicit: Path | None, run_dir: Path | None) -> Path | None:
    """``--checkpoint-dir``, else ``$AUTOHET_CHECKPOINT_DIR``, else RUN_DIR/../../checkpoints."""
    if explicit is not None:
        return Path(os.path.expanduser(str(explicit)))
    if env := os.environ.get(CHECKPOINT_DIR_ENV):
        return Path(os.path.expanduser(env))
    if run_dir is not None:
        return run_dir.parent.parent / "checkpoints"
    return None


# --------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Save and load ``trainer``'s state under ``root/<plan name>/<job>/`` (collective calls)."""

    def __init__(
        self,
        trainer: CheckpointedTrainer,
        *,
        root: Path,
        plan_ref: str,
        plan_sha256: str,
        job: str = DEFAULT_JOB,
        remote: RemoteCopy | None = None,
        upload_timeout_s: float = 1800.0,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        keep: int = DEFAULT_KEEP,
        background: bool = True,
        replicas: int = 0,
        replica_budget_bytes: int | None = None,
    ) -> None:
        self.trainer = trainer
        self.job = check_job(job)
        self.plan_dir = root / trainer.plan.name / job
        self.plan_ref, self.plan_sha256 = plan_ref, plan_sha256
        self.remote = remote
        self.uploader = (
            Uploader(remote, timeout_s=upload_timeout_s, on_complete=self._prune_remote)
            if remote
            else None
        )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # Checkpoint collectives get their own CPU group and timeout: writing a big
        # checkpoint may take longer than the training collectives' timeout allows.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        # The second half of a save (writing, the manifest, COMPLETE, pruning) runs in a
        # background thread while training goes on: its collectives get a group of
        # their own, which nothing else uses, so the two threads never interleave
        # collectives on one group.
        self.persist_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.snapshots = Snapshotter()
        quiet_writer_thread_errors()
        self.background = background
        self.listeners: list[Callable[[SaveRecord], None]] = []  # rank 0, after each save
        self.last_record: SaveRecord | None = None  # the latest finished save's figures
        self.inflight = SaveInFlight()  # at most one save in flight (ckpt.inflight)
        self.resumed_step: int | None = None  # the step this run loaded (resume)
        self.failed_steps: list[int] = []  # saves that failed (reported; training went on)
        self.last_alloc_s = 0.0  # of the latest save: new snapshot buffers
        self.host = trainer.runtime.info.device.host
        problem = self._prepare_dir(root)
        self.agree_no_problem(problem)
        # The lowest rank writing to a directory (one machine, one path) owns it.
        where = (socket.gethostname(), str(self.plan_dir.resolve()))
        places: list[Any] = [None] * self.world_size
        dist.all_gather_object(places, where, group=self.group)
        self.owner = places.index(where) == self.rank
        # Every rank of a machine allocates its snapshot at once and shares its cores.
        self.ranks_on_host = ranks_on_this_host([m for m, _ in places], where[0])
        self.writer_threads = writer_threads(self.ranks_on_host)
        # Hosts sharing this directory (an NFS home): each has an owner, and either may
        # find the other's work done (a rename, a cleanup).
        self.shared_dir = len({m for m, d in places if d == where[1]}) > 1
        self.key = jobdir.agree_key(self)
        if self.owner:
            jobdir.clear_leftovers(self)
        self.retention = Retention(
            keep=keep,
            job=self.job,
            plan_dir=self.plan_dir,
            key=self.key,
            group=self.persist_group,  # it prunes after a save, in the persist thread
            owner=self.owner,
            host=self.host,
            remote=remote,
        )
        # A second copy of each host's shards on partner hosts (peer.replicate).
        self.replicator = (
            Replicator(
                host=self.host,
                plan_dir=self.plan_dir,
                key=self.key,
                replicas=replicas,
                budget_bytes=replica_budget_bytes,
                owner=self.owner,
            )
            if replicas > 0 and self.world_size > 1
            else None
        )
        if self.replicator is not None and self.replicator.problem:
            say(f"warning: {self.host}: no replicas of other hosts here: {self.replicator.problem}")

    def _prepare_dir(self, root: Path) -> str | None:
        try:
            ensure_private_dir(self.plan_dir, root)
        except CheckpointError as exc:
            return str(exc)
        return None

    def agree_no_problem(self, problem: str | None, *, group: Any = None) -> None:
        """Every rank stops with the first rank's problem, not only the rank that saw it."""
        seen: list[Any] = [None] * self.world_size
        dist.all_gather_object(seen, problem, group=group or self.group)
        first = next((p for p in seen if p), None)
        if first:
            raise CheckpointError(first)

    # ----------------------------------------------------------------- state

    def _aliases(self, optimizer: Mapping[str, Any]) -> dict[str, str]:
        return tied_aliases(list(optimizer), self.trainer.parts.tied)

    def state(self, *, template: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
        """The trainer's state as checkpoints name it, and the tied-name aliases used;
        ``template``: the entries a load fills (``train_state.state_dict``)."""
        state = self.trainer.state_dict(flat_optimizer=True, template=template)
        aliases = self._aliases(state["optimizer"])
        state["optimizer"] = rename_optimizer(state["optimizer"], aliases)
        return state, aliases

    # ----------------------------------------------------------------- save

    def save(self, *, last: bool = False) -> Path | None:
        """Save step ``trainer.step``; returns as soon as training may go on.

        Training waits for the previous save if it is still in flight (at most one),
        agrees on the step with every rank and snapshots its state into host memory;
        the files, the manifest and COMPLETE follow in the background (``wait``
        returns when they are durable). When host memory is short, or
        ``background`` is off, the whole save runs here and says why. Returns this
        rank's step directory to be (None: that step is already saved and kept).
        ``last``: training is over (the final save, a preemption notice's): with no
        snapshot buffers yet, writing straight from the training state beats
        allocating them first, since nothing would overlap the write anyway.
        """
        started = time.monotonic()
        self.poll(block=True)  # the previous save: durable, or its failure reported
        self.last_alloc_s = 0.0
        step = self.trainer.step
        final = self.plan_dir / step_dir_name(step)
        tmp = self.plan_dir / f"{TMP_PREFIX}{step_dir_name(step)}"
        complete = (final / COMPLETE).is_file()
        seen: list[Any] = [None] * self.world_size
        dist.all_gather_object(seen, (complete, jobdir.key_problem(self)), group=self.group)
        problem = next((p for _, p in seen if p), None)
        if problem:
            raise CheckpointError(problem)
        if any(c for c, _ in seen):  # the step resumed from, or a fresh run in an old job
            if self.rank == 0:
                say(f"note: step {step} of job {self.job} is already saved and complete; kept")
            return None
        if self.owner:  # leftovers of an interrupted attempt of this job (never COMPLETE)
            # Hosts sharing one directory (NFS) each have an owner: both may clear it.
            for d in (tmp, final):
                shutil.rmtree(d, ignore_errors=True)
        dist.barrier(group=self.group)
        state, _ = self.state()
        runtime = self.trainer.runtime
        state = keep_written(
            state,
            lambda layers: runtime.topology.writes_layout(runtime.info.rank, layers),
            self.trainer.parts.tied,
            shared=self.rank == 0,  # entries of no layer: rank 0's file alone
        )
        why_inline = self._why_inline(state, step, last=last)
        if why_inline is None:
            state = self.snapshots.take(state)
            self.last_alloc_s = self.snapshots.last_alloc_s
        job = SaveJob(
            step=step,
            state=state,
            tmp=tmp,
            final=final,
            started=started,
            inline=bool(why_inline),
            alloc_s=self.last_alloc_s,
        )
        job.blocked_s = time.monotonic() - started  # inline: updated when the save is done
        self.inflight.start(job, self._persist, inline=why_inline is not None)
        return final

    def _why_inline(self, state: dict[str, Any], step: int, *, last: bool) -> str | None:
        """Why this rank writes step ``step`` synchronously (None: in the background)."""
        if not self.background:
            return "asynchronous saves are off"
        new_bytes = self.snapshots.new_bytes(state)
        if last and new_bytes:
            return "the last save of the run, and no snapshot buffers yet"
        verdict = memory_verdict(
            new_bytes,
            ranks_on_host=self.ranks_on_host,
            available_bytes=available_memory_bytes(),
        )
        if verdict.fits:
            return None
        say(
            f"note: rank {self.rank} on {self.host} writes step {step} synchronously "
            f"(training waits): {verdict.reason}"
        )
        self.snapshots.release()  # the buffers would not be reused either
        return verdict.reason

    def wait(self) -> None:
        """Return when the save in flight (if any) is durable; raise its failure."""
        self.inflight.wait()

    def poll(self, *, block: bool = False) -> int | None:
        """Collective, at every step end while a save is unconfirmed (and before the
        next save, ``block``: after waiting for it): every rank learns together
        whether it is durable. A save that failed anywhere is reported on rank 0
        with its cause and its leftovers removed, and training goes on (alone, the
        failed rank would stop while the others trained on into it); returns that
        step. A failure that is no checkpoint's (a bug) is raised on every rank."""
        failed = self.inflight.settle(self.agree_max, block=block)
        return None if failed is None else after_failure(self, *failed)

    def _persist(self, job: SaveJob) -> None:
        """The second half of a save (this rank's files, then with every rank: the
        manifest, COMPLETE, the rename, pruning), in the persist thread or inline.
        A failure is kept for the training thread, named where the disk is to blame
        (``failures.why_not_saved``): poll() reports it, or raises a bug on every rank."""
        try:
            finish.write_and_finish(self, job)
        except BaseException as exc:  # kept for the training thread, never raised here
            self.inflight.failure = why_not_saved(job.step, exc, self.plan_dir)

    def previous_record(self) -> dict[str, float] | None:
        """The figures of this job's last save on this host (None: unknown)."""
        return finish.previous_record(self.plan_dir)

    def _prune_remote(self, step: int) -> None:
        self.retention.prune_remote(step)

    def agree_max(self, values: Sequence[float]) -> list[float]:
        """The element-wise maximum of ``values`` over all ranks (for the save schedule)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [float(x) for x in t.tolist()]

    def close(self) -> None:
        """Wait for the save in flight to be durable, then for this rank's upload."""
        try:
            self.wait()
        except CheckpointError:
            if self.owner and self.inflight.pending:  # the last save failed: no leftovers
                jobdir.clear_step(self.plan_dir, self.inflight.step)
            raise
        finally:
            if self.uploader is not None:
                self.uploader.join()
            if self.replicator is not None:
                self.replicator.close()
            self.snapshots.release()
        self.forget_if_unused()

    def forget_if_unused(self) -> None:
        """The owner removes the job's directory when this run left nothing in it but
        the key (no save, no resume: a ``--checkpoint-every 0`` run, say), so runs
        do not pile up empty jobs; see ``jobdir.remove_if_unused``."""
        if self.owner and self.resumed_step is None:
            jobdir.remove_if_unused(self.plan_dir)

    # ----------------------------------------------------------------- load

    def resume(self, step: int | None = None) -> int | None:
        """Load ``step`` (None: the newest complete one); see ``ckpt.loading``."""
        self.resumed_step = loading.resume(self, step)
        if self.resumed_step is not None:
            jobdir.set_aside_newer(self, self.resumed_step)
        return self.resumed_step
