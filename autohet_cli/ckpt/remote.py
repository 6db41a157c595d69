"""The remote copy of a job's checkpoints, through fsspec, uploaded in the background.

Each rank uploads its own files of a step to ``<remote>/<plan>/<job>/step-<N>/``;
rank 0 then uploads ``.metadata`` and the manifest, waits until every file the
manifest lists is there at its full size, and uploads ``COMPLETE`` last. Training
goes on meanwhile; a failed upload warns and never stops training. A ``COMPLETE``
step in the remote copy is never overwritten; once rank 0 has marked one, its
uploader prunes the copy to ``--keep-checkpoints`` (``ckpt.prune``).
Where the remote copy is a local
path (a shared mount, or the stand-in on a single machine), its root is held to
the same rule as checkpoint directories (ours alone, mode 0700).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from autohet_cli.ckpt.files import CheckpointError, ensure_private_dir
from autohet_cli.ckpt.format import (
    COMPLETE,
    MANIFEST,
    REMOTE_ENV,
    Manifest,
    namespace,
    parse_step_dir,
    remote_storage,
    step_dir_name,
    verified_manifest,
)
from autohet_cli.errors import ConfigError
from autohet_cli.workerbase.records import say

UPLOAD_TIMEOUT_S = 600.0  # rank 0 waits this long for the other ranks' uploads
CLOSE_WAIT_S = 300.0  # at the end of training, how long to wait for a running upload


def remote_url(explicit: str | None) -> str | None:
    """``--remote-storage``, else ``$AUTOHET_REMOTE_STORAGE``; None (or 'none'): no copy."""
    url = remote_storage(explicit if explicit is not None else os.environ.get(REMOTE_ENV))
    return os.path.expanduser(url) if url is not None and url.startswith("~") else url


class RemoteCopy:
    """One job's remote copy (any URL fsspec opens)."""

    def __init__(self, url: str, plan_name: str, job: str) -> None:
        from fsspec.core import url_to_fs
        from fsspec.implementations.local import LocalFileSystem

        self.url = url
        self.fs, root = url_to_fs(url)
        self.root = str(root).rstrip("/")
        self.ns = namespace(plan_name, job)
        if isinstance(self.fs, LocalFileSystem):
            ensure_private_dir(Path(self.root) / self.ns, Path(self.root))

    def path(self, step: int, name: str = "") -> str:
        base = f"{self.root}/{self.ns}/{step_dir_name(step)}"
        return f"{base}/{name}" if name else base

    def put(self, local: Path, step: int, name: str) -> None:
        self.fs.makedirs(self.path(step), exist_ok=True)
        self.fs.put_file(str(local), self.path(step, name))

    def mark_complete(self, step: int) -> None:
        self.fs.pipe_file(self.path(step, COMPLETE), b"")

    def unmark_complete(self, step: int) -> None:
        """Take ``COMPLETE`` away (a step of an abandoned run): no reader takes it, and
        an upload of the same step number may write it again."""
        self.fs.rm_file(self.path(step, COMPLETE))

    def is_complete(self, step: int) -> bool:
        try:
            return bool(self.fs.exists(self.path(step, COMPLETE)))
        except OSError:
            return False

    def size(self, step: int, name: str) -> int | None:
        try:
            return int(self.fs.size(self.path(step, name)))
        except (FileNotFoundError, OSError):
            return None

    def fetch(self, step: int, name: str, dest: Path) -> bool:
        """Download one file into ``dest`` (temp + rename); False if the copy lacks it."""
        if self.size(step, name) is None:
            return False
        tmp = dest.with_name(f".{dest.name}.fetch{os.getpid()}")
        self.fs.get_file(self.path(step, name), str(tmp))
        tmp.replace(dest)
        return True

    # ------------------------------------------------------------- retention

    def entries(self) -> list[str]:
        """The names in the job's remote directory ([] before its first upload)."""
        try:
            listed = self.fs.ls(f"{self.root}/{self.ns}", detail=False)
        except FileNotFoundError:
            return []
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed]

    def read_entry(self, name: str) -> str:
        return bytes(self.fs.cat_file(f"{self.root}/{self.ns}/{name}")).decode("utf-8")

    def remove_entry(self, name: str) -> None:
        self.fs.rm_file(f"{self.root}/{self.ns}/{name}")

    def complete_steps(self, key: bytes, names: Iterable[str]) -> set[int]:
        """The steps among ``names`` marked ``COMPLETE`` whose manifest authenticates
        with the job key: a step planted in the remote copy neither counts towards
        ``--keep-checkpoints`` nor is removed."""
        out = set()
        for step in (parse_step_dir(n) for n in names):
            if step is None or not self.is_complete(step):
                continue
            where = self.path(step, MANIFEST)
            try:
                text = bytes(self.fs.cat_file(where)).decode("utf-8")
                if verified_manifest(text, key, where).step == step:
                    out.add(step)
            except (OSError, UnicodeDecodeError, ConfigError):
                continue
        return out

    def remove_step(self, step: int) -> None:
        """``COMPLETE`` first: a removal cut short leaves an incomplete step, which no
        reader takes for a checkpoint."""
        self.fs.rm_file(self.path(step, COMPLETE))
        self.fs.rm(self.path(step), recursive=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class UploadJob:
    step: int
    local_dir: Path
    names: tuple[str, ...]  # this rank's files, uploaded in this order
    manifest: Manifest | None = None  # rank 0: then the manifest, wait for all, COMPLETE


class _Superseded(Exception):
    pass


class Uploader:
    """This rank's uploads, in one background thread; failures warn, never stop training.

    At most one step waits: a newer save replaces a step that has not started
    uploading, and ends rank 0's wait for the other ranks' files of the step it is
    on (that step then stays without ``COMPLETE`` in the remote copy, which readers
    treat as incomplete). So a slow or failing remote never makes training wait, and
    the remote copy catches up with the newest step as soon as it can.
    """

    def __init__(
        self,
        remote: RemoteCopy,
        *,
        timeout_s: float = UPLOAD_TIMEOUT_S,
        on_complete: Callable[[int], None] | None = None,
    ) -> None:
        self.remote, self.timeout_s = remote, timeout_s
        self.on_complete = on_complete  # after COMPLETE is uploaded (rank 0): the prune
        self._cond = threading.Condition()
        self._pending: UploadJob | None = None
        self._current: UploadJob | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    def start(self, job: UploadJob) -> None:
        with self._cond:
            if self._pending is not None:
                self._warn(
                    f"step {self._pending.step} is not copied to {self.remote.url}: "
                    f"superseded by {job.step}"
                )
            self._pending = job
            self._closed = False
            self._cond.notify_all()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="autohet-upload", daemon=True
                )
                self._thread.start()

    def reading(self) -> set[int]:
        """The steps whose local files this uploader is reading or will read."""
        with self._cond:
            return {j.step for j in (self._current, self._pending) if j is not None}

    def join(self, timeout_s: float | None = CLOSE_WAIT_S) -> None:
        """Finish what is queued, waiting at most ``timeout_s`` (the end of training)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                say(
                    f"warning: an upload to {self.remote.url} did not finish within "
                    f"{timeout_s:.0f} s; the local checkpoints are complete"
                )
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                job = self._current = self._pending
                self._pending = None
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._current = None

    def _warn(self, message: str) -> None:
        self.errors.append(message)
        say(f"warning: {message}")

    def _run(self, job: UploadJob) -> None:
        try:
            if self.remote.is_complete(job.step):
                return  # never overwrite a complete step (an earlier attempt of this job)
            for name in job.names:
                self.remote.put(job.local_dir / name, job.step, name)
            if job.manifest is not None:
                self.remote.put(job.local_dir / MANIFEST, job.step, MANIFEST)
                self._wait_for(job.step, job.manifest)
                self.remote.mark_complete(job.step)
        except _Superseded as exc:
            self._warn(
                f"step {job.step} is not marked {COMPLETE} in {self.remote.url}: "
                f"superseded by {exc}"
            )
        except Exception as exc:  # a remote outage must not stop training
            self._warn(f"upload of {job.local_dir} to {self.remote.path(job.step)} failed: {exc}")
        else:
            if job.manifest is not None and self.on_complete is not None:
                try:
                    self.on_complete(job.step)
                except Exception as exc:  # neither may a failed removal
                    self._warn(f"pruning the remote copy {self.remote.url} failed: {exc}")

    def _wait_for(self, step: int, manifest: Manifest) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            missing = [
                f.path for f in manifest.files if self.remote.size(step, f.path) != f.num_bytes
            ]
            if not missing:
                return
            with self._cond:
                newer = self._pending
            if newer is not None:
                raise _Superseded(newer.step)
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"{', '.join(missing)} did not reach {self.remote.path(step)} within "
                    f"{self.timeout_s:.0f} s; {COMPLETE} not uploaded"
                )
            time.sleep(0.2)
