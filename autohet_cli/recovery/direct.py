"""Peer → peer copies that do not pass through the controller, at line rate.

Each source host runs one server (``peer.stream``'s ``serve``: the files it was
asked for, to holders of the job key only) and each destination host one fetcher
(``fetch``), which copies all its files from every source, several streams at a
time, hashing each as it lands and renaming it into place only when its sha256 is
the authenticated manifest's. The module's own source is what runs there
(``python -c``), so the hosts need nothing but a Python 3.

Why not SSH: paramiko moves ~30 MB/s through its cipher, and relaying through the
controller sends every byte twice; these streams move what the NIC moves. The
relay through the controller (SFTP) stays the fallback for a pair that cannot
reach each other, and a file whose bytes fail their hash falls back to its next
source.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from autohet_cli.cluster import Host, python_for
from autohet_cli.errors import AutohetError
from autohet_cli.peer import stream
from autohet_cli.transport.base import ProcessHandle, Runner

SERVE_S = 3600  # a server offers its files this long at most (the copy stops it)
STREAMS = 4  # files in flight per destination
BATCH = 64  # files per fetcher command (Linux caps one argument at 128 KiB)
SERVE_PATHS = 256  # files per server command, likewise
_SOURCE = stream.script_source()


@dataclass(frozen=True, slots=True, kw_only=True)
class Fetch:
    """One file for a destination's fetcher: from ``path`` on a served host."""

    path: str
    dest: str
    num_bytes: int
    sha256: str
    source: str  # host name of the server


@dataclass(frozen=True, slots=True, kw_only=True)
class Fetched:
    ok: bool
    seconds: float
    why: str = ""  # when not ok; "sha256" for bytes that fail their hash
    got: str = ""  # the sha256 the bytes had, on a mismatch


class Servers:
    """One server per source host, each offering exactly the files asked of it."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self.warn = warn
        self.where: dict[tuple[str, str], tuple[str, int]] = {}  # (host, path) -> addr, port
        self.failed: dict[str, str] = {}
        self._handles: list[ProcessHandle] = []

    def start(
        self,
        runner: Runner,
        host: Host,
        paths: Sequence[str],
        key_file: str,
        route_to: Sequence[str] = (),
    ) -> None:
        """Servers on ``host`` for ``paths``: one per SERVE_PATHS of them (one command
        line stays far below Linux's 128 KiB for a single argument). ``route_to``: the
        addresses of the hosts that will fetch; a server listens on ``host``'s address
        only, or where that is on no interface there (NAT), on the local address that
        routes to them; never on all."""
        for i in range(0, len(paths), SERVE_PATHS):
            chunk = paths[i : i + SERVE_PATHS]
            port = self._start_one(runner, host, chunk, key_file, route_to)
            if port is None:
                return
            for path in chunk:
                self.where[(host.name, path)] = (host.address, port)

    def serves(self, host: str, path: str) -> bool:
        return (host, path) in self.where

    def _start_one(
        self, runner: Runner, host: Host, paths: Sequence[str], key_file: str, route: Sequence[str]
    ) -> int | None:
        port: list[int] = []

        def on_line(_stream: str, line: str) -> None:
            if line.startswith("PORT "):
                port.append(int(line.split()[1]))
            elif line.startswith("REFUSED "):
                self.warn(
                    f"warning: {host.name} refused a connection from {line.split()[1]} that "
                    "could not prove the job key"
                )

        addr = ",".join([host.address, *route])  # the script's "ADDR[,PEER...]"
        argv = [python_for(host), "-c", _SOURCE, "serve", addr, key_file, str(SERVE_S)]
        handle = runner.start([*argv, *paths], on_line=on_line)
        self._handles.append(handle)
        deadline = time.monotonic() + 20
        while not port and handle.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if port:
            return port[0]
        tail = (handle.stderr.strip().splitlines() or ["no port offered"])[-1]
        self.failed[host.name] = tail
        return None

    def close(self) -> None:
        for handle in self._handles:
            if handle.poll() is None:
                handle.kill(1.0)


def fetch_all(
    runner: Runner,
    host: Host,
    items: Sequence[Fetch],
    servers: Servers,
    key_file: str,
    *,
    streams: int = STREAMS,
) -> list[Fetched]:
    """Run ``host``'s fetcher for ``items`` (their sources served by ``servers``);
    one verdict per item, in order. Raises AutohetError when the fetcher itself
    could not run (the caller falls back for every item)."""
    out: list[Fetched] = []
    for i in range(0, len(items), BATCH):  # one command line stays far below 128 KiB
        out += _fetch_batch(runner, host, items[i : i + BATCH], servers, key_file, streams)
    return out


def _fetch_batch(
    runner: Runner,
    host: Host,
    items: Sequence[Fetch],
    servers: Servers,
    key_file: str,
    streams: int,
) -> list[Fetched]:
    spec = [
        {
            "addr": servers.where[(it.source, it.path)][0],
            "port": servers.where[(it.source, it.path)][1],
            "path": it.path,
            "dest": it.dest,
            "bytes": it.num_bytes,
            "sha256": it.sha256,
        }
        for it in items
    ]
    argv = [python_for(host), "-c", _SOURCE, "fetch", key_file, str(streams), json.dumps(spec)]
    res = runner.run(argv, timeout_s=None)  # the sockets' inactivity timeout ends a stall
    verdicts: dict[int, Fetched] = {}
    for line in res.stdout.splitlines():
        try:
            got: Mapping[str, object] = json.loads(line)
            i = int(str(got["i"]))
        except (ValueError, KeyError, TypeError):
            continue
        verdicts[i] = Fetched(
            ok=bool(got.get("ok")),
            seconds=float(str(got.get("s", 0.0))),
            why=str(got.get("why", "")),
            got=str(got.get("got", "")),
        )
    if res.exit_code != 0 and not verdicts:
        tail = (res.stderr.strip().splitlines() or [f"exit code {res.exit_code}"])[-1]
        raise AutohetError(f"{host.name}: the fetcher failed: {tail}")
    return [
        verdicts.get(i, Fetched(ok=False, seconds=0.0, why="no verdict")) for i in range(len(items))
    ]
