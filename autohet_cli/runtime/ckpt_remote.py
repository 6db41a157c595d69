"""The remote copy of a job's checkpoints, through fsspec, uploaded in the background.

Each rank uploads its own files of a step to ``<remote>/<plan>/<job>/step-<N>/``;
rank 0 then uploads ``.metadata`` and the manifest, waits until every file the
manifest lists is there at its full size, and uploads ``COMPLETE`` last. Training
goes on meanwhile; a failed upload warns and never stops training. A ``COMPLETE``
step in the remote copy is never overwritten. Where the remote copy is a local
path (a shared mount, or the stand-in on a single machine), its root is held to
the same rule as checkpoint directories (ours alone, mode 0700).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from autohet_cli.ckpt.format import (
    COMPLETE,
    MANIFEST,
    REMOTE_ENV,
    Manifest,
    namespace,
    remote_storage,
    step_dir_name,
)
from autohet_cli.runtime.ckpt_files import CheckpointError, ensure_private_dir
from autohet_cli.runtime.records import say

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

    def __init__(self, remote: RemoteCopy, *, timeout_s: float = UPLOAD_TIMEOUT_S) -> None:
        self.remote, self.timeout_s = remote, timeout_s
        self._cond = threading.Condition()
        self._pending: UploadJob | None = None
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
                job, self._pending = self._pending, None
            self._run(job)

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
