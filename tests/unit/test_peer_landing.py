"""Issue 30: how a peer stream's bytes land (``peer.landing.receive_into``).

On Linux the bytes move socket -> pipe -> file with ``splice`` and are hashed from
the page cache; elsewhere through buffers. Both ways must land exactly the bytes
sent, verified, and leave nothing under the name (nor a temporary file) when the
stream is cut, stalls, fails its hash or meets a full disk."""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from autohet_cli.peer import landing, stream

pytestmark = pytest.mark.skipif(not hasattr(socket, "socketpair"), reason="no socketpair")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.fixture(params=["spliced", "buffered"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Which way lands the bytes; yields a list counting the splice calls made."""
    calls = [0]
    if request.param == "buffered":
        monkeypatch.setattr(landing, "_splice", None)
    else:
        real = landing._splice
        if real is None:
            pytest.skip("no os.splice here (not Linux, or Python < 3.10)")

        def counted(*a: Any, **kw: Any) -> int:
            calls[0] += 1
            return int(real(*a, **kw))

        monkeypatch.setattr(landing, "_splice", counted)
    yield calls


def _send(data: bytes, *, close: bool = True, hold_s: float = 0.0) -> tuple[socket.socket, Any]:
    """A socket pair whose far end sends ``data`` from a thread, then holds the
    connection open ``hold_s`` and closes it (if ``close``)."""
    a, b = socket.socketpair()

    def run() -> None:
        try:
            a.sendall(data)
            time.sleep(hold_s)
        except OSError:
            pass
        finally:
            if close:
                a.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    b.settimeout(5.0)
    return b, (a, t)


def test_every_byte_lands_verified(way: list[int], tmp_path: Path) -> None:
    data = os.urandom(3 * landing.PIPE_BYTES + 4321)  # several pipe loads, a ragged end
    sock, (_a, t) = _send(data)
    dest = tmp_path / "d" / "__0_0.distcp"
    with sock:
        stream.receive_into(sock, str(dest), len(data), _sha(data))
    t.join()
    assert dest.read_bytes() == data
    assert _leftovers(dest.parent) == ["__0_0.distcp"]
    assert (way[0] > 0) == (landing._splice is not None)  # the way asked for is the way taken


def test_an_empty_file_lands(way: list[int], tmp_path: Path) -> None:
    sock, (_a, t) = _send(b"")
    with sock:
        stream.receive_into(sock, str(tmp_path / "COMPLETE"), 0, _sha(b""))
    assert (tmp_path / "COMPLETE").read_bytes() == b""


def test_a_stream_cut_short_leaves_nothing(way: list[int], tmp_path: Path) -> None:
    data = os.urandom(2 * landing.PIPE_BYTES)
    sock, _ = _send(data[: len(data) // 2])
    with sock, pytest.raises(stream.PeerError, match="bytes short"):
        stream.receive_into(sock, str(tmp_path / "f"), len(data), _sha(data))
    assert _leftovers(tmp_path) == []


def test_a_stalled_peer_fails_within_the_io_timeout(way: list[int], tmp_path: Path) -> None:
    data = os.urandom(1 << 20)
    sock, _ = _send(data[:1000], hold_s=5.0)
    sock.settimeout(0.5)
    t0 = time.monotonic()
    with sock, pytest.raises((stream.PeerError, OSError)):
        stream.receive_into(sock, str(tmp_path / "f"), len(data), _sha(data))
    assert time.monotonic() - t0 < 3.0
    assert _leftovers(tmp_path) == []


def test_bytes_that_fail_their_hash_are_removed(way: list[int], tmp_path: Path) -> None:
    data = os.urandom(landing.PIPE_BYTES + 7)
    sock, _ = _send(data)
    with sock, pytest.raises(stream.HashMismatch) as got:
        stream.receive_into(sock, str(tmp_path / "f"), len(data), _sha(b"other"))
    assert got.value.got == _sha(data)  # the report names the hash the bytes had
    assert _leftovers(tmp_path) == []


def _splice_failing_into_files(err: int) -> Callable[..., int]:
    real = os.splice

    def fake(src: int, dst: int, count: int, **kw: Any) -> int:
        if "offset_dst" in kw:  # pipe -> file
            raise OSError(err, os.strerror(err))
        return int(real(src, dst, count, **kw))

    return fake


@pytest.mark.skipif(not hasattr(os, "splice"), reason="no os.splice here")
def test_a_file_system_without_splice_gets_the_bytes_written(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(landing, "_splice", _splice_failing_into_files(errno.EINVAL))
    data = os.urandom(2 * landing.PIPE_BYTES + 99)
    sock, (_a, t) = _send(data)
    with sock:
        stream.receive_into(sock, str(tmp_path / "f"), len(data), _sha(data))
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.skipif(not hasattr(os, "splice"), reason="no os.splice here")
def test_a_full_disk_fails_the_copy_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(landing, "_splice", _splice_failing_into_files(errno.ENOSPC))
    data = os.urandom(landing.PIPE_BYTES)
    sock, _ = _send(data, hold_s=1.0)
    with sock, pytest.raises(OSError) as got:
        stream.receive_into(sock, str(tmp_path / "f"), len(data), _sha(data))
    assert got.value.errno == errno.ENOSPC
    assert _leftovers(tmp_path) == []


def test_the_script_recover_runs_on_hosts_needs_no_autohet(tmp_path: Path) -> None:
    """``stream.script_source()`` (landing's source, then stream's) serves and fetches
    under a bare interpreter (-I -S: no site-packages, so no autohet), as on a host."""
    import json
    import subprocess
    import sys

    source = stream.script_source()
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    shard = tmp_path / "a" / "__0_0.distcp"
    shard.parent.mkdir()
    data = os.urandom(2 * landing.PIPE_BYTES + 5)
    shard.write_bytes(data)
    bare = [sys.executable, "-I", "-S", "-c", source]
    server = subprocess.Popen(
        [*bare, "serve", "127.0.0.1", str(key), "60", str(shard)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith("PORT "), line
        dest = tmp_path / "b" / "__0_0.distcp"
        spec = [{"addr": "127.0.0.1", "port": int(line.split()[1]), "path": str(shard),
                 "dest": str(dest), "bytes": len(data), "sha256": _sha(data)}]  # fmt: skip
        out = subprocess.run(
            [*bare, "fetch", str(key), "2", json.dumps(spec)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.splitlines()[-1])["ok"] is True
        assert dest.read_bytes() == data
    finally:
        server.kill()
        server.wait()


def test_the_peer_link_benchmark_measures_a_verified_copy(tmp_path: Path) -> None:
    from benchmarks import peer_link

    link = peer_link.measure(tmp_path, 3 << 20, 2)
    assert len(link.copy_s) == len(link.write_s) == 2
    assert link.copy_bytes_per_s > 0 and link.write_bytes_per_s > 0
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == []  # copies removed


class _SlowSha:
    """sha256 at a crawl: the hasher lags far behind the bytes landing."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, data: Any) -> None:
        time.sleep(0.2)
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def test_a_lagging_hasher_still_reports_the_cut_stream(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Review: a peer lost while the hasher was gigabytes behind raised BufferError
    (the map closed under the hasher's view) instead of the copy's own failure."""
    if landing._splice is None:
        pytest.skip("no os.splice here")
    import types

    monkeypatch.setattr(landing, "BUF_BYTES", 1 << 20)
    monkeypatch.setattr(landing, "hashlib", types.SimpleNamespace(sha256=_SlowSha))
    data = os.urandom(40 << 20)
    sock, _ = _send(data[:-1])  # one byte short
    t0 = time.monotonic()
    with sock, pytest.raises(stream.PeerError, match="bytes short"):
        landing.receive_into(sock, str(tmp_path / "f"), len(data), _sha(data))
    assert time.monotonic() - t0 < 3.0  # the hasher stops within one step
    assert _leftovers(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "splice"), reason="no os.splice here")
def test_a_socket_that_cannot_splice_falls_back_before_any_byte(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A sandbox refusing splice on sockets (EPERM, EINVAL): the buffered way, whole."""
    real = os.splice

    def fake(src: int, dst: int, count: int, **kw: Any) -> int:
        if "offset_dst" not in kw:  # socket -> pipe
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))
        return int(real(src, dst, count, **kw))

    monkeypatch.setattr(landing, "_splice", fake)
    data = os.urandom(3 * landing.PIPE_BYTES + 1)
    sock, _ = _send(data)
    with sock:
        stream.receive_into(sock, str(tmp_path / "f"), len(data), _sha(data))
    assert (tmp_path / "f").read_bytes() == data


def test_receiving_a_large_file_does_not_grow_the_receivers_memory(tmp_path: Path) -> None:
    """Review: every hashed page of the map stayed in the receiver's RSS, so a trainer
    receiving replicas grew by each shard. Peak RSS (VmHWM) in a fresh process that
    receives 256 MiB must stay far below that."""
    import subprocess
    import sys

    code = f"""
import os, socket, threading, hashlib
from autohet_cli.peer import landing
data = os.urandom(256 << 20)
sha = hashlib.sha256(data).hexdigest()
a, b = socket.socketpair()
def send():
    a.sendall(data); a.close()
threading.Thread(target=send, daemon=True).start()
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) * 1024
before = hwm()
b.settimeout(10)
landing.receive_into(b, {str(tmp_path / "f")!r}, len(data), sha)
print((hwm() - before) >> 20)
"""
    if not os.path.exists("/proc/self/status") or landing._splice is None:
        pytest.skip("needs Linux's /proc and os.splice")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) < 128, out.stdout
