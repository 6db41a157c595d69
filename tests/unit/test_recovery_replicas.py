"""Issue 30: recover takes a lost host's shards from the partner that keeps a copy
(peer.replicate), reads remote storage only when the host and its partners are all
lost, and never takes a partner's corrupt copy. Hosts of this machine, no training
(tests/recovery_site.py): host c's shard is ``__2_0.distcp``."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from autohet_cli.recovery import session
from tests.recovery_site import Site, make_site

STEP = 6
C_SHARD = "__2_0.distcp"


def _request(site: Site, lost: tuple[str, ...]) -> session.RecoverRequest:
    return session.RecoverRequest(
        plan_file=site.plan_file, lost=lost, resume=False, time_limit_s=5.0
    )


def _replicate(site: Site, to: str, *, corrupt: bool = False) -> Path:
    """What the runtime leaves on c's partner: c's file in the partner's step dir."""
    dest = site.step_dir(to, STEP) / C_SHARD
    shutil.copyfile(site.step_dir("c", STEP) / C_SHARD, dest)
    if corrupt:
        data = bytearray(dest.read_bytes())
        data[100] ^= 0xFF
        dest.write_bytes(bytes(data))
    return dest


def _sha(site: Site, host: str, name: str) -> str:
    return hashlib.sha256((site.step_dir(host, STEP) / name).read_bytes()).hexdigest()


def _signed(site: Site) -> dict[str, str]:
    man = json.loads((site.step_dir("a", STEP) / "manifest.json").read_text())
    return {f["path"]: f["sha256"] for f in man["files"]}


def test_a_lost_hosts_shards_come_from_its_partner_not_remote(tmp_path: Path) -> None:
    site = make_site(tmp_path)
    _replicate(site, "a")
    said: list[str] = []
    res = session.recover(_request(site, ("c",)), said.append)
    assert res.exit_code == 0 and res.report["resumed_step"] == STEP
    assert res.report["bytes_from_remote"] == 0
    moves = {(m["dest"], m["file"]): m for m in res.report["transfers"]}
    assert moves[("b", C_SHARD)]["source"] == "a"  # from the partner, on this machine
    assert all(m["source_kind"] != "remote" for m in moves.values())
    assert _sha(site, "b", C_SHARD) == _signed(site)[C_SHARD]
    assert any(f"b: {C_SHARD} from peer a (" in line for line in said), said


def test_the_host_and_its_partner_both_lost_falls_back_to_remote(tmp_path: Path) -> None:
    site = make_site(tmp_path)
    _replicate(site, "b")  # b keeps c's copy, and b is lost too
    res = session.recover(_request(site, ("b", "c")), lambda _l: None)
    assert res.exit_code == 0
    from_remote = {m["file"] for m in res.report["transfers"] if m["source_kind"] == "remote"}
    assert from_remote == {C_SHARD, "__1_0.distcp"}  # c's and b's: no survivor holds them
    assert res.report["bytes_from_remote"] == 2 * 4096
    assert _sha(site, "a", C_SHARD) == _signed(site)[C_SHARD]


def test_a_partners_corrupt_copy_is_refused_and_fetched_from_another_partner(
    tmp_path: Path,
) -> None:
    site = make_site(tmp_path)
    bad = _replicate(site, "a", corrupt=True)
    _replicate(site, "b")
    res = session.recover(_request(site, ("c",)), lambda _l: None)
    assert res.exit_code == 0 and res.report["bytes_from_remote"] == 0
    moves = {(m["dest"], m["file"]): m for m in res.report["transfers"]}
    assert moves[("a", C_SHARD)]["source"] == "b"
    # the corrupt copy was replaced by verified bytes, under its name
    assert hashlib.sha256(bad.read_bytes()).hexdigest() == _signed(site)[C_SHARD]


def test_a_partners_corrupt_copy_with_no_other_partner_comes_from_remote(
    tmp_path: Path,
) -> None:
    site = make_site(tmp_path)
    _replicate(site, "a", corrupt=True)
    res = session.recover(_request(site, ("c",)), lambda _l: None)
    assert res.exit_code == 0
    from_remote = {
        (m["dest"], m["file"]) for m in res.report["transfers"] if m["source_kind"] == "remote"
    }
    assert ("a", C_SHARD) in from_remote or ("b", C_SHARD) in from_remote
    for host in ("a", "b"):
        assert _sha(site, host, C_SHARD) == _signed(site)[C_SHARD]
