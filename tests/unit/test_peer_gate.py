"""Issue 45, item 6: the peer protocol is bounded before it is authenticated.

Handshakes run in the gate, outside the stream pool, with a short deadline and
limits per source address; the servers listen on the cluster address only. Loopback
addresses only: 127.0.0.x stand in for other hosts (Linux answers all of 127/8), and
a bind refused on purpose stands in for an address of no interface (a NAT'd one)."""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from autohet_cli.peer import gate, stream
from autohet_cli.peer.replicate import Replicator
from tests.peering import KEY, receiver

IDLE = 200
NAT_ADDR = "127.0.0.9"  # plays an address of no interface here


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _idle(port: int, n: int, sources: tuple[str, ...] = ("127.0.0.1",)) -> list[socket.socket]:
    """``n`` keyless clients that connect and say nothing, spread over ``sources``."""
    out = []
    for i in range(n):
        s = socket.socket()
        s.bind((sources[i % len(sources)], 0))
        s.connect(("127.0.0.1", port))
        out.append(s)
    return out


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[stream.PeerServer, Path, bytes]]:
    src = tmp_path / "shard"
    data = os.urandom(4 << 20)
    src.write_bytes(data)
    server = stream.PeerServer("127.0.0.1", KEY, stream.serve_files({str(src)}))
    yield server, src, data
    server.close()


@pytest.fixture(autouse=True)
def _impatient(monkeypatch: pytest.MonkeyPatch) -> None:
    # A request stalled behind strangers fails in seconds here, not after 15 minutes.
    monkeypatch.setattr(stream, "QUEUE_WAIT_S", 5.0)


def _get(server: stream.PeerServer, src: Path, data: bytes, dest: Path) -> float:
    t0 = time.monotonic()
    stream.get_file("127.0.0.1", server.port, KEY, str(src), str(dest), len(data), _sha(data))
    return time.monotonic() - t0


def test_idle_keyless_sockets_do_not_stall_an_authenticated_get(
    served: tuple[stream.PeerServer, Path, bytes], tmp_path: Path
) -> None:
    """40 silent sockets made a get take 10 s, 200 took 58 s: each held a stream
    thread for 5 s before proving anything. The flood here shares the get's source."""
    server, src, data = served
    idle = _idle(server.port, IDLE)
    try:
        time.sleep(0.2)  # sit there, silent
        took = _get(server, src, data, tmp_path / "out")
        assert took < 3.0, f"{took:.2f} s"
        assert (tmp_path / "out").read_bytes() == data
        assert server.gate.held() <= gate.PER_SOURCE  # the rest closed at once
    finally:
        for s in idle:
            s.close()


def test_idle_sockets_from_many_sources_fill_neither_the_gate_nor_the_pool(
    served: tuple[stream.PeerServer, Path, bytes], tmp_path: Path
) -> None:
    server, src, data = served
    sources = tuple(f"127.0.0.{i}" for i in range(2, 8))  # 6 x 50: past UNPROVEN
    idle = _idle(server.port, 300, sources)
    try:
        took = _get(server, src, data, tmp_path / "out")
        assert took < 3.0, f"{took:.2f} s"
        assert server.gate.held() <= gate.UNPROVEN
    finally:
        for s in idle:
            s.close()


def test_idle_keyless_sockets_do_not_stall_a_replica_push(tmp_path: Path) -> None:
    job = tmp_path / "b" / "plan" / "default"
    (job / "step-00000002").mkdir(parents=True)
    r = receiver(job)
    assert r.server is not None
    src = tmp_path / "__0_0.distcp"
    data = os.urandom(1 << 20)
    src.write_bytes(data)
    header = {"op": "push", "step": 2, "name": src.name, "bytes": len(data), "sha256": _sha(data)}
    idle = _idle(r.server.port, IDLE)
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        assert stream.push_file("127.0.0.1", r.server.port, KEY, str(src), header)
        assert time.monotonic() - t0 < 3.0
        assert (job / "step-00000002" / src.name).read_bytes() == data
    finally:
        for s in idle:
            s.close()
        r.close()


def test_a_silent_client_is_cut_off_within_the_handshake_deadline(
    served: tuple[stream.PeerServer, Path, bytes],
) -> None:
    server, _src, _data = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        t0 = time.monotonic()
        assert len(s.recv(32)) == 32  # the nonce comes at once
        try:
            assert s.recv(1) == b""
        except OSError:
            pass  # cut: reset
        assert time.monotonic() - t0 < gate.HANDSHAKE_S + 1.0


def test_a_wrong_key_is_refused_by_the_gate_and_reported(tmp_path: Path) -> None:
    src = tmp_path / "shard"
    src.write_bytes(b"x" * 10)
    refused: list[str] = []
    server = stream.PeerServer(
        "127.0.0.1", KEY, stream.serve_files({str(src)}), on_refused=refused.append
    )
    try:
        with pytest.raises(stream.PeerError, match="job key differs"):
            stream.get_file(
                "127.0.0.1", server.port, b"z" * 32, str(src), str(tmp_path / "o"), 10, "0" * 64
            )
    finally:
        server.close()
    assert refused and refused[0].startswith("127.0.0.1:")


# ----------------------------------------------------------------- where it listens


def _no_such_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    """``NAT_ADDR`` behaves as an address of no interface here: bind refuses it."""
    real = socket.socket.bind

    def bind(self: socket.socket, address: object) -> None:
        if isinstance(address, tuple) and address[0] == NAT_ADDR:
            raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))
        real(self, address)  # type: ignore[arg-type]

    monkeypatch.setattr(socket.socket, "bind", bind)


def _replicator(tmp_path: Path, env: dict[str, str]) -> Replicator:
    """Host b's replicator of a fresh job, one replica, as the job's owner, in ``env``."""
    job = tmp_path / "plan" / "default"
    job.mkdir(parents=True)
    return Replicator(
        host="b", plan_dir=job, key=KEY, replicas=1, budget_bytes=None, owner=True, env=env
    )


def test_the_server_listens_on_the_address_it_is_given() -> None:
    server = stream.PeerServer("127.0.0.2", KEY, stream.serve_files(set()))
    try:
        assert server.sock.getsockname()[0] == "127.0.0.2"
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), 2):
            pass  # not on 127.0.0.1: nothing listens there
    finally:
        server.close()


def test_an_address_on_no_interface_listens_where_the_peers_are_routed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """It used to listen on 0.0.0.0: every network the host is on."""
    _no_such_interface(monkeypatch)
    r = _replicator(tmp_path, {"AUTOHET_HOST_ADDR": NAT_ADDR, "MASTER_ADDR": "127.0.0.3"})
    try:
        assert r.server is not None and r.problem is None
        # the kernel's source address on the way to 127.0.0.3, not 0.0.0.0
        assert r.server.sock.getsockname()[0] == "127.0.0.1"
        assert r.info() is not None and r.info()["addr"] == NAT_ADDR  # still advertised
    finally:
        r.close()
    with gate.listen_on(NAT_ADDR, ["127.0.0.3"]) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"


def test_an_address_on_no_interface_and_no_route_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_such_interface(monkeypatch)
    r = _replicator(tmp_path, {"AUTOHET_HOST_ADDR": NAT_ADDR})
    assert r.server is None
    assert r.problem is not None and f"cannot listen on {NAT_ADDR}" in r.problem
    assert "0.0.0.0" in r.problem and "cluster file" in r.problem


def test_recovers_server_script_never_listens_on_all_addresses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_such_interface(monkeypatch)
    key, src = tmp_path / "key", tmp_path / "shard"
    key.write_bytes(KEY)
    src.write_bytes(b"x")
    with pytest.raises(SystemExit, match=f"cannot listen on {NAT_ADDR}"):
        stream._serve_main(NAT_ADDR, str(key), "0.1", str(src))
    assert "PORT" not in capsys.readouterr().out
    stream._serve_main(f"{NAT_ADDR},127.0.0.3", str(key), "0.1", str(src))  # routed: serves
    assert "PORT " in capsys.readouterr().out


def test_a_connection_proven_while_the_server_closes_is_closed_not_a_traceback() -> None:
    """Issue 46: 'RuntimeError: cannot schedule new futures after shutdown' from the
    accept thread during a clean preemption: a stream that arrives as the pool shuts
    down is closed (its client falls back), not raised in the gate's thread."""
    import socket as socket_mod

    from autohet_cli.peer.stream import PeerServer

    server = PeerServer("127.0.0.1", b"k" * 32, lambda _c, _h: None)
    try:
        server._pool.shutdown(wait=False)
        a, b = socket_mod.socketpair()
        server._admit(a, "127.0.0.1", {"op": "get"})  # no RuntimeError
        assert a.fileno() == -1 and server._waiting == 0
        b.close()
    finally:
        server.close()
