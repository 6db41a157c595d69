"""Checkpoint files on a host's disk: private directories, the job key, listing, verified reads.

Directories are held to ssh's StrictModes rule, because a checkpoint is code as
much as data (DCP unpickles ``.metadata``): the job directory and every directory
above it up to the checkpoint root must belong to this user (or root) and be
writable by nobody else; parents above the root may be writable by others only
with the sticky bit (``/tmp``), which stops others from renaming our entries.
Directories we create are mode 0700, the key 0600.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from autohet_cli.ckpt.format import (
    COMPLETE,
    KEY_FILE,
    MANIFEST,
    Manifest,
    ManifestAuthError,
    check_key,
    parse_step_dir,
    verified_manifest,
)
from autohet_cli.errors import AutohetError, ConfigError

_CHUNK = 1 << 20


class CheckpointError(AutohetError):
    """A checkpoint cannot be saved or loaded; the message names the directory or file."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


# --------------------------------------------------------------------- private directories


def _private_group(gid: int) -> bool:
    """The user's own group (named like the user, nobody else in it): Debian's
    user-private-group scheme, where umask 002 makes directories group-writable
    without giving anyone else access; OpenSSH on Debian accepts it too."""
    import grp
    import pwd

    try:
        user = pwd.getpwuid(os.getuid())
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and not group.gr_mem


def unsafe_reason(path: Path, *, below_root: bool) -> str | None:
    """Why ``path`` may be changed by someone else; None when it is safe."""
    st = path.stat()
    uid = os.getuid()
    if st.st_uid not in (uid, 0):
        return f"{path} belongs to uid {st.st_uid}, not to you (uid {uid})"
    group_ok = st.st_uid == uid and _private_group(st.st_gid)
    writable_by_others = st.st_mode & ((0 if group_ok else stat.S_IWGRP) | stat.S_IWOTH)
    sticky_root = st.st_mode & stat.S_ISVTX and st.st_uid == 0
    if writable_by_others and (below_root or not sticky_root):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def ensure_private_dir(path: Path, root: Path) -> None:
    """Create ``path`` (0700 for what we create) and check it and its parents.

    ``root`` is where checkpoints start (the checkpoint dir); from there down every
    directory must be ours alone, above it the StrictModes rule with the sticky
    exception applies.
    """
    path = Path(os.path.abspath(path))
    root = Path(os.path.abspath(root))
    old_umask = os.umask(0o077)  # parents we create are private too, whatever the umask
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old_umask)
    chain = [path, *path.parents]
    for d in chain:
        below = d == root or root in d.parents
        why = unsafe_reason(d, below_root=below)
        if why is not None:
            raise CheckpointError(
                f"refusing checkpoints in {path}: {why}; someone else could plant a "
                "checkpoint that runs code when loaded. Use a directory only you can write "
                "(the default is ~/autohet/checkpoints)"
            )


# --------------------------------------------------------------------- the job key


def read_key(job_dir: Path) -> bytes | None:
    """The job key if this host has it; refuses one others could read or replace."""
    path = job_dir / KEY_FILE
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise CheckpointError(f"{path} is not a regular file of yours: refusing it")
    if st.st_mode & 0o077:
        raise CheckpointError(
            f"{path} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
            "anyone who reads it can forge checkpoints; chmod 600 it"
        )
    return check_key(path.read_bytes(), str(path))


def write_key(job_dir: Path, key: bytes) -> bytes:
    """Store ``key`` unless the host has one already (ranks of a host race): returns the
    key now on disk. Written whole to a temp file, then linked into place, so no reader
    ever sees a half-written key."""
    path = job_dir / KEY_FILE
    tmp = job_dir / f".{KEY_FILE}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        got = read_key(job_dir)
        assert got is not None
        return got
    finally:
        tmp.unlink(missing_ok=True)
    return key


# --------------------------------------------------------------------- listing


def incomplete_reason(step_dir: Path, key: bytes | None) -> str | None:
    """Why ``step_dir`` is not a complete checkpoint of this job; None when it is."""
    if not step_dir.is_dir():
        return "no such directory"
    if not (step_dir / COMPLETE).is_file():
        return f"no {COMPLETE} marker: its save did not finish"
    if not (step_dir / MANIFEST).is_file():
        return f"no {MANIFEST}"
    if key is None:
        return "no job key on this host to authenticate it"
    try:
        m = verified_manifest((step_dir / MANIFEST).read_text(encoding="utf-8"), key, "")
    except ManifestAuthError:
        return f"{MANIFEST} does not authenticate with this job's key (planted or altered?)"
    except (ConfigError, OSError, ValueError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    if m.step != parse_step_dir(step_dir.name):
        return f"{MANIFEST} says step {m.step}"
    return None


def list_steps(job_dir: Path, key: bytes | None) -> dict[int, str | None]:
    """Step -> None (complete and authentic) or why not, for every ``step-<N>`` dir."""
    if not job_dir.is_dir():
        return {}
    out = {}
    for entry in job_dir.iterdir():
        step = parse_step_dir(entry.name)
        if step is not None and entry.is_dir():
            out[step] = incomplete_reason(entry, key)
    return out


# --------------------------------------------------------------------- verified reads


class VerifyingReader(FileSystemReader):
    """DCP reader on this host's step directory: metadata given, files checked before use.

    ``fetch(name, dest)`` brings a file this host lacks from the remote copy (False
    when the copy lacks it too); whatever arrives is checked like the rest."""

    def __init__(
        self,
        path: Path,
        *,
        metadata: Metadata,
        manifest: Manifest,
        rank: int,
        fetch: Any = None,
    ) -> None:
        super().__init__(path)
        self._metadata, self._manifest, self._rank, self._fetch = metadata, manifest, rank, fetch
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
        if not path.is_file() and self._fetch is not None and self._fetch(name, path):
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
