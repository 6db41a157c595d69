"""Checkpoints: DCP on every host's own disk, a sha256 manifest, COMPLETE last, a remote copy.

The layout and the manifest are docs/checkpoint-format.md (``autohet.checkpoint/v1``);
``autohet_cli.recovery.manifest`` parses what this module writes.

Saving (every rank, collectively)
    Each rank hands ``torch.distributed.checkpoint.save`` a ``FileSystemWriter`` on
    ITS host's step directory ``<checkpoint dir>/<plan name>/step-<N:08d>``. DCP
    never needs the paths to agree: the coordinator names every rank's data file
    (``__<rank>_0.distcp``, the rank's index in the world), each rank writes its
    file under its own path, and only the coordinator (rank 0) writes ``.metadata``,
    under rank 0's path. Ranks on one host share the directory; ranks on another
    host write another. DCP's planner also deduplicates replicated entries (the
    layers every pipeline replica holds, a tied weight held by two stages), keeping
    each in exactly one rank's file, so a loading rank may need a file another host
    wrote (see Loading). Then every rank hashes its own file(s) (rank 0 also
    ``.metadata``), rank 0 gathers the entries, writes ``manifest.json`` atomically
    and ``COMPLETE`` last. The state is ``Trainer.state_dict`` with the optimizer
    flattened to one entry per full parameter name and state key, and a tied
    parameter's optimizer state filed under the first name of its group whatever
    copy a rank holds, so every entry has one name in every plan.

Remote copy
    A background thread per rank uploads that rank's files with fsspec to
    ``<remote>/<plan name>/step-<N:08d>/``; rank 0's thread also uploads
    ``.metadata`` and the manifest, waits until every file of the manifest is there
    at its full size, and uploads ``COMPLETE`` last. Training goes on meanwhile; a
    rank joins its thread before its next upload and at the end of training.

Loading (``--resume [STEP]``)
    Every rank lists its own plan directory; the newest step that some rank sees
    complete (``COMPLETE`` and ``manifest.json``) is chosen (an explicit STEP that
    is not complete is refused, naming the directory). The lowest rank holding it
    complete verifies ``.metadata`` against the manifest and broadcasts both, so
    ``.metadata`` is needed on one host only. DCP then plans which stored chunks
    each rank reads (resharding across TP degrees and stage cuts by full names);
    each rank verifies the sha256 of exactly the files it reads, in its own host's
    step directory, before reading them. A file missing there is fetched from the
    remote copy when that has it (and verified); otherwise the error names the
    file, the directory and the host that wrote it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from autohet_cli.errors import AutohetError, ConfigError
from autohet_cli.recovery.manifest import (
    COMPLETE,
    DEFAULT_REMOTE_ROOT,
    MANIFEST,
    METADATA,
    Manifest,
    ManifestFile,
    manifest_from_json,
    manifest_to_dict,
    parse_step_dir,
    step_dir_name,
)
from autohet_cli.runtime.trainer import Hook, StepResult, Trainer

CHECKPOINT_DIR_ENV = "AUTOHET_CHECKPOINT_DIR"
REMOTE_ENVS = ("AUTOHET_REMOTE_STORAGE", "AUTOHET_REMOTE")  # the first one set wins
NO_REMOTE = ("", "none", "off")
UPLOAD_TIMEOUT_S = 1800.0  # rank 0 waits this long for the other ranks' uploads
COLLECTIVE_TIMEOUT_S = 1800.0  # for the collectives of a save or load
_CHUNK = 1 << 20


class CheckpointError(AutohetError):
    """A checkpoint cannot be saved or loaded; the message names the directory or file."""


def _say(message: str) -> None:
    print(f"autohet runtime: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------- where


def checkpoint_root(explicit: Path | None, run_dir: Path | None) -> Path | None:
    """``--checkpoint-dir``, else ``$AUTOHET_CHECKPOINT_DIR``, else RUN_DIR/../../checkpoints."""
    if explicit is not None:
        return explicit
    if env := os.environ.get(CHECKPOINT_DIR_ENV):
        return Path(env)
    if run_dir is not None:
        return run_dir.parent.parent / "checkpoints"
    return None


def remote_url(explicit: str | None) -> str | None:
    """``--remote-storage``, else the environment, else the local stand-in; None: off."""
    url = explicit
    if url is None:
        url = next((os.environ[e] for e in REMOTE_ENVS if os.environ.get(e)), DEFAULT_REMOTE_ROOT)
    return None if url.strip().lower() in NO_REMOTE else url


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def incomplete_reason(step_dir: Path) -> str | None:
    """Why ``step_dir`` is not a complete checkpoint; None when it is."""
    if not step_dir.is_dir():
        return "no such directory"
    if not (step_dir / COMPLETE).is_file():
        return f"no {COMPLETE} marker: its save did not finish"
    if not (step_dir / MANIFEST).is_file():
        return f"no {MANIFEST}"
    return None


def list_steps(plan_dir: Path) -> dict[int, str | None]:
    """Step -> None (complete) or why not, for every ``step-<N>`` directory of a plan."""
    if not plan_dir.is_dir():
        return {}
    out = {}
    for entry in plan_dir.iterdir():
        step = parse_step_dir(entry.name)
        if step is not None and entry.is_dir():
            out[step] = incomplete_reason(entry)
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def write_manifest(step_dir: Path, manifest: Manifest) -> None:
    """``manifest.json`` (temp + rename), then the ``COMPLETE`` marker."""
    text = json.dumps(manifest_to_dict(manifest), indent=2) + "\n"
    _write_atomic(step_dir / MANIFEST, text.encode())
    _write_atomic(step_dir / COMPLETE, b"")


# --------------------------------------------------------------------- tied names


def tied_aliases(optimizer_keys: Sequence[str], tied: Sequence[Sequence[str]]) -> dict[str, str]:
    """Held name -> first name of its group, for tied parameters filed under another name.

    ``get_state_dict`` files a tied parameter's optimizer state under the first of
    its names the rank holds (a rank holding only the LM head uses the head's name);
    the checkpoint always uses the group's first name.
    """
    aliases = {}
    for group in tied:
        canonical = group[0]
        if any(k.startswith(f"state.{canonical}.") for k in optimizer_keys):
            continue
        for name in group[1:]:
            if any(
                k.startswith((f"state.{name}.", f"param_groups.{name}.")) for k in optimizer_keys
            ):
                aliases[name] = canonical
                break
    return aliases


def rename_optimizer(flat: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """Rename the keys of a flattened optimizer state dict by parameter name."""
    if not aliases:
        return dict(flat)
    out = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        for old, new in aliases.items():
            if rest.startswith(f"{old}."):
                key = f"{kind}.{new}{rest[len(old) :]}"
                break
        out[key] = value
    return out


# --------------------------------------------------------------------- remote copy


class RemoteCopy:
    """The remote copy of a plan's checkpoints through fsspec (any URL fsspec opens)."""

    def __init__(self, url: str, plan_name: str) -> None:
        from fsspec.core import url_to_fs

        self.url = url
        self.fs, root = url_to_fs(url)
        self.root = str(root).rstrip("/")
        self.plan_name = plan_name

    def path(self, step: int, name: str = "") -> str:
        base = f"{self.root}/{self.plan_name}/{step_dir_name(step)}"
        return f"{base}/{name}" if name else base

    def put(self, local: Path, step: int, name: str) -> None:
        self.fs.makedirs(self.path(step), exist_ok=True)
        self.fs.put_file(str(local), self.path(step, name))

    def mark_complete(self, step: int) -> None:
        self.fs.pipe_file(self.path(step, COMPLETE), b"")

    def size(self, step: int, name: str) -> int | None:
        try:
            return int(self.fs.size(self.path(step, name)))
        except (FileNotFoundError, OSError):
            return None

    def invalidate(self, step: int) -> None:
        """Drop ``COMPLETE`` (then the manifest) before the step is written again."""
        for name in (COMPLETE, MANIFEST):
            if self.fs.exists(self.path(step, name)):
                self.fs.rm_file(self.path(step, name))

    def fetch(self, step: int, name: str, dest: Path) -> bool:
        """Download one file into ``dest`` (temp + rename); False if the copy lacks it."""
        if self.size(step, name) is None:
            return False
        tmp = dest.with_name(f".{dest.name}.fetch{os.getpid()}")
        self.fs.get_file(self.path(step, name), str(tmp))
        tmp.replace(dest)
        return True


@dataclass(frozen=True, slots=True, kw_only=True)
class UploadJob:
    step: int
    local_dir: Path
    names: tuple[str, ...]  # this rank's files, uploaded in this order
    manifest: Manifest | None = None  # rank 0: then the manifest, wait for all, COMPLETE


class Uploader:
    """One background upload at a time for this rank; failures warn, never stop training."""

    def __init__(self, remote: RemoteCopy, *, timeout_s: float = UPLOAD_TIMEOUT_S) -> None:
        self.remote, self.timeout_s = remote, timeout_s
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    def start(self, job: UploadJob) -> None:
        self.join()
        self._thread = threading.Thread(
            target=self._run, args=(job,), name=f"autohet-upload-{job.step}", daemon=True
        )
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, job: UploadJob) -> None:
        try:
            for name in job.names:
                self.remote.put(job.local_dir / name, job.step, name)
            if job.manifest is not None:
                self.remote.put(job.local_dir / MANIFEST, job.step, MANIFEST)
                self._wait_for(job.step, job.manifest)
                self.remote.mark_complete(job.step)
        except Exception as exc:  # a remote outage must not stop training
            message = f"upload of {job.local_dir} to {self.remote.path(job.step)} failed: {exc}"
            self.errors.append(message)
            _say(f"warning: {message}")

    def _wait_for(self, step: int, manifest: Manifest) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            missing = [
                f.path for f in manifest.files if self.remote.size(step, f.path) != f.num_bytes
            ]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"{', '.join(missing)} did not reach {self.remote.path(step)} within "
                    f"{self.timeout_s:.0f} s; {COMPLETE} not uploaded"
                )
            time.sleep(0.2)


# --------------------------------------------------------------------- loading


class _VerifyingReader(FileSystemReader):
    """DCP reader on this host's step directory: metadata given, files checked before use."""

    def __init__(
        self,
        path: Path,
        *,
        metadata: Metadata,
        manifest: Manifest,
        rank: int,
        remote: RemoteCopy | None,
    ) -> None:
        super().__init__(path)
        self._metadata, self._manifest, self._rank, self._remote = metadata, manifest, rank, remote
        self._checked: set[str] = set()
        self.fetched: list[str] = []

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        assert self._metadata.storage_meta is not None
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        needed = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        for name in sorted(needed):
            self._check(name)
        return super().read_data(plan, planner)

    def _check(self, name: str) -> None:
        if name in self._checked:
            return
        directory = Path(self.path)
        try:
            entry = self._manifest.file(name)
        except KeyError:
            raise CheckpointError(
                f"{directory}: DCP's metadata names {name}, which {MANIFEST} does not list"
            ) from None
        path = directory / name
        if not path.is_file() and self._remote is not None:
            if self._remote.fetch(self._manifest.step, name, path):
                self.fetched.append(name)
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing: rank {self._rank} reads it, and host {entry.host} wrote it; "
                f"copy it into {directory} first (autohet recover does)"
            )
        digest = sha256_file(path)
        if digest != entry.sha256:
            raise CheckpointError(
                f"{path} is corrupt: its sha256 is {digest}, but {MANIFEST} says {entry.sha256}"
            )
        self._checked.add(name)


def _checkpoint_failure(exc: CheckpointException) -> CheckpointError:
    """DCP's per-rank failures as one message (ours verbatim, others with their type)."""
    parts = []
    seen = set()
    for rank, (error, _trace) in sorted(exc.failures.items()):
        text = str(error) if isinstance(error, AutohetError) else f"{type(error).__name__}: {error}"
        if text not in seen:
            seen.add(text)
            parts.append(text if isinstance(error, AutohetError) else f"rank {rank}: {text}")
    return CheckpointError("; ".join(parts) or "checkpoint load failed")


# --------------------------------------------------------------------- the checkpointer


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceData:
    manifest_text: str
    metadata: bytes


class Checkpointer:
    """Save and load ``trainer``'s state under ``root/<plan name>/`` (collective calls)."""

    def __init__(
        self,
        trainer: Trainer,
        *,
        root: Path,
        plan_ref: str,
        plan_sha256: str,
        remote: RemoteCopy | None = None,
        upload_timeout_s: float = UPLOAD_TIMEOUT_S,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> None:
        self.trainer = trainer
        self.plan_dir = root / trainer.plan.name
        self.plan_ref, self.plan_sha256 = plan_ref, plan_sha256
        self.remote = remote
        self.uploader = Uploader(remote, timeout_s=upload_timeout_s) if remote else None
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # Checkpoint collectives get their own CPU group and timeout: writing a big
        # checkpoint may take longer than the training collectives' timeout allows.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.host = trainer.runtime.info.device.host
        # The lowest rank writing to a directory (one machine, one path) clears it.
        where = (socket.gethostname(), str(self.plan_dir.resolve()))
        places: list[Any] = [None] * self.world_size
        dist.all_gather_object(places, where, group=self.group)
        self.owner = places.index(where) == self.rank

    # ----------------------------------------------------------------- state

    def _aliases(self, optimizer: Mapping[str, Any]) -> dict[str, str]:
        return tied_aliases(list(optimizer), self.trainer.parts.tied)

    def _state(self) -> tuple[dict[str, Any], dict[str, str]]:
        state = self.trainer.state_dict(flat_optimizer=True)
        aliases = self._aliases(state["optimizer"])
        state["optimizer"] = rename_optimizer(state["optimizer"], aliases)
        return state, aliases

    # ----------------------------------------------------------------- save

    def save(self) -> Path:
        """Write step ``trainer.step``; returns this rank's step directory."""
        step = self.trainer.step
        local = self.plan_dir / step_dir_name(step)
        if self.owner and local.exists():  # a stale attempt: drop the marker first
            (local / COMPLETE).unlink(missing_ok=True)
            shutil.rmtree(local)
        if self.rank == 0 and self.remote is not None:
            self.remote.invalidate(step)
        dist.barrier(group=self.group)
        state, _ = self._state()
        dcp_save(
            state,
            storage_writer=FileSystemWriter(local, overwrite=True),
            process_group=self.group,
        )
        mine = sorted(p.name for p in local.glob(f"__{self.rank}_*.distcp"))
        if self.rank == 0:
            mine.append(METADATA)
        entries = [
            {
                "path": name,
                "sha256": sha256_file(local / name),
                "bytes": (local / name).stat().st_size,
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
                files=tuple(
                    ManifestFile(
                        path=e["path"],
                        sha256=e["sha256"],
                        num_bytes=e["bytes"],
                        host=e["host"],
                        rank=e["rank"],
                    )
                    for rank_entries in gathered
                    for e in rank_entries
                ),
            )
            write_manifest(local, manifest)
        if self.uploader is not None:
            self.uploader.start(
                UploadJob(step=step, local_dir=local, names=tuple(mine), manifest=manifest)
            )
        return local

    def close(self) -> None:
        """Wait for this rank's upload."""
        if self.uploader is not None:
            self.uploader.join()

    # ----------------------------------------------------------------- load

    def resume(self, step: int | None = None) -> int | None:
        """Load ``step`` (None: the newest complete one); returns the step loaded, or None.

        With ``step`` None and no complete checkpoint, training starts afresh.
        """
        listing = list_steps(self.plan_dir)
        views: list[Any] = [None] * self.world_size
        dist.all_gather_object(views, listing, group=self.group)
        complete = {s for view in views for s, why in view.items() if why is None}
        seen = {s for view in views for s in view}
        here = self.plan_dir
        if step is None:
            chosen = max(complete, default=None)
            if self.rank == 0:
                for s in sorted(s for s in seen - complete if chosen is None or s > chosen):
                    why = listing.get(s) or f"{COMPLETE} or {MANIFEST} missing on every host"
                    _say(f"note: skipping incomplete checkpoint {here / step_dir_name(s)} ({why})")
                if chosen is None:
                    _say(f"note: no complete checkpoint under {here}: starting at step 0")
            if chosen is None:
                return None
        else:
            chosen = step
            if chosen not in complete:
                d = here / step_dir_name(chosen)
                if chosen not in seen:
                    raise CheckpointError(f"no checkpoint {d} on any host")
                why = listing.get(chosen) or f"{COMPLETE} or {MANIFEST} missing on every host"
                raise CheckpointError(f"checkpoint {d} is incomplete ({why}): refusing to load it")
        source = min(r for r, view in enumerate(views) if view.get(chosen, "") is None)
        self._load(chosen, source)
        return chosen

    def _read_source(self, step: int) -> SourceData | str:
        d = self.plan_dir / step_dir_name(step)
        try:
            text = (d / MANIFEST).read_text(encoding="utf-8")
            manifest = manifest_from_json(text, str(d / MANIFEST))
        except (OSError, ConfigError) as exc:
            return f"cannot read {d / MANIFEST}: {exc}"
        if manifest.step != step:
            return f"{d / MANIFEST} says step {manifest.step}, but its directory is step {step}"
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
        manifest = manifest_from_json(got.manifest_text, MANIFEST)
        metadata = pickle.loads(got.metadata)
        local = self.plan_dir / step_dir_name(step)
        reader = _VerifyingReader(
            local, metadata=metadata, manifest=manifest, rank=self.rank, remote=self.remote
        )
        state, aliases = self._state()
        try:
            dcp_load(state, storage_reader=reader, process_group=self.group)
        except CheckpointException as exc:
            raise _checkpoint_failure(exc) from None
        for name in reader.fetched:
            assert self.remote is not None
            _say(f"note: fetched {name} from {self.remote.url} into {local}")
        state["optimizer"] = rename_optimizer(
            state["optimizer"], {new: old for old, new in aliases.items()}
        )
        self.trainer.load_state_dict(state)
        if self.trainer.step != manifest.step:
            raise CheckpointError(
                f"{local}: the state says step {self.trainer.step}, {MANIFEST} says {manifest.step}"
            )
        if self.rank == 0:
            _say(
                f"resumed from {local} at step {step} (saved by plan {manifest.plan}, "
                f"{manifest.world_size} ranks)"
            )


class CheckpointHook(Hook):
    """Save every ``every`` steps (after steps every-1, 2*every-1, ...); join uploads at the end."""

    def __init__(self, checkpointer: Checkpointer, every: int) -> None:
        if every < 1:
            raise ValueError(f"--checkpoint-every must be >= 1, got {every}")
        self.checkpointer, self.every = checkpointer, every

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if trainer.step % self.every == 0:
            self.checkpointer.save()

    def on_train_end(self, trainer: Trainer) -> None:
        self.checkpointer.close()
