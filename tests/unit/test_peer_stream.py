"""Issue 30: the authenticated peer streams and the runtime's replica receiver."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from autohet_cli.peer import stream
from autohet_cli.peer.replicate import Replicator, reserve_bytes
from tests import peering
from tests.peering import KEY, STEP


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _push(r: Replicator, src: Path, *, key: bytes = KEY, **over: object) -> bool:
    data = src.read_bytes()
    header = {"op": "push", "step": 2, "name": src.name, "bytes": len(data), "sha256": _sha(data)}
    header.update(over)
    assert r.server is not None
    return stream.push_file("127.0.0.1", r.server.port, key, str(src), header)


def _leftovers(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.endswith(stream.PART)]


def test_a_pushed_file_lands_verified_and_a_second_push_is_skipped(
    receiver: Replicator, tmp_path: Path
) -> None:
    src = tmp_path / "__3_0.distcp"
    data = os.urandom(3 * stream.BUF_BYTES + 12345)  # several buffers, a ragged end
    src.write_bytes(data)
    assert _push(receiver, src) is True
    got = receiver.plan_dir / STEP / src.name
    assert got.read_bytes() == data
    assert _push(receiver, src) is False  # HAVE: already there
    empty = tmp_path / "COMPLETE"
    empty.write_bytes(b"")
    assert _push(receiver, empty) is True
    assert (receiver.plan_dir / STEP / "COMPLETE").is_file()


def test_a_stranger_without_the_job_key_is_refused(receiver: Replicator, tmp_path: Path) -> None:
    src = tmp_path / "__3_0.distcp"
    src.write_bytes(b"x" * 1000)
    with pytest.raises(stream.PeerError, match="job key differs"):
        _push(receiver, src, key=b"z" * 32)
    assert not (receiver.plan_dir / STEP / src.name).exists()


def test_bytes_that_fail_their_sha256_are_never_seen_under_the_name(
    receiver: Replicator, tmp_path: Path
) -> None:
    src = tmp_path / "__3_0.distcp"
    src.write_bytes(b"y" * 100_000)
    with pytest.raises(stream.PeerError, match="sha256 mismatch"):
        _push(receiver, src, sha256=_sha(b"something else"))
    d = receiver.plan_dir / STEP
    assert not (d / src.name).exists() and not _leftovers(d)


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"name": "../../evil"}, "not a checkpoint file name"),
        ({"name": ".autohet-key"}, "not a checkpoint file name"),
        ({"step": 7}, "has no step 7"),
        ({"bytes": -1}, "bad size"),
    ],
)
def test_pushes_outside_the_contract_are_refused(
    receiver: Replicator, tmp_path: Path, over: dict[str, object], why: str
) -> None:
    src = tmp_path / "__3_0.distcp"
    src.write_bytes(b"z" * 10)
    with pytest.raises(stream.PeerError, match=why):
        _push(receiver, src, **over)
    assert sorted(p.name for p in (receiver.plan_dir / STEP).iterdir()) == []
    assert not (receiver.plan_dir.parent / "evil").exists()


def test_the_budget_is_respected_per_step(tmp_path: Path) -> None:
    job = tmp_path / "plan" / "default"
    (job / STEP).mkdir(parents=True)
    r = peering.receiver(job, 150_000)
    try:
        first, second = tmp_path / "__1_0.distcp", tmp_path / "__2_0.distcp"
        first.write_bytes(b"a" * 100_000)
        second.write_bytes(b"b" * 100_000)
        assert _push(r, first)
        with pytest.raises(stream.PeerError, match="replica budget"):
            _push(r, second)  # 200 KB would exceed 150 KB
        assert not (job / STEP / second.name).exists()
        assert r.room_bytes() <= 150_000
    finally:
        r.close()


def test_get_serves_only_the_files_it_was_started_with(tmp_path: Path) -> None:
    offered, secret = tmp_path / "shard", tmp_path / "secret"
    data = os.urandom(1 << 20)
    offered.write_bytes(data)
    secret.write_bytes(b"no")
    server = stream.PeerServer("127.0.0.1", KEY, stream.serve_files({str(offered)}))
    try:
        dest = tmp_path / "out" / "shard"
        stream.get_file(
            "127.0.0.1", server.port, KEY, str(offered), str(dest), len(data), _sha(data)
        )
        assert dest.read_bytes() == data
        with pytest.raises(stream.PeerError, match="not served here"):
            stream.get_file(
                "127.0.0.1", server.port, KEY, str(secret), str(tmp_path / "s"), 2, _sha(b"no")
            )
        bad = tmp_path / "out" / "bad"
        with pytest.raises(stream.HashMismatch):
            stream.get_file(
                "127.0.0.1", server.port, KEY, str(offered), str(bad), len(data), _sha(b"")
            )
        assert not bad.exists() and not _leftovers(tmp_path / "out")
    finally:
        server.close()


def test_a_hosts_own_next_save_comes_before_room_for_others(receiver: Replicator) -> None:
    """Review of issue 30: replicas filled the room the host's own next save needed."""
    before = receiver.room_bytes()
    own = 1 << 30
    files = [{"path": "__0_0.distcp", "bytes": own, "host": "b", "rank": 0, "sha256": "0" * 64}]
    receiver.placement([receiver.info()], files)
    assert before - receiver.room_bytes() >= own - (64 << 20)  # the disk moves a little


def test_concurrent_pushes_cannot_overshoot_the_budget(tmp_path: Path) -> None:
    import threading

    job = tmp_path / "plan" / "default"
    (job / STEP).mkdir(parents=True)
    r = peering.receiver(job, 250_000)
    results: list[str] = []
    try:
        srcs = []
        for i in range(6):
            src = tmp_path / f"__{i}_0.distcp"
            src.write_bytes(bytes([i]) * 100_000)
            srcs.append(src)

        def push(src: Path) -> None:
            try:
                _push(r, src)
                results.append("ok")
            except stream.PeerError as exc:
                results.append(str(exc))

        threads = [threading.Thread(target=push, args=(s,)) for s in srcs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results.count("ok") == 2, results
        landed = sum(p.stat().st_size for p in (job / STEP).glob("*.distcp"))
        assert landed <= 250_000
    finally:
        r.close()


def test_a_client_dribbling_its_handshake_is_cut_off(
    receiver: Replicator, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket
    import time

    from autohet_cli.peer import gate

    monkeypatch.setattr(gate, "HANDSHAKE_S", 1.0)
    assert receiver.server is not None
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", receiver.server.port), timeout=10) as s:
        s.recv(32)  # the nonce
        try:
            for _ in range(10):  # one byte of the header length a while
                s.sendall(b"\0")
                time.sleep(0.4)
            assert s.recv(1) == b""
        except OSError:
            pass  # cut: reset
    assert time.monotonic() - started < 4.5


def test_complete_goes_only_to_partners_every_rank_of_the_host_reached(
    tmp_path: Path, receiver: Replicator
) -> None:
    from autohet_cli.peer.replicate import Tally

    src_job = tmp_path / "a" / "plan" / "default"
    (src_job / STEP).mkdir(parents=True)
    (src_job / STEP / "COMPLETE").write_bytes(b"")
    sender = Replicator(
        host="a", plan_dir=src_job, key=KEY, replicas=1, budget_bytes=None, owner=False
    )
    assert receiver.server is not None
    where = {"b": {"addr": "127.0.0.1", "port": receiver.server.port}}
    partial = [Tally(host="a", reached=["b"]), Tally(host="a", reached=[])]
    assert sender.complete(2, src_job / STEP, partial, where) == []
    assert not (receiver.plan_dir / STEP / "COMPLETE").exists()
    whole = [Tally(host="a", reached=["b"]), Tally(host="a", reached=["b"])]
    assert sender.complete(2, src_job / STEP, whole, where) == []
    assert (receiver.plan_dir / STEP / "COMPLETE").is_file()


def test_an_unreachable_partner_is_given_up_on_at_once(tmp_path: Path) -> None:
    """Review of issue 30: a dead partner cost a connect timeout per file, and the next
    save (a preemption's too) waits for the replication of this one."""
    import socket
    import time

    from autohet_cli.peer.placement import Placement

    job = tmp_path / "a" / "plan" / "default"
    (job / STEP).mkdir(parents=True)
    files = []
    for i in range(12):
        data = bytes([i]) * 1000
        (job / STEP / f"__0_{i}.distcp").write_bytes(data)
        files.append(
            {"path": f"__0_{i}.distcp", "bytes": 1000, "sha256": _sha(data), "host": "a", "rank": 0}
        )
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nobody listens there: refused
    r = Replicator(host="a", plan_dir=job, key=KEY, replicas=1, budget_bytes=None, owner=False)
    placement = Placement(partners={"a": ("b",)}, short={})
    started = time.monotonic()
    tally = r.send(
        2, job / STEP, files, placement, {"b": {"addr": "127.0.0.1", "port": port}}, rank=0
    )
    assert time.monotonic() - started < 5
    assert tally.sent_bytes == 0 and len(tally.errors) == 12 and tally.reached == []
    assert sum("skipped: b could not be reached" in e for e in tally.errors) >= 8


def test_the_disk_reserve_is_5_percent_of_the_disk_within_256_mib_and_2_gib() -> None:
    """CI (stop 38): 5% of a 252 GB disk held back 12.6 GB, so a busy disk with 10 GB
    free took no replicas at all; the host's own next save is reserved apart."""
    assert reserve_bytes(20 << 30) == (20 << 30) // 20
    assert reserve_bytes(252 * 10**9) == 2 << 30
    assert reserve_bytes(1 << 30) == 256 << 20
