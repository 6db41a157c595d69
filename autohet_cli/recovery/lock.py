"""One `autohet recover` per plan lineage at a time (effects: a lock file on the controller).

Two recoveries of the same job would both write plan versions and relaunch on the
same devices, one deleting what the other copies. An exclusive ``flock`` on
``<plans dir>/.<plan name>.recover.lock`` makes the second one stop at once with
the first one's pid; the kernel drops the lock when its holder exits, however it
exits, so a crashed recover never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from autohet_cli.recovery.errors import RecoveryError


@contextmanager
def recover_lock(plans_dir: Path, plan_name: str) -> Iterator[None]:
    path = plans_dir / f".{plan_name}.recover.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise RecoveryError(f"cannot create the lock {path}: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise RecoveryError(
                f"another autohet recover of {plan_name} is running (pid {holder}, lock "
                f"{path}); wait for it to finish, or stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
