"""Pick a runner for a host, and run one function per host in parallel."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from autohet_cli.cluster import Host
from autohet_cli.transport.base import Runner
from autohet_cli.transport.local import LocalRunner
from autohet_cli.transport.ssh import SshRunner
from autohet_cli.transport.target import SshOptions

T = TypeVar("T")


def runner_for(
    host: Host,
    *,
    known_hosts: Path | None = None,
    accept_new_host_keys: bool = False,
    connect_timeout_s: float = 10.0,
    ssh_config: Path | None = None,
    keepalive_s: float = 15.0,
) -> Runner:
    """LocalRunner for address ``localhost``/``local`` (no SSH), else an SshRunner.

    The SSH connection opens on first use; connection errors surface from there.
    """
    if host.is_local:
        return LocalRunner(host.name)
    options = SshOptions(
        known_hosts=known_hosts,
        accept_new_host_keys=accept_new_host_keys,
        connect_timeout_s=connect_timeout_s,
        ssh_config=ssh_config,
        keepalive_s=keepalive_s,
    )
    return SshRunner(host, options)


def fan_out(
    hosts: Iterable[Host], fn: Callable[[Host], T], max_workers: int = 8
) -> dict[str, T | Exception]:
    """``fn(host)`` for every host in a bounded thread pool; results keyed by host name.

    A host whose ``fn`` raised gets the exception as its value; the others go on.
    Order follows ``hosts``. KeyboardInterrupt and other non-Exceptions propagate.
    """
    todo = list(hosts)
    names = [h.name for h in todo]
    if len(set(names)) != len(names):
        raise ValueError(f"fan_out: duplicate host names in {names}")
    if not todo:
        return {}
    if max_workers < 1:
        raise ValueError(f"fan_out: max_workers must be >= 1, got {max_workers}")
    with ThreadPoolExecutor(
        max_workers=min(max_workers, len(todo)), thread_name_prefix="autohet-fan-out"
    ) as pool:
        futures = {h.name: pool.submit(fn, h) for h in todo}
    out: dict[str, T | Exception] = {}
    for name, future in futures.items():
        exc = future.exception()
        if exc is None:
            out[name] = future.result()
        elif isinstance(exc, Exception):
            out[name] = exc
        else:
            raise exc
    return out
