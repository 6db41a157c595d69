"""Checkpoint manifests (docs/checkpoint-format.md): validation with the file and field
named, paths, and the newest complete checkpoint from per-host listings."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from autohet_cli.errors import ConfigError
from autohet_cli.recovery.errors import RecoveryError
from autohet_cli.recovery.manifest import (
    COMPLETE,
    MANIFEST,
    Manifest,
    load_manifest,
    local_step_dir,
    manifest_from_json,
    manifest_to_dict,
    newest_complete,
    parse_manifest,
    parse_step_dir,
    remote_root,
    remote_step_dir,
    step_dir_name,
)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def raw_manifest(step: int = 40, hosts: tuple[str, ...] = ("a", "a", "b", "b")) -> dict[str, Any]:
    files = [
        {
            "path": f"__{r}_0.distcp",
            "sha256": sha(f"{step}-{r}"),
            "bytes": 100 + r,
            "host": h,
            "rank": r,
        }
        for r, h in enumerate(hosts)
    ]
    files.append(
        {
            "path": ".metadata",
            "sha256": sha(f"{step}-meta"),
            "bytes": 7,
            "host": hosts[0],
            "rank": 0,
        }
    )
    return {
        "schema": "autohet.checkpoint/v1",
        "step": step,
        "plan": "lab.v1",
        "plan_sha256": sha("plan"),
        "world_size": len(hosts),
        "files": files,
    }


def files_of(m: dict[str, Any]) -> set[str]:
    return {f["path"] for f in m["files"]}


# --------------------------------------------------------------------- parsing


def test_parse_valid_manifest_and_round_trip() -> None:
    raw = raw_manifest()
    m = parse_manifest(raw, "ck/manifest.json")
    assert m.step == 40
    assert (m.plan_name, m.plan_version) == ("lab", 1)
    assert m.world_size == 4
    assert [f.path for f in m.files] == [
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
        "__3_0.distcp",
        ".metadata",
    ]
    assert m.file("__2_0.distcp").host == "b"
    assert m.file("__2_0.distcp").num_bytes == 102
    assert m.file("__2_0.distcp").is_data and not m.file(".metadata").is_data
    assert m.num_bytes == 100 + 101 + 102 + 103 + 7
    assert manifest_to_dict(m) == raw
    assert parse_manifest(json.loads(json.dumps(manifest_to_dict(m))), "x") == m


def test_dotted_plan_names_keep_their_dots() -> None:
    raw = raw_manifest()
    raw["plan"] = "lab.mix-2.v13"
    m = parse_manifest(raw, "m")
    assert (m.plan_name, m.plan_version) == ("lab.mix-2", 13)


def _broken(edit: Any) -> dict[str, Any]:
    raw = copy.deepcopy(raw_manifest())
    edit(raw)
    return raw


@pytest.mark.parametrize(
    ("edit", "field", "hint"),
    [
        (lambda r: r.update(schema="autohet.checkpoint/v2"), "schema", "autohet.checkpoint/v1"),
        (lambda r: r.pop("plan_sha256"), "plan_sha256", "missing"),
        (lambda r: r.update(extra=1), "extra", "unknown key"),
        (lambda r: r.update(step=-1), "step", ">= 0"),
        (lambda r: r.update(step="40"), "step", "integer"),
        (lambda r: r.update(plan="lab"), "plan", ".v<N>"),
        (lambda r: r.update(world_size=0), "world_size", "at least 1"),
        (lambda r: r.update(plan_sha256="xyz"), "plan_sha256", "hex"),
        (lambda r: r["files"][1].update(sha256="A" * 64), "files[1].sha256", "hex"),
        (lambda r: r["files"][0].update(bytes=-5), "files[0].bytes", ">= 0"),
        (lambda r: r["files"][0].update(path="../../etc/passwd"), "files[0].path", "plain file"),
        (lambda r: r["files"][0].update(path="sub/x"), "files[0].path", "plain file"),
        (lambda r: r["files"][0].update(path="COMPLETE"), "files[0].path", "not a checkpoint"),
        (lambda r: r["files"][2].update(path="__0_0.distcp", rank=0), "files[2].path", "already"),
        (lambda r: r["files"][3].update(rank=9), "files[3].rank", "world_size"),
        (lambda r: r["files"][3].update(rank=2), "files[3].rank", "rank 3's file"),
        (lambda r: r["files"][0].update(host=""), "files[0].host", "empty"),
        (lambda r: r["files"][0].pop("sha256"), "files[0]", "sha256"),
        (lambda r: r["files"][0].update(owner="x"), "files[0]", "unknown key"),
        (
            lambda r: r.update(files=[f for f in r["files"] if f["path"] != ".metadata"]),
            "files",
            ".metadata",
        ),
        (lambda r: r.update(files={}), "files", "list"),
    ],
)
def test_invalid_manifest_names_file_and_field(edit: Any, field: str, hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_manifest(_broken(edit), "/ck/lab/step-00000040/manifest.json")
    msg = str(info.value)
    assert msg.startswith("/ck/lab/step-00000040/manifest.json")
    assert field in msg
    assert hint in msg


def test_load_manifest_from_disk_and_its_errors(tmp_path: Path) -> None:
    path = tmp_path / MANIFEST
    path.write_text(json.dumps(raw_manifest()), encoding="utf-8")
    assert load_manifest(path).step == 40
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"{path}: not valid JSON \(line 1\)"):
        load_manifest(path)
    with pytest.raises(ConfigError, match="file not found"):
        load_manifest(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="expected a mapping"):
        manifest_from_json("[1, 2]", "m.json")


# --------------------------------------------------------------------- paths


def test_step_directory_names_and_paths() -> None:
    assert step_dir_name(40) == "step-00000040"
    assert parse_step_dir("step-00000040") == 40
    assert parse_step_dir("step-123456789") == 123456789
    for other in ("step-40", "step-0000004x", "tmp", "step-00000040.tmp"):
        assert parse_step_dir(other) is None
    assert local_step_dir("/nvme/ckpt/", "lab", 7) == "/nvme/ckpt/lab/step-00000007"
    assert remote_step_dir("s3://b/ck/", "lab", 7) == "s3://b/ck/lab/step-00000007"
    assert remote_root("s3://bucket", {"AUTOHET_REMOTE_STORAGE": "/x"}) == "s3://bucket"
    assert remote_root(None, {"AUTOHET_REMOTE_STORAGE": "/x"}) == "/x"
    # No remote copy unless asked: never a shared, world-writable /tmp directory.
    assert remote_root(None, {}) is None and remote_root("none", {}) is None


# --------------------------------------------------------------------- choice


def _full(m: dict[str, Any], host: str) -> set[str]:
    """What host ``host`` holds of manifest ``m``: its files, plus the markers on rank 0's host."""
    held = {f["path"] for f in m["files"] if f["host"] == host}
    if m["files"][0]["host"] == host:
        held |= {MANIFEST, COMPLETE}
    return held


def test_newest_complete_skips_incomplete_newer_checkpoints() -> None:
    m20, m40, m60 = raw_manifest(20), raw_manifest(40), raw_manifest(60)
    listings = {
        "a": {
            "step-00000020": _full(m20, "a"),
            "step-00000040": _full(m40, "a"),
            # step 60: every rank wrote its files, rank 0 died before COMPLETE
            "step-00000060": _full(m60, "a") - {COMPLETE},
            "tmp": {"junk"},
        },
        "b": {
            d: _full(m, "b")
            for d, m in (("step-00000020", m20), ("step-00000040", m40), ("step-00000060", m60))
        },
    }
    manifests = {step_dir_name(m["step"]): json.dumps(m) for m in (m20, m40, m60)}
    choice = newest_complete(listings, manifests)
    assert choice.step_dir == "step-00000040"
    assert choice.step == 40
    assert choice.manifest == parse_manifest(m40, "x")
    assert choice.remote_only == ()
    assert choice.holders["__2_0.distcp"] == ("b",)
    assert choice.holders[".metadata"] == ("a",)
    assert len(choice.skipped) == 1
    assert choice.skipped[0][0] == "step-00000060"
    assert "incomplete" in choice.skipped[0][1]


def test_manifest_without_complete_marker_or_unread_is_not_complete() -> None:
    m40 = raw_manifest(40)
    listing: dict[str, dict[str, set[str]]] = {
        "a": {"step-00000040": {*files_of(m40), COMPLETE}},  # no manifest.json
        "b": {"step-00000040": set()},
    }
    with pytest.raises(RecoveryError, match="no complete checkpoint.*step-00000040: incomplete"):
        newest_complete(listing, {"step-00000040": json.dumps(m40)})
    listing = {"a": {"step-00000040": {*files_of(m40), COMPLETE, MANIFEST}}}
    with pytest.raises(RecoveryError, match="manifest.json was not read"):
        newest_complete(listing, {})


def test_corrupt_or_mismatched_manifest_falls_back_to_an_older_step() -> None:
    m20, m40 = raw_manifest(20), raw_manifest(40)
    everything = {COMPLETE, MANIFEST}
    listings = {
        "a": {
            "step-00000020": files_of(m20) | everything,
            "step-00000040": files_of(m40) | everything,
            "step-00000050": files_of(m40) | everything,
        }
    }
    manifests: dict[str, Manifest | str] = {
        "step-00000020": parse_manifest(m20, "m20"),  # parsed manifests are accepted too
        "step-00000040": '{"schema": "autohet.checkpoint/v1", "step": 40',  # truncated
        "step-00000050": json.dumps(m40),  # says step 40
    }
    choice = newest_complete(listings, manifests)
    assert choice.step == 20
    reasons = dict(choice.skipped)
    assert "says step 40, not 50" in reasons["step-00000050"]
    assert "invalid manifest" in reasons["step-00000040"]
    assert "not valid JSON" in reasons["step-00000040"]


def test_files_lost_with_their_host_need_the_remote_copy() -> None:
    m40 = raw_manifest(40)
    # Host b (ranks 2, 3) was lost: only a's listing and the remote copy remain.
    listings = {"a": {"step-00000040": _full(m40, "a")}}
    manifests = {"step-00000040": json.dumps(m40)}
    with pytest.raises(RecoveryError, match=r"lost everywhere: __2_0.distcp \(written on b\)"):
        newest_complete(listings, manifests)
    remote = {"step-00000040": files_of(m40) | {MANIFEST}}  # still uploading COMPLETE
    choice = newest_complete(listings, manifests, remote=remote)
    assert choice.step == 40
    assert choice.remote_only == ("__2_0.distcp", "__3_0.distcp")
    assert choice.holders["__0_0.distcp"] == ("a",)
    assert choice.holders["__3_0.distcp"] == ()


def test_remote_markers_count_when_rank0_host_is_lost() -> None:
    m40 = raw_manifest(40)
    listings = {"b": {"step-00000040": _full(m40, "b")}}  # a (rank 0, markers) lost
    remote = {"step-00000040": files_of(m40) | {MANIFEST, COMPLETE}}
    choice = newest_complete(listings, {"step-00000040": json.dumps(m40)}, remote=remote)
    assert choice.step == 40
    assert set(choice.remote_only) == {"__0_0.distcp", "__1_0.distcp", ".metadata"}


def test_before_step_falls_back_further() -> None:
    m20, m40 = raw_manifest(20), raw_manifest(40)
    listings = {
        "a": {step_dir_name(m["step"]): files_of(m) | {MANIFEST, COMPLETE} for m in (m20, m40)}
    }
    manifests = {step_dir_name(m["step"]): json.dumps(m) for m in (m20, m40)}
    assert newest_complete(listings, manifests).step == 40
    assert newest_complete(listings, manifests, before_step=40).step == 20
    with pytest.raises(RecoveryError):
        newest_complete(listings, manifests, before_step=20)


def test_no_checkpoint_at_all() -> None:
    with pytest.raises(RecoveryError, match="no checkpoint step directory found on a, b"):
        newest_complete({"a": {}, "b": {"junk": {"x"}}}, {})


def test_steps_compare_numerically_beyond_eight_digits() -> None:
    small, big = raw_manifest(99_999_999), raw_manifest(100_000_000)
    listings = {
        "a": {step_dir_name(m["step"]): files_of(m) | {MANIFEST, COMPLETE} for m in (small, big)}
    }
    manifests = {step_dir_name(m["step"]): json.dumps(m) for m in (small, big)}
    assert newest_complete(listings, manifests).step == 100_000_000


@pytest.mark.parametrize("plan", ["../../../tmp/x.v1", "a/b.v2", ".hidden.v1"])
def test_a_manifest_naming_a_plan_outside_the_checkpoint_dir_is_refused(plan: str) -> None:
    """Issue 11, item 5: a manifest's plan made recover read and write outside its root."""
    raw = {
        "schema": "autohet.checkpoint/v1",
        "step": 1,
        "plan": plan,
        "plan_sha256": "a" * 64,
        "world_size": 1,
        "files": [{"path": ".metadata", "sha256": "b" * 64, "bytes": 1, "host": "h", "rank": 0}],
    }
    with pytest.raises(ConfigError, match="plan: expected '<plan name>.v<N>'"):
        parse_manifest(raw, "m.json")


def test_manifests_are_authenticated_with_the_job_key() -> None:
    """Issue 11, item 1: the sha256 in a manifest was whatever its writer put there."""
    from autohet_cli.ckpt.format import (
        ManifestAuthError,
        manifest_to_dict,
        signed_manifest_text,
        verified_manifest,
    )

    m = parse_manifest(
        {
            "schema": "autohet.checkpoint/v1",
            "step": 4,
            "plan": "lab.v1",
            "plan_sha256": "a" * 64,
            "world_size": 1,
            "files": [
                {"path": ".metadata", "sha256": "b" * 64, "bytes": 1, "host": "h", "rank": 0}
            ],
        },
        "m",
    )
    key = b"k" * 32
    text = signed_manifest_text(m, key)
    assert verified_manifest(text, key, "m") == m
    with pytest.raises(ManifestAuthError, match="does not verify"):
        verified_manifest(text, b"x" * 32, "m")
    forged = json.loads(text)
    forged["step"] = 99
    with pytest.raises(ManifestAuthError, match="does not verify"):
        verified_manifest(json.dumps(forged), key, "m")
    with pytest.raises(ManifestAuthError, match="not authenticated"):
        verified_manifest(json.dumps(manifest_to_dict(m)), key, "m")
