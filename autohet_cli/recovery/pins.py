"""`autohet recover` pins the step it copies (effects), so no prune removes it meanwhile.

Workers prune a job to its newest ``--keep-checkpoints`` complete steps after
each save (``ckpt.prune``). Recover refuses to start while workers of
the plan run on a survivor, but one it cannot see (a host cut off from this
machine and not from its disks, a launch started meanwhile) could still save and
prune. So the chosen step is pinned from the moment it is chosen until every
copy is finalized: a pin file ``<job dir>/.pin-step-<N:08d>-<token>.json``
(``ckpt.retention``) on every survivor holding files of it, and in the remote
copy when that holds it. Then the pins go: the relaunched run keeps its source
step itself until it has saved K newer ones. A recover that is killed leaves its
pins behind; they lapse after ``PIN_TTL_S``, or at once where a pruner on this
machine sees this process gone, so they never block pruning for ever.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from secrets import token_hex
from typing import Any

from autohet_cli.ckpt.retention import Pin, pin_name, pin_to_text
from autohet_cli.cluster import Host
from autohet_cli.transport.fanout import fan_out
from autohet_cli.transport.pool import HostPool

Say = Callable[[str], None]

# Longer than any copy of one checkpoint between hosts takes; a dead recover's pins
# keep at most one step this much longer than --keep-checkpoints says.
PIN_TTL_S = 12 * 3600.0


def recover_pin(step: int, *, now_unix: float | None = None) -> Pin:
    machine = socket.gethostname()
    return Pin(
        step=step,
        holder=f"autohet recover (pid {os.getpid()} on {machine})",
        machine=machine,
        pid=os.getpid(),
        expires_unix=(time.time() if now_unix is None else now_unix) + PIN_TTL_S,
    )


@contextmanager
def pinned_step(
    pool: HostPool,
    hosts: Sequence[str],
    ns: str,
    step: int,
    remote_root: str | None,
    say: Say,
) -> Iterator[None]:
    """Pin ``step`` of job ``ns`` on ``hosts`` and (``remote_root``) in the remote copy
    while the block runs. A pin that cannot be written warns: it guards against a
    worker recover could not see, and recover itself needs nothing from it."""
    name = pin_name(step, token_hex(6))
    text = pin_to_text(recover_pin(step))

    def path_on(host: Host) -> str:
        return f"{pool.checkpoint_dir(host.name).rstrip('/')}/{ns}/{name}"

    with tempfile.TemporaryDirectory(prefix="autohet-pin-") as tmp:
        local = Path(tmp) / name
        local.write_text(text, encoding="utf-8")
        placed = fan_out(
            [pool.host(h) for h in hosts], lambda h: pool.runner(h.name).put(local, path_on(h))
        )
    for host, result in placed.items():
        if isinstance(result, Exception):
            say(f"warning: could not pin step {step} on {host} ({result}); copying it anyway")
    remote = _pin_remote(remote_root, ns, name, text) if remote_root else None
    if remote_root and remote is None:
        say(f"warning: could not pin step {step} in {remote_root}; copying it anyway")
    try:
        yield
    finally:
        pinned = [pool.host(h) for h, r in placed.items() if not isinstance(r, Exception)]
        fan_out(pinned, lambda h: _unpin(pool, h.name, path_on(h)))
        if remote is not None:
            fs, path = remote
            try:
                fs.rm_file(path)
            except OSError:
                pass  # it lapses on its own


def _unpin(pool: HostPool, host: str, path: str) -> None:
    pool.runner(host).run(["rm", "-f", "--", path], timeout_s=30)


def _pin_remote(root: str, ns: str, name: str, text: str) -> tuple[Any, str] | None:
    """Write the pin into the remote copy: its file system and path, or None."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(f"{root.rstrip('/')}/{ns}/{name}")
        fs.pipe_file(path, text.encode())
    except (OSError, ValueError):
        return None
    return fs, str(path)
