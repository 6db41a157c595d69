"""How to connect (``ConnectOptions``) and one runner per host, opened lazily (``HostPool``).

Launch, recover and their helpers all reach hosts the same way: the same
known_hosts policy and connect timeout, one connection per host reused by every
command, each host's home directory looked up once (``~`` in a cluster file means
the home on *that* host, never the controller's), and every connection closed
together at the end.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from autohet_cli.cluster import Cluster, Host
from autohet_cli.errors import AutohetError
from autohet_cli.paths import expand_home
from autohet_cli.transport.base import Runner
from autohet_cli.transport.fanout import runner_for


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectOptions:
    known_hosts: Path | None = None
    accept_new_host_keys: bool = False
    connect_timeout_s: float = 10.0

    def argv(self) -> list[str]:
        """The same options as CLI arguments (for a command we start, e.g. recover)."""
        out = ["--known-hosts", str(self.known_hosts)] if self.known_hosts else []
        return out + (["--accept-new-host-keys"] if self.accept_new_host_keys else [])


def with_cluster_known_hosts(connect: ConnectOptions, cluster: Cluster) -> ConnectOptions:
    """``--known-hosts`` if given, else the cluster file's ``known_hosts:``: a team's
    cluster file names its known_hosts once instead of every command repeating it."""
    if connect.known_hosts is not None or cluster.known_hosts is None:
        return connect
    return dataclasses.replace(connect, known_hosts=Path(cluster.known_hosts).expanduser())


def remote_home(runner: Runner) -> str:
    """The home directory of the user on the runner's host, as that host sees it."""
    return runner.run(["sh", "-c", 'printf %s "$HOME"'], timeout_s=30).check().stdout.strip()


class HostPool:
    """One runner per host of ``cluster``, opened on first use and closed together."""

    def __init__(self, cluster: Cluster, connect: ConnectOptions) -> None:
        self.cluster = cluster
        self.connect = with_cluster_known_hosts(connect, cluster)
        self._runners: dict[str, Runner] = {}
        self._homes: dict[str, str] = {}

    def runner(self, name: str) -> Runner:
        if name not in self._runners:
            self._runners[name] = runner_for(
                self.cluster.host(name),
                known_hosts=self.connect.known_hosts,
                accept_new_host_keys=self.connect.accept_new_host_keys,
                connect_timeout_s=self.connect.connect_timeout_s,
            )
        return self._runners[name]

    def host(self, name: str) -> Host:
        return self.cluster.host(name)

    def home(self, name: str) -> str:
        """The home directory on ``name`` (looked up there once)."""
        if name not in self._homes:
            self._homes[name] = remote_home(self.runner(name))
        return self._homes[name]

    def set_home(self, name: str, home: str) -> None:
        self._homes[name] = home

    def expand(self, name: str, path: str) -> str:
        """``path`` as it is on host ``name`` (``~`` expanded there)."""
        return expand_home(path, self.home(name)) if path.startswith("~") else path

    def checkpoint_dir(self, name: str) -> str:
        return self.expand(name, self.host(name).checkpoint_dir)

    def workdir(self, name: str) -> str:
        return self.expand(name, self.host(name).workdir)

    def close(self) -> None:
        for r in self._runners.values():
            try:
                r.close()
            except AutohetError:
                pass
        self._runners.clear()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
