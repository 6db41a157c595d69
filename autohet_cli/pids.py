"""Whether a process on this machine has ended (pure but for one system call).

Run records (``runfiles``) and checkpoint pins (``ckpt.prune``) both name the
process that wrote them and the machine it ran on, so that a dead writer's claim
lapses. One answer for both; standard library only, since the run listing must not
import torch through ``ckpt``.
"""

from __future__ import annotations

import os
import socket


def process_gone(pid: int | None, machine: str | None, *, here: str | None = None) -> bool:
    """True only when ``machine`` is this one (``here``, default the host name), ``pid``
    is a real process id and no such process exists. A process of another user
    counts as alive; on another machine nothing can be known: not gone."""
    if not pid or pid <= 0 or machine != (here or socket.gethostname()):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False
