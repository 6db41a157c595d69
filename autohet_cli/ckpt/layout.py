"""Where a job's checkpoints live: its directories and their names, the job name, the
key file, the remote copy's root (pure).

Part of the checkpoint format (``ckpt.format``, which re-exports these names; the names
inside a step directory are ``workerbase.stepfiles``'). Split from it so the manifest's
schema and its authentication read on their own; and the worker's defaults for where
checkpoints go (``CHECKPOINT_DIR_ENV``, ``DEFAULT_JOB``) are here, without torch, for
the worker's flags (``runtime.train_args``) and the checkpointer alike.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping

from autohet_cli.errors import ConfigError
from autohet_cli.workerbase.stepfiles import step_dir_name

CHECKPOINT_DIR_ENV = "AUTOHET_CHECKPOINT_DIR"
DEFAULT_JOB = "default"
KEY_FILE = ".autohet-key"
REMOTE_ENV = "AUTOHET_REMOTE_STORAGE"  # the remote copy, when no cluster file or flag names one
KEY_BYTES = 32
ABANDONED_PREFIX = ".abandoned-"  # steps of a run a resume went back from (jobdir)
TMP_PREFIX = ".tmp-"  # a step being written: ``.tmp-step-<N:08d>``

_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


# --------------------------------------------------------------------- paths


def local_step_dir(checkpoint_dir: str, plan_name: str, step: int) -> str:
    """``<host.checkpoint_dir>/<plan name>/step-<N:08d>`` (POSIX, on the host)."""
    return f"{checkpoint_dir.rstrip('/') or '/'}/{plan_name}/{step_dir_name(step)}"


def remote_step_dir(root: str, plan_name: str, step: int) -> str:
    return f"{root.rstrip('/')}/{plan_name}/{step_dir_name(step)}"


def local_job_dir(checkpoint_dir: str, plan_name: str, job: str) -> str:
    """``<host.checkpoint_dir>/<plan name>/<job>`` (POSIX, on the host)."""
    return f"{checkpoint_dir.rstrip('/') or '/'}/{namespace(plan_name, job)}"


def namespace(plan_name: str, job: str) -> str:
    """The path of a job's checkpoints below a checkpoint or remote root."""
    check_job(job)
    return f"{plan_name}/{job}"


def check_job(job: str) -> str:
    if not _JOB.match(job) or ".." in job:
        raise ConfigError(
            f"job {job!r}: use letters, digits, '.', '_' and '-' (no '/', no '..'), "
            "starting with a letter or digit"
        )
    return job


# --------------------------------------------------------------------- the remote copy


def remote_storage(url: str | None) -> str | None:
    """A remote copy's URL, or None for no remote copy (unset, '', 'none' or 'off')."""
    if url is None or url.strip().lower() in ("", "none", "off"):
        return None
    return url


def remote_root(cluster_remote: str | None, env: Mapping[str, str]) -> str | None:
    """Where the remote copy lives: the cluster's ``remote_storage``, else
    ``$AUTOHET_REMOTE_STORAGE``; None: no remote copy (a shard whose every host
    copy is lost cannot be recovered, which launch says)."""
    return remote_storage(cluster_remote or env.get(REMOTE_ENV))


# --------------------------------------------------------------------- the job key


def new_key() -> bytes:
    """A fresh job key (``secrets``: the OS's cryptographic randomness)."""
    return secrets.token_bytes(KEY_BYTES)


def check_key(data: bytes, where: str) -> bytes:
    if len(data) != KEY_BYTES:
        raise ConfigError(f"{where}: a job key is {KEY_BYTES} bytes, this file has {len(data)}")
    return data
