"""Directories only this user may change (pure, standard library, no torch).

Checkpoints (``ckpt.files.ensure_private_dir``) and the parsed-YAML cache
(``yamlcache``) hold what is later unpickled or unmarshalled, so someone else able to
write there could plant code or data: both refuse a directory another user could
change, by the rule OpenSSH's StrictModes applies, with Debian's user-private groups.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


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
    return unsafe_stat_reason(path, path.stat(), below_root=below_root)


def unsafe_stat_reason(path: Path, st: os.stat_result, *, below_root: bool) -> str | None:
    """``unsafe_reason`` of a ``stat`` already made (an open file's ``fstat``)."""
    uid = os.getuid()
    if st.st_uid not in (uid, 0):
        return f"{path} belongs to uid {st.st_uid}, not to you (uid {uid})"
    group_ok = st.st_uid == uid and _private_group(st.st_gid)
    writable_by_others = st.st_mode & ((0 if group_ok else stat.S_IWGRP) | stat.S_IWOTH)
    sticky_root = st.st_mode & stat.S_ISVTX and st.st_uid == 0
    if writable_by_others and (below_root or not sticky_root):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def make_private_dir(path: Path, root: Path) -> str | None:
    """Create ``path`` (0700 for what is created, parents too, whatever the umask) and
    check it and its parents: from ``root`` down every directory must be this user's
    alone; above it the StrictModes rule with the sticky-root exception applies (/tmp).
    Returns why it is unsafe, or None; raises OSError when it cannot be created."""
    path = Path(os.path.abspath(path))
    root = Path(os.path.abspath(root))
    old_umask = os.umask(0o077)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    finally:
        os.umask(old_umask)
    for d in [path, *path.parents]:
        why = unsafe_reason(d, below_root=d == root or root in d.parents)
        if why is not None:
            return why
    return None
