"""Direct peer copies: authenticated streams between two hosts (recovery.direct over
peer.stream), with the controller's relay as the fallback.

The hosts here are local runners under the hosts' names with loopback addresses
(a host that is this machine itself goes over SFTP, which is direct already)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autohet_cli.cluster import Cluster, Host
from autohet_cli.errors import AutohetError
from autohet_cli.peer import stream
from autohet_cli.recovery import copies
from autohet_cli.recovery.direct import Fetch, Servers, fetch_all
from autohet_cli.recovery.transfer import Source, TransferItem, TransferPlan
from autohet_cli.transport.local import LocalRunner
from autohet_cli.transport.pool import ConnectOptions, HostPool
from tests.planting import cpu_host


def host(name: str, address: str = "127.0.0.1", ckpt: str = "~/ck") -> Host:
    return cpu_host(name, address, checkpoint_dir=ckpt)


A, B = host("a"), host("b")


def _key(path: Path, data: bytes = b"k" * 32) -> str:
    path.write_bytes(data)
    path.chmod(0o600)
    return str(path)


def _source(tmp: Path, size: int = 3 << 20) -> tuple[Path, bytes]:
    src = tmp / "a" / "__0_0.distcp"
    src.parent.mkdir(exist_ok=True)
    blob = os.urandom(size)
    src.write_bytes(blob)
    return src, blob


def _fetch(src: Path, blob: bytes, dest: Path) -> Fetch:
    return Fetch(
        path=str(src),
        dest=str(dest),
        num_bytes=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        source="a",
    )


def test_files_arrive_intact_and_atomically_to_a_peer_holding_the_key(tmp_path: Path) -> None:
    src, blob = _source(tmp_path)
    dest = tmp_path / "b" / "step" / "__0_0.distcp"
    key = _key(tmp_path / "key")
    said: list[str] = []
    servers = Servers(said.append)
    with LocalRunner("a") as ra, LocalRunner("b") as rb:
        try:
            servers.start(ra, A, [str(src)], key)
            [got] = fetch_all(rb, B, [_fetch(src, blob, dest)], servers, key)
        finally:
            servers.close()
    assert got.ok and got.seconds > 0
    assert dest.read_bytes() == blob
    assert not list(dest.parent.glob("*.autohet-part"))


def test_a_peer_without_the_key_gets_nothing(tmp_path: Path) -> None:
    src, blob = _source(tmp_path)
    dest = tmp_path / "b" / "x"
    said: list[str] = []
    servers = Servers(said.append)
    with LocalRunner("a") as ra, LocalRunner("b") as rb:
        try:
            servers.start(ra, A, [str(src)], _key(tmp_path / "k1"))
            [got] = fetch_all(
                rb, B, [_fetch(src, blob, dest)], servers, _key(tmp_path / "k2", b"x" * 32)
            )
            time.sleep(0.2)  # the server's REFUSED line
        finally:
            servers.close()
    assert not got.ok and "job key differs" in got.why
    assert not dest.exists()
    assert any("could not prove the job key" in s for s in said)


def _serve_script(src: Path, key: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", copies_source(), "serve", "127.0.0.1", key, "30", str(src)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("PORT "), line + (proc.stderr.read() if proc.stderr else "")
    return proc, int(line.split()[1])


def copies_source() -> str:
    import inspect

    return inspect.getsource(stream)


def test_a_thief_that_connects_first_is_refused_and_the_real_peer_still_gets_the_file(
    tmp_path: Path,
) -> None:
    """Issue 11, item 2: whoever connected first used to get the shard."""
    src, blob = _source(tmp_path)
    key = _key(tmp_path / "key")
    server, port = _serve_script(src, key)
    try:
        with pytest.raises(stream.PeerError, match="job key differs"):
            stream.get_file(
                "127.0.0.1", port, b"z" * 32, str(src), str(tmp_path / "t"), len(blob), "0" * 64
            )
        assert not (tmp_path / "t").exists()
        dest = tmp_path / "peer"
        stream.get_file(
            "127.0.0.1",
            port,
            b"k" * 32,
            str(src),
            str(dest),
            len(blob),
            hashlib.sha256(blob).hexdigest(),
        )
        assert dest.read_bytes() == blob
        server.terminate()
        out, _ = server.communicate(timeout=30)
        assert "REFUSED 127.0.0.1" in out
    finally:
        server.kill()


def test_a_peer_that_stops_reading_is_cut_off_in_seconds(tmp_path: Path) -> None:
    """Issue 11, item 2: a peer that connected and never read stalled a copy for 120 s."""
    src, _ = _source(tmp_path, size=96 << 20)  # more than the sockets' buffers hold
    ended = threading.Event()
    serve = stream.serve_files({str(src)})

    def handler(conn: socket.socket, header: dict[str, object]) -> None:
        try:
            serve(conn, header)
        finally:
            ended.set()

    server = stream.PeerServer("127.0.0.1", b"k" * 32, handler, io_timeout_s=1.0)
    try:
        started = time.monotonic()
        with stream.open_request(
            "127.0.0.1", server.port, b"k" * 32, {"op": "get", "path": str(src)}
        ):
            assert ended.wait(10)  # never read a byte: the server gave up on us
        assert time.monotonic() - started < 10
    finally:
        server.close()


def _pool(tmp_path: Path, names: str = "ab", *, local: bool = False) -> HostPool:
    cluster = Cluster(
        name="c",
        hosts=tuple(
            host(n, "localhost" if local else f"127.0.0.{i + 2}", str(tmp_path / "ck"))
            for i, n in enumerate(names)
        ),
        inter_node_gbps=10.0,
    )
    pool = HostPool(cluster, ConnectOptions())
    for n in names:  # stand-ins for SSH: local runners under the hosts' names
        pool._runners[n] = LocalRunner(n)
        pool.set_home(n, str(tmp_path))
    return pool


def _item(src: Path, blob: bytes, dest: Path) -> TransferItem:
    return TransferItem(
        file=src.name,
        dest_host="b",
        dest_path=str(dest),
        num_bytes=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        predicted_s=0.0,
        source=Source(kind="peer", host="a", path=str(src), gbps=10.0),
    )


def _tp(item: TransferItem) -> TransferPlan:
    return TransferPlan(
        plan_name="p/j",
        step=2,
        rule="all",
        needs={"b": (item.file,)},
        items=(item,),
        in_place=(),
        finalize_hosts=(),
    )


def test_a_local_source_or_destination_is_left_to_sftp(tmp_path: Path) -> None:
    """Issue 11, item 14: a remote peer told to fetch from 127.0.0.1 reached itself."""
    src, blob = _source(tmp_path)
    item = _item(src, blob, tmp_path / "b" / src.name)
    pool = _pool(tmp_path, local=True)
    try:
        assert not copies._can_stream(item, pool)
    finally:
        pool.close()
    pool = _pool(tmp_path)
    try:
        assert copies._can_stream(item, pool)
    finally:
        pool.close()


def test_a_missing_source_is_named_so_the_caller_can_relay(tmp_path: Path) -> None:
    key = _key(tmp_path / "key")
    servers = Servers(lambda _m: None)
    with LocalRunner("a") as ra:
        try:
            servers.start(ra, A, [str(tmp_path / "nope")], key)
        finally:
            servers.close()
    assert not servers.serves("a", str(tmp_path / "nope")) and "not here" in servers.failed["a"]


def _copy_site(tmp_path: Path) -> tuple[Path, bytes, Path, HostPool]:
    """A shard on host a to copy to host b (its path there), the job's key in both
    hosts' checkpoint dir (one machine), and the pool that reaches them."""
    src, blob = _source(tmp_path)
    job = tmp_path / "ck" / "p" / "j"
    job.mkdir(parents=True, exist_ok=True)
    _key(job / ".autohet-key")
    return src, blob, tmp_path / "b" / src.name, _pool(tmp_path)


def test_the_streams_carry_a_recover_and_their_rate_is_recorded(tmp_path: Path) -> None:
    src, blob, dest, pool = _copy_site(tmp_path)
    said: list[str] = []
    log: list[dict[str, object]] = []
    try:
        assert copies.execute_transfers(_tp(_item(src, blob, dest)), pool, said.append, log) == (
            len(blob),
            0,
        )
    finally:
        pool.close()
    assert dest.read_bytes() == blob
    [rec] = log
    assert rec["path"] == "direct" and rec["bytes"] == len(blob) and rec["source"] == "a"
    assert any("(direct, 3.15 MB in" in s and "/s) ok" in s for s in said), said


def test_failed_direct_copies_are_reported_before_the_relay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 11, item 2: recover used to print only '(relayed) ok'."""

    def refuse(*_a: object, **_k: object) -> None:
        raise AutohetError("connection refused")

    monkeypatch.setattr(copies, "fetch_all", refuse)
    src, blob, dest, pool = _copy_site(tmp_path)
    said: list[str] = []
    try:
        copies.execute_transfers(_tp(_item(src, blob, dest)), pool, said.append)
    finally:
        pool.close()
    first = next(i for i, s in enumerate(said) if "direct copies failed (connection refused)" in s)
    relayed = next(i for i, s in enumerate(said) if "(relayed, " in s and s.endswith(" ok"))
    assert first < relayed
    assert dest.read_bytes() == blob


def test_stream_timeouts_are_seconds_not_minutes() -> None:
    assert stream.IO_TIMEOUT_S <= 15 and stream.HANDSHAKE_S <= 15
