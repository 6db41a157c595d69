"""Pick a runner for a host, and run one function per host in parallel: ``fan_out``
waits for every host; ``fan_out_background`` lets the caller stop waiting for some
(a host that stopped answering would only make it wait for a timeout)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
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


def raise_first(results: Mapping[str, object]) -> None:
    """The first host's error (in the results' order), if any host failed."""
    for value in results.values():
        if isinstance(value, Exception):
            raise value


class Gathered:
    """Results that threads deliver by host name, and a wait for some of them."""

    def __init__(self) -> None:
        self._values: dict[str, object] = {}
        self._new = threading.Condition()

    def run(self, name: str, fn: Callable[[str], object]) -> None:
        try:
            value: object = fn(name)
        except Exception as exc:  # the host's result, as in fan_out
            value = exc
        with self._new:
            self._values[name] = value
            self._new.notify_all()

    def wait(self, names: Sequence[str], timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for all of ``names``; True while some are missing."""
        with self._new:
            self._new.wait_for(lambda: all(n in self._values for n in names), timeout_s)
            return not all(n in self._values for n in names)

    def items(self) -> list[tuple[str, object]]:
        with self._new:
            return list(self._values.items())


def fan_out_background(names: Sequence[str], fn: Callable[[str], object], *, what: str) -> Gathered:
    """``fn(name)`` for every name, each in a daemon thread of its own (one that never
    returns holds up nobody, not even the interpreter's exit); results in ``Gathered``."""
    gathered = Gathered()
    for name in names:
        threading.Thread(
            target=gathered.run, args=(name, fn), name=f"{name}-{what}", daemon=True
        ).start()
    return gathered
