"""Checkpoints: DCP on every host's own disk, an authenticated manifest, COMPLETE last.

The format (layout, manifest, key, authentication) is ``autohet_cli.ckpt.format``
and docs/checkpoint-format.md; files, keys and private directories are
``ckpt.files``; the remote copy is ``ckpt.remote``.

Where
    ``<checkpoint dir>/<plan name>/<job>/step-<N:08d>/`` on every host. The job is
    the run namespace (``--job``): a fresh launch starts a new one, a resumed or
    recovered run continues its own, so two runs never mix.

Saving (every rank, collectively)
    A step is written under ``.tmp-step-<N>`` and renamed into place when every
    rank is done, so a step directory is either whole or absent; a step that is
    already ``COMPLETE`` is never written again (it is kept, with a note), and
    only incomplete leftovers of this job are removed. Each rank hands
    ``torch.distributed.checkpoint.save`` a ``FileSystemWriter`` on ITS host's
    directory: DCP names every rank's data file (``__<rank>_0.distcp``), only the
    coordinator writes ``.metadata``, and its planner deduplicates replicated
    entries onto one of their holders, so a loading rank may need a file another
    host wrote. Entries of no layer (``step``, ``run``, ...) are saved by rank 0
    alone, so they all land in rank 0's file. Every rank hashes its own files;
    rank 0 gathers the entries, records which layers each data file holds and
    which holds the shared entries (from the ``.metadata`` it wrote: recovery's
    "layers" rule moves only what a host reads), writes ``manifest.json`` signed
    with the job key (HMAC-SHA256) and ``COMPLETE`` last. The state is
    ``Trainer.state_dict`` with the optimizer flattened to one entry per full
    parameter name, and a tied parameter's optimizer state filed under the first
    name of its group whatever copy a rank holds, so every entry has one name in
    every plan.

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
    hold the same key.

Loading (``--resume [STEP]``)
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

import hashlib
import os
import pickle
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from autohet_cli.ckpt.files import (
    CheckpointError,
    VerifyingReader,
    ensure_private_dir,
    incomplete_reason,
    list_steps,
    read_key,
    sha256_file,
    write_atomic,
    write_key,
)
from autohet_cli.ckpt.format import (
    COMPLETE,
    MANIFEST,
    METADATA,
    TMP_PREFIX,
    Manifest,
    check_job,
    new_key,
    signed_manifest_text,
    step_dir_name,
    verified_manifest,
)
from autohet_cli.ckpt.notice import LAST_SAVE_FILE
from autohet_cli.ckpt.prune import Retention
from autohet_cli.ckpt.remote import RemoteCopy, Uploader, UploadJob, remote_url
from autohet_cli.ckpt.retention import DEFAULT_KEEP
from autohet_cli.ckpt.schedule import CheckpointHook
from autohet_cli.ckpt.state import (
    checkpoint_failure,
    keep_written,
    manifest_files,
    rename_optimizer,
    stored_layers,
    tied_aliases,
    tied_layer_groups,
)
from autohet_cli.errors import ConfigError
from autohet_cli.runtime.records import say
from autohet_cli.runtime.trainer import Trainer

__all__ = [
    "CheckpointError",
    "rename_optimizer",
    "tied_aliases",
    "CheckpointHook",
    "Checkpointer",
    "RemoteCopy",
    "checkpoint_root",
    "incomplete_reason",
    "list_steps",
    "remote_url",
    "sha256_file",
]

CHECKPOINT_DIR_ENV = "AUTOHET_CHECKPOINT_DIR"
DEFAULT_JOB = "default"
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


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceData:
    manifest_text: str
    metadata: bytes


class Checkpointer:
    """Save and load ``trainer``'s state under ``root/<plan name>/<job>/`` (collective calls)."""

    def __init__(
        self,
        trainer: Trainer,
        *,
        root: Path,
        plan_ref: str,
        plan_sha256: str,
        job: str = DEFAULT_JOB,
        remote: RemoteCopy | None = None,
        upload_timeout_s: float = 1800.0,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        keep: int = DEFAULT_KEEP,
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
        self.host = trainer.runtime.info.device.host
        problem = self._prepare_dir(root)
        self._agree_no_problem(problem)
        # The lowest rank writing to a directory (one machine, one path) owns it.
        where = (socket.gethostname(), str(self.plan_dir.resolve()))
        places: list[Any] = [None] * self.world_size
        dist.all_gather_object(places, where, group=self.group)
        self.owner = places.index(where) == self.rank
        # Hosts sharing this directory (an NFS home): each has an owner, and either may
        # find the other's work done (a rename, a cleanup).
        self.shared_dir = len({m for m, d in places if d == where[1]}) > 1
        self.key = self._agree_key()
        self.retention = Retention(
            keep=keep,
            job=self.job,
            plan_dir=self.plan_dir,
            key=self.key,
            group=self.group,
            owner=self.owner,
            host=self.host,
            remote=remote,
        )

    def _prepare_dir(self, root: Path) -> str | None:
        try:
            ensure_private_dir(self.plan_dir, root)
        except CheckpointError as exc:
            return str(exc)
        return None

    def _agree_no_problem(self, problem: str | None) -> None:
        """Every rank stops with the first rank's problem, not only the rank that saw it."""
        seen: list[Any] = [None] * self.world_size
        dist.all_gather_object(seen, problem, group=self.group)
        first = next((p for p in seen if p), None)
        if first:
            raise CheckpointError(first)

    def _agree_key(self) -> bytes:
        """This job's key on every rank (see the module docstring), checked to agree."""
        try:
            mine: bytes | None = read_key(self.plan_dir)
            problem = None
        except (CheckpointError, ConfigError) as exc:
            mine, problem = None, str(exc)
        self._agree_no_problem(problem)
        digests: list[Any] = [None] * self.world_size
        digest = hashlib.sha256(mine).hexdigest() if mine is not None else None
        dist.all_gather_object(digests, digest, group=self.group)
        known = {d for d in digests if d is not None}
        if len(known) > 1:
            raise CheckpointError(
                f"the hosts hold different keys for job {self.job} under {self.plan_dir}: "
                "checkpoints of different runs are mixed there; start a new job "
                "(autohet launch starts one by default)"
            )
        if all(d is not None for d in digests):
            assert mine is not None
            return mine
        holder = next((r for r, d in enumerate(digests) if d is not None), 0)
        payload: list[Any] = [
            (mine if mine is not None else new_key()) if self.rank == holder else None
        ]
        dist.broadcast_object_list(payload, src=holder, group=self.group)
        key = payload[0]
        assert isinstance(key, bytes)
        return write_key(self.plan_dir, key) if mine is None else mine

    # ----------------------------------------------------------------- state

    def _aliases(self, optimizer: Mapping[str, Any]) -> dict[str, str]:
        return tied_aliases(list(optimizer), self.trainer.parts.tied)

    def _state(self) -> tuple[dict[str, Any], dict[str, str]]:
        state = self.trainer.state_dict(flat_optimizer=True)
        aliases = self._aliases(state["optimizer"])
        state["optimizer"] = rename_optimizer(state["optimizer"], aliases)
        return state, aliases

    # ----------------------------------------------------------------- save

    def save(self) -> Path | None:
        """Write step ``trainer.step``; returns this rank's step directory (None: kept)."""
        started = time.monotonic()
        step = self.trainer.step
        final = self.plan_dir / step_dir_name(step)
        tmp = self.plan_dir / f"{TMP_PREFIX}{step_dir_name(step)}"
        complete = (final / COMPLETE).is_file()
        seen: list[Any] = [None] * self.world_size
        dist.all_gather_object(seen, complete, group=self.group)
        if any(seen):
            if self.rank == 0:
                say(f"note: step {step} of job {self.job} is already saved and complete; kept")
            return None
        if self.owner:  # leftovers of an interrupted attempt of this job (never COMPLETE)
            for d in (tmp, final):
                # Hosts sharing one directory (NFS) each have an owner: both may clear it.
                shutil.rmtree(d, ignore_errors=True)
        dist.barrier(group=self.group)
        state, _ = self._state()
        runtime = self.trainer.runtime
        state = keep_written(
            state,
            lambda layers: runtime.topology.writes_layout(runtime.info.rank, layers),
            self.trainer.parts.tied,
            shared=self.rank == 0,  # entries of no layer: rank 0's file alone
        )
        dcp_save(
            state, storage_writer=FileSystemWriter(tmp, overwrite=True), process_group=self.group
        )
        mine = sorted(p.name for p in tmp.glob(f"__{self.rank}_*.distcp"))
        if self.rank == 0:
            mine.append(METADATA)
        entries = [
            {
                "path": name,
                "sha256": sha256_file(tmp / name),
                "bytes": (tmp / name).stat().st_size,
                "host": self.host,
                "rank": self.rank,
            }
            for name in mine
        ]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, entries, group=self.group)
        manifest = None
        if self.rank == 0:
            manifest = Manifest(
                step=step,
                plan=self.plan_ref,
                plan_sha256=self.plan_sha256,
                world_size=self.world_size,
                files=manifest_files(
                    [e for rank_entries in gathered for e in rank_entries],
                    # Where entries went, from the .metadata rank 0 (the coordinator) wrote:
                    # the Metadata save() returns lacks storage_data under torch 2.11.
                    stored_layers(FileSystemReader(tmp).read_metadata()),
                ),
                tied_layers=tied_layer_groups(self.trainer.parts.tied),
            )
            write_atomic(tmp / MANIFEST, signed_manifest_text(manifest, self.key).encode())
            write_atomic(tmp / COMPLETE, b"")
        dist.barrier(group=self.group)
        if self.owner:
            try:
                tmp.rename(final)
            except OSError:
                if not (self.shared_dir and final.is_dir()):
                    raise  # not another owner's rename of a shared directory: a real failure
        dist.barrier(group=self.group)
        if self.owner:
            self._record_save_s(time.monotonic() - started)
        if self.uploader is not None:
            self.uploader.start(
                UploadJob(step=step, local_dir=final, names=tuple(mine), manifest=manifest)
            )
        # Only now, with this step whole on every host: older ones may go.
        reading = self.uploader.reading() if self.uploader is not None else set()
        self.retention.after_save(step, reading=reading)
        return final

    def _record_save_s(self, seconds: float) -> None:
        """This host's save time, for the next launch's spot-notice check (best effort:
        a full disk here must not fail a save that succeeded)."""
        try:
            write_atomic(self.plan_dir / LAST_SAVE_FILE, f"{seconds:.3f}\n".encode())
        except OSError:
            pass

    def _prune_remote(self, step: int) -> None:
        self.retention.prune_remote(step)

    def agree_max(self, values: Sequence[float]) -> list[float]:
        """The element-wise maximum of ``values`` over all ranks (for the save schedule)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [float(x) for x in t.tolist()]

    def close(self) -> None:
        """Wait for this rank's upload."""
        if self.uploader is not None:
            self.uploader.join()

    # ----------------------------------------------------------------- load

    def resume(self, step: int | None = None) -> int | None:
        """Load ``step`` (None: the newest complete one); returns the step loaded, or None.

        With ``step`` None and no complete checkpoint, training starts afresh.
        """
        listing = list_steps(self.plan_dir, self.key)
        views: list[Any] = [None] * self.world_size
        dist.all_gather_object(views, listing, group=self.group)
        complete = {s for view in views for s, why in view.items() if why is None}
        seen = {s for view in views for s in view}
        here = self.plan_dir

        def why_not(s: int) -> str:
            reasons = {view[s] for view in views if view.get(s)}
            return "; ".join(sorted(reasons)) or f"{COMPLETE} or {MANIFEST} missing on every host"

        if step is None:
            chosen = max(complete, default=None)
            if self.rank == 0:
                for s in sorted(s for s in seen - complete if chosen is None or s > chosen):
                    say(f"note: skipping checkpoint {here / step_dir_name(s)} ({why_not(s)})")
                if chosen is None:
                    say(f"note: no complete checkpoint under {here}: starting at step 0")
            if chosen is None:
                return None
        else:
            chosen = step
            if chosen not in complete:
                d = here / step_dir_name(chosen)
                if chosen not in seen:
                    raise CheckpointError(f"no checkpoint {d} on any host")
                raise CheckpointError(f"checkpoint {d} is not usable ({why_not(chosen)})")
        source = min(r for r, view in enumerate(views) if view.get(chosen, "") is None)
        self._load(chosen, source)
        self.retention.hold(chosen)
        return chosen

    def _read_source(self, step: int) -> SourceData | str:
        d = self.plan_dir / step_dir_name(step)
        try:
            text = (d / MANIFEST).read_text(encoding="utf-8")
            manifest = verified_manifest(text, self.key, str(d / MANIFEST))
        except (OSError, ConfigError) as exc:
            return f"cannot use {d / MANIFEST}: {exc}"
        if manifest.step != step:
            return f"{d / MANIFEST} says step {manifest.step}, but its directory is step {step}"
        if manifest.plan_name != self.trainer.plan.name:
            return f"{d / MANIFEST} was written by plan {manifest.plan}, not by this plan's lineage"
        meta = d / METADATA
        if not meta.is_file():
            return f"{meta} is missing (DCP's metadata, written on rank 0's host)"
        data = meta.read_bytes()
        digest, want = hashlib.sha256(data).hexdigest(), manifest.file(METADATA).sha256
        if digest != want:
            return f"{meta} is corrupt: its sha256 is {digest}, but {MANIFEST} says {want}"
        return SourceData(manifest_text=text, metadata=data)

    def _load(self, step: int, source: int) -> None:
        payload: list[Any] = [self._read_source(step) if self.rank == source else None]
        dist.broadcast_object_list(payload, src=source, group=self.group)
        got = payload[0]
        if isinstance(got, str):
            raise CheckpointError(got)
        assert isinstance(got, SourceData)
        # Verified again here: every rank trusts only what its own key authenticates.
        manifest = verified_manifest(got.manifest_text, self.key, MANIFEST)
        if hashlib.sha256(got.metadata).hexdigest() != manifest.file(METADATA).sha256:
            raise CheckpointError(f"{METADATA} of step {step} does not match its manifest")
        metadata = pickle.loads(got.metadata)  # authenticated above: the job wrote it
        local = self.plan_dir / step_dir_name(step)
        remote = self.remote

        def fetch(name: str, dest: Path) -> bool:
            return remote is not None and remote.fetch(manifest.step, name, dest)

        reader = VerifyingReader(
            local, metadata=metadata, manifest=manifest, rank=self.rank, fetch=fetch
        )
        state, aliases = self._state()
        if "run" not in getattr(metadata, "state_dict_metadata", {"run": None}):
            state.pop("run")  # written before checkpoints held the schedule and data
        try:
            dcp_load(state, storage_reader=reader, process_group=self.group)
        except CheckpointException as exc:
            raise checkpoint_failure(exc) from None
        for name in reader.fetched:
            assert self.remote is not None
            say(f"note: fetched {name} from {self.remote.url} into {local}")
        state["optimizer"] = rename_optimizer(
            state["optimizer"], {new: old for old, new in aliases.items()}
        )
        self.trainer.load_state_dict(state)
        if self.trainer.step != manifest.step:
            raise CheckpointError(
                f"{local}: the state says step {self.trainer.step}, {MANIFEST} says {manifest.step}"
            )
        if self.rank == 0:
            say(
                f"resumed from {local} at step {step} (saved by plan {manifest.plan}, "
                f"{manifest.world_size} ranks)"
            )
