"""Direct peer copies: an authenticated one-shot TCP stream between two hosts.

The hosts here are two local runners with a loopback address (not ``localhost``,
which the copy refuses: the controller's own files go over SFTP)."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autohet_cli.cluster import Host
from autohet_cli.errors import AutohetError
from autohet_cli.recovery import direct
from autohet_cli.recovery.direct import SERVE, direct_copy
from autohet_cli.transport.local import LocalRunner


def host(name: str, address: str = "127.0.0.1") -> Host:
    return Host(
        name=name,
        address=address,
        gpu_type="cpu",
        num_gpus=1,
        gpu_mem_bytes=1 << 30,
        intra_node_gbps=80.0,
    )


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


def test_file_arrives_intact_and_atomically_to_a_peer_holding_the_key(tmp_path: Path) -> None:
    src, blob = _source(tmp_path)
    dest = tmp_path / "b" / "step" / "__0_0.distcp"
    key = _key(tmp_path / "key")
    with LocalRunner("a") as ra, LocalRunner("b") as rb:
        direct_copy(ra, A, str(src), rb, B, str(dest), src_key=key, dest_key=key)
    assert dest.read_bytes() == blob
    assert not list(dest.parent.glob("*.autohet-part"))


def test_a_peer_without_the_key_gets_nothing_and_the_copy_fails(tmp_path: Path) -> None:
    src, _ = _source(tmp_path)
    dest = tmp_path / "b" / "x"
    with (
        LocalRunner("a") as ra,
        LocalRunner("b") as rb,
        pytest.raises(AutohetError, match="refused us: this host's job key differs"),
    ):
        direct_copy(
            ra,
            A,
            str(src),
            rb,
            B,
            str(dest),
            src_key=_key(tmp_path / "k1"),
            dest_key=_key(tmp_path / "k2", b"x" * 32),
        )
    assert not dest.exists()


def _serve(src: Path, key: str, io_timeout: float) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(src), "127.0.0.1", "30", str(io_timeout), key],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("PORT "), line + (proc.stderr.read() if proc.stderr else "")
    return proc, int(line.split()[1])


def _handshake(s: socket.socket, key: bytes, path: str) -> None:
    nonce = b""
    while len(nonce) < 32:
        nonce += s.recv(32 - len(nonce))
    s.sendall(hmac.new(key, b"autohet-direct\0" + nonce + path.encode(), hashlib.sha256).digest())


def test_a_thief_that_connects_first_is_refused_and_the_real_peer_still_gets_the_file(
    tmp_path: Path,
) -> None:
    """Issue 11, item 2: whoever connected first used to get the shard."""
    src, blob = _source(tmp_path)
    key = _key(tmp_path / "key")
    server, port = _serve(src, key, io_timeout=10)
    try:
        thief = socket.create_connection(("127.0.0.1", port), timeout=5)
        thief.recv(32)  # the nonce
        thief.sendall(b"\0" * 32)  # a guess
        assert thief.recv(1 << 20) == b""  # closed on us: not one byte of the file
        thief.close()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as peer:
            _handshake(peer, b"k" * 32, str(src))
            assert peer.recv(1) == b"\x01"
            got = bytearray()
            while chunk := peer.recv(1 << 20):
                got += chunk
        assert bytes(got) == blob
        out, _ = server.communicate(timeout=30)
        assert server.returncode == 0 and "REFUSED 127.0.0.1" in out
    finally:
        server.kill()


def test_a_peer_that_stops_reading_fails_the_copy_in_seconds(tmp_path: Path) -> None:
    """Issue 11, item 2: a peer that connected and never read stalled a copy for 120 s."""
    src, _ = _source(tmp_path, size=64 << 20)
    key = _key(tmp_path / "key")
    server, port = _serve(src, key, io_timeout=1)
    try:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as lazy:
            lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            _handshake(lazy, b"k" * 32, str(src))
            server.wait(timeout=20)  # never reads a byte
        assert server.returncode != 0
        assert time.monotonic() - started < 10
    finally:
        server.kill()


def test_a_local_source_or_destination_is_left_to_sftp(tmp_path: Path) -> None:
    """Issue 11, item 14: a remote peer told to fetch from 127.0.0.1 reached itself."""
    src, _ = _source(tmp_path)
    key = _key(tmp_path / "key")
    local = host("localhost", "localhost")
    with LocalRunner("a") as ra, LocalRunner("b") as rb:
        for s, d in ((local, B), (A, local)):
            with pytest.raises(AutohetError, match="SFTP is direct"):
                direct_copy(ra, s, str(src), rb, d, str(tmp_path / "y"), src_key=key, dest_key=key)


def test_a_missing_source_fails_so_the_caller_can_relay(tmp_path: Path) -> None:
    key = _key(tmp_path / "key")
    with LocalRunner("a") as ra, LocalRunner("b") as rb, pytest.raises(AutohetError):
        direct_copy(
            ra, A, str(tmp_path / "nope"), rb, B, str(tmp_path / "x"), src_key=key, dest_key=key
        )
    assert not (tmp_path / "x").exists()


def test_failed_direct_copies_are_reported_before_the_relay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 11, item 2: recover used to print only '(relayed) ok'."""
    from autohet_cli.cluster import Cluster
    from autohet_cli.recovery import copies as rx
    from autohet_cli.recovery.transfer import Source, TransferItem
    from autohet_cli.transport.pool import ConnectOptions, HostPool

    def refuse(*_a: object, **_k: object) -> None:
        raise AutohetError("connection refused")

    monkeypatch.setattr(rx, "direct_copy", refuse)
    src, blob = _source(tmp_path)
    ckpt = tmp_path / "ck"
    cluster = Cluster(
        name="c",
        hosts=tuple(
            Host(
                name=n,
                address=f"127.0.0.{i + 2}",
                gpu_type="cpu",
                num_gpus=1,
                gpu_mem_bytes=1 << 30,
                intra_node_gbps=80.0,
                checkpoint_dir=str(ckpt),
            )
            for i, n in enumerate("ab")
        ),
        inter_node_gbps=10.0,
    )
    pool = HostPool(cluster, ConnectOptions())
    for n in "ab":  # stand-ins for SSH: local runners under the hosts' names
        pool._runners[n] = LocalRunner(n)
        pool.set_home(n, str(tmp_path))
    item = TransferItem(
        file=src.name,
        dest_host="b",
        dest_path=str(tmp_path / "b" / src.name),
        num_bytes=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        predicted_s=0.0,
        source=Source(kind="peer", host="a", path=str(src), gbps=10.0),
    )
    said: list[str] = []
    try:
        assert rx._copy_one(item, pool, said.append, "p/j") == "peer"
    finally:
        pool.close()
    assert any("direct copy of __0_0.distcp from a failed (connection refused)" in s for s in said)
    assert any("(relayed) ok" in s for s in said)
    assert (tmp_path / "b" / src.name).read_bytes() == blob


def test_direct_module_timeouts_are_seconds_not_minutes() -> None:
    assert direct.IO_TIMEOUT_S <= 15
