"""Issue 45, item 5: a replica receiver answers HAVE for the very bytes, not the size.

A stale file of the pushed size (from a run a resume set aside) used to count as the
copy: the sender skipped it, the manifest listed it, and after the origin host was
lost recover found no good copy."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from autohet_cli.peer import held, stream
from autohet_cli.peer.held import HeldFiles
from autohet_cli.peer.placement import Placement
from autohet_cli.peer.replicate import Replicator, Tally
from tests.peering import KEY, STEP


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _replicate(receiver: Replicator, tmp_path: Path, data: bytes) -> tuple[Path, Tally]:
    """Host a's rank 0 replicates its one shard of step 2 to b (the receiver)."""
    job = tmp_path / "a" / "plan" / "default"
    (job / STEP).mkdir(parents=True, exist_ok=True)
    name = "__0_0.distcp"
    (job / STEP / name).write_bytes(data)
    files = [{"path": name, "bytes": len(data), "sha256": _sha(data), "host": "a", "rank": 0}]
    sender = Replicator(host="a", plan_dir=job, key=KEY, replicas=1, budget_bytes=None, owner=False)
    assert receiver.server is not None
    where = {"b": {"addr": "127.0.0.1", "port": receiver.server.port}}
    placement = Placement(partners={"a": ("b",)}, short={})
    tally = sender.send(2, job / STEP, files, placement, where, rank=0)
    return receiver.plan_dir / STEP / name, tally


def test_a_stale_file_of_the_same_size_is_replaced_not_counted_as_the_copy(
    receiver: Replicator, tmp_path: Path
) -> None:
    data = os.urandom(3 << 20)
    dest = receiver.plan_dir / STEP / "__0_0.distcp"
    dest.write_bytes(os.urandom(len(data)))  # a set-aside run's bytes, the same size
    got, tally = _replicate(receiver, tmp_path, data)
    assert _sha(got.read_bytes()) == _sha(data)
    assert tally.sent_bytes == len(data) and tally.skipped == 0 and not tally.errors
    assert "have" not in receiver.refused
    assert not [p for p in got.parent.iterdir() if p.name.endswith(stream.PART)]


def test_the_very_bytes_already_there_are_answered_have(
    receiver: Replicator, tmp_path: Path
) -> None:
    data = os.urandom(1 << 20)
    (receiver.plan_dir / STEP / "__0_0.distcp").write_bytes(data)
    got, tally = _replicate(receiver, tmp_path, data)
    assert tally.skipped == 1 and tally.sent_bytes == 0
    assert got.read_bytes() == data


def test_a_remembered_digest_is_not_fooled_by_a_same_size_rewrite_with_its_mtime_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache keys on device, inode, size, mtime and ctime; restoring the mtime (as
    ``ckpt.sums``'s record would accept) does not restore the ctime."""
    monkeypatch.setattr(held, "RACY_NS", 0)  # trust an entry at once (no clock tick here)
    path = tmp_path / "f"
    old, new = b"a" * 4096, b"b" * 4096
    path.write_bytes(old)
    files = HeldFiles()
    assert files.holds(path, len(old), _sha(old))
    st = path.stat()
    with path.open("r+b") as f:  # in place: the same inode
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_ino == st.st_ino
    assert not files.holds(path, len(old), _sha(old))
    assert files.holds(path, len(new), _sha(new))


def test_a_remembered_digest_spares_hashing_again_once_the_file_is_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "f"
    data = os.urandom(1 << 16)
    path.write_bytes(data)
    files = HeldFiles()
    reads: list[Path] = []
    real = HeldFiles._hash

    def counted(p: Path, st: os.stat_result) -> object:
        reads.append(p)
        return real(p, st)

    monkeypatch.setattr(HeldFiles, "_hash", staticmethod(counted))
    assert files.holds(path, len(data), _sha(data))
    assert files.holds(path, len(data), _sha(data))
    assert len(reads) == 2  # changed within RACY_NS of the reading: hashed again
    st = path.stat()
    settled = st.st_ctime_ns - held.RACY_NS - 1
    os.utime(path, ns=(settled, settled))  # mtime back; ctime is now, hence racy still
    monkeypatch.setattr(held, "_now_ns", lambda: st.st_ctime_ns + 3 * held.RACY_NS)
    assert files.holds(path, len(data), _sha(data))  # read "3 RACY_NS later"
    assert files.holds(path, len(data), _sha(data))
    assert len(reads) == 3  # settled: remembered
    assert not files.holds(path, len(data), _sha(b"other"))
    assert len(reads) == 3


def test_a_symlink_in_place_is_not_held(tmp_path: Path) -> None:
    target = tmp_path / "t"
    target.write_bytes(b"x" * 10)
    link = tmp_path / "l"
    link.symlink_to(target)
    assert not HeldFiles().holds(link, 10, _sha(b"x" * 10))
