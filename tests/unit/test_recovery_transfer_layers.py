"""The 'layers' transfer rule on hand-built manifests: a host gets ``.metadata``, the
file(s) holding shared entries and the files holding its new layers (closed over tied
groups); a manifest without the layer record falls back to 'all', saying why."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from test_recovery_transfer import MB, REMOTE_ROOT, applied, cluster, plan, sha

from autohet_cli.recovery.errors import RecoveryError
from autohet_cli.recovery.manifest import COMPLETE, MANIFEST, Manifest, parse_manifest
from autohet_cli.recovery.transfer import choose_rule, host_layers, needed_files, plan_transfers

# (host, bytes, layers, shared) per rank's data file; .metadata is rank 0's.
Files = Sequence[tuple[str, int, Sequence[int], bool]]

# The writer: one pipeline of 3 stages, h0 [0,3), h1 [3,6), h2 [6,8); rank 0 holds
# the shared entries (step, run, ...), as the writer makes it.
THREE_STAGES: Files = (
    ("h0", 30 * MB, (0, 1, 2), True),
    ("h1", 20 * MB, (3, 4, 5), False),
    ("h2", 10 * MB, (6, 7), False),
)


def manifest(files: Files, tied: Sequence[Sequence[int]] | None = ()) -> Manifest:
    raw: dict[str, Any] = {
        "schema": "autohet.checkpoint/v1",
        "step": 40,
        "plan": "lab.v1",
        "plan_sha256": sha("plan"),
        "world_size": len(files),
        "files": [
            {
                "path": f"__{r}_0.distcp",
                "sha256": sha(f"f{r}"),
                "bytes": n,
                "host": h,
                "rank": r,
                "layers": list(layers),
                "shared": shared,
            }
            for r, (h, n, layers, shared) in enumerate(files)
        ]
        + [{"path": ".metadata", "sha256": sha("meta"), "bytes": 1000, "host": "h0", "rank": 0}],
    }
    if tied is not None:
        raw["tied_layers"] = [list(g) for g in tied]
    return parse_manifest(raw, "manifest.json")


def as_written(m: Manifest, markers: str = "h0") -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for f in m.files:
        out.setdefault(f.host, {})[f.path] = f.sha256
    out[markers] |= {MANIFEST: "x", COMPLETE: ""}
    return out


def test_each_host_fetches_the_files_of_its_layers_plus_the_shared_one() -> None:
    """3 stages replanned onto 2 hosts after h2 is lost: h0 [0,4), h1 [4,8)."""
    m = manifest(THREE_STAGES)
    new = plan("lab", 2, [[("h0", 0, 4), ("h1", 4, 8)]])
    assert choose_rule(m) == ("layers", "the manifest records the layers of every data file")
    needs = needed_files(m, new, rule="layers")
    assert set(needs["h0"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}  # layer 3 is h1's
    assert set(needs["h1"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
    c = cluster(["h0", "h1", "h2"])
    present = as_written(m)
    del present["h2"]
    tp = plan_transfers(m, new, c, present, remote_root=REMOTE_ROOT, lost=["h2"])
    assert tp.rule == "layers"  # chosen by default: the manifest records what files hold
    moved = {(i.dest_host, i.file, i.source.kind) for i in tp.items}
    assert moved == {
        ("h0", "__1_0.distcp", "peer"),
        ("h1", "__0_0.distcp", "peer"),  # the shared entries: every host reads them
        ("h1", ".metadata", "peer"),
        ("h1", "__2_0.distcp", "remote"),  # h2's file survives only in remote storage
    }
    assert tp.skipped == (("h0", "__2_0.distcp"),)
    assert tp.bytes_skipped == 10 * MB
    # Exactly what "all" would have moved on top: h2's file to h0 as well.
    every = plan_transfers(m, new, c, present, remote_root=REMOTE_ROOT, lost=["h2"], rule="all")
    assert every.rule_reason == "asked for" and every.skipped == ()
    total = every.bytes_from_peers + every.bytes_from_remote
    assert total - (tp.bytes_from_peers + tp.bytes_from_remote) == tp.bytes_skipped
    d = tp.to_dict()
    assert (d["rule"], d["bytes_skipped"]) == ("layers", 10 * MB)
    assert d["skipped"] == [{"host": "h0", "file": "__2_0.distcp"}]
    # Idempotent: after the copies nothing is left to do, and the skip stays a skip.
    again = plan_transfers(m, new, c, applied(tp, present), remote_root=REMOTE_ROOT, lost=["h2"])
    assert again.items == () and again.finalize_hosts == ()
    assert again.skipped == tp.skipped


def test_a_file_no_host_reads_may_be_lost_everywhere() -> None:
    """Two pipeline replicas: DCP stored every replicated entry in ranks 0 and 1's files,
    so rank 2's file holds nothing. Its host is lost and it never reached remote
    storage: fatal under "all", nothing under "layers"."""
    files: Files = (
        ("h0", 30 * MB, (0, 1, 2, 3), True),
        ("h1", 20 * MB, (4, 5, 6, 7), False),
        ("h2", 1 * MB, (), False),
    )
    m = manifest(files)
    new = plan("lab", 2, [[("h0", 0, 4), ("h1", 4, 8)]])
    c = cluster(["h0", "h1", "h2"])
    present = as_written(m)
    del present["h2"]
    remote = {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    with pytest.raises(RecoveryError, match=r"every copy of __2_0.distcp \(written on h2\)"):
        plan_transfers(
            m,
            new,
            c,
            present,
            remote_root=REMOTE_ROOT,
            remote_files=remote,
            lost=["h2"],
            rule="all",
        )
    tp = plan_transfers(
        m, new, c, present, remote_root=REMOTE_ROOT, remote_files=remote, lost=["h2"]
    )
    assert tp.skipped == (
        ("h0", "__1_0.distcp"),  # layers 4-7: h1's
        ("h0", "__2_0.distcp"),
        ("h1", "__2_0.distcp"),
    )
    assert tp.bytes_skipped == 20 * MB + 2 * MB
    assert {(i.dest_host, i.file) for i in tp.items} == {
        ("h1", "__0_0.distcp"),
        ("h1", ".metadata"),
    }


def test_a_tied_group_pulls_in_the_other_ends_file() -> None:
    """The embedding (layer 0) and head (layer 7) are tied. The tied optimizer state is
    filed under layer 0's name in rank 2's file; the head lives in rank 3's file."""
    files: Files = (
        ("h0", 30 * MB, (1, 2, 3), True),
        ("h1", 20 * MB, (4, 5), False),
        ("h2", 10 * MB, (0,), False),
        ("h3", 10 * MB, (6, 7), False),
    )
    new = plan("lab", 2, [[("hA", 0, 4), ("hB", 4, 8)]])
    untied = needed_files(manifest(files, tied=()), new, rule="layers")
    assert set(untied["hA"]) == {".metadata", "__0_0.distcp", "__2_0.distcp"}
    assert set(untied["hB"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "__3_0.distcp"}
    tied = needed_files(manifest(files, tied=[(0, 7)]), new, rule="layers")
    assert set(tied["hA"]) == set(untied["hA"]) | {"__3_0.distcp"}  # holds 0: needs 7
    assert set(tied["hB"]) == set(untied["hB"]) | {"__2_0.distcp"}  # holds 7: needs 0
    # A host holding only middle layers is not pulled in by the tie.
    mid = plan("lab", 2, [[("hA", 0, 2), ("hB", 2, 6), ("hC", 6, 8)]])
    needs = needed_files(manifest(files, tied=[(0, 7)]), mid, rule="layers")
    assert set(needs["hB"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}


def test_tied_groups_close_transitively() -> None:
    new = plan("lab", 2, [[("hA", 0, 2), ("hB", 2, 6), ("hC", 6, 8)]])
    assert host_layers(new, "hA", [(1, 4), (4, 7)]) == {0, 1, 4, 7}
    assert host_layers(new, "hB", [(1, 4), (4, 7)]) == {1, 2, 3, 4, 5, 7}
    assert host_layers(new, "hB", []) == {2, 3, 4, 5}


def test_without_the_layer_record_every_file_moves() -> None:
    old = parse_manifest(
        {
            "schema": "autohet.checkpoint/v1",
            "step": 40,
            "plan": "lab.v1",
            "plan_sha256": sha("plan"),
            "world_size": 2,
            "files": [
                {"path": "__0_0.distcp", "sha256": sha("a"), "bytes": 5, "host": "h0", "rank": 0},
                {"path": "__1_0.distcp", "sha256": sha("b"), "bytes": 7, "host": "h1", "rank": 1},
                {"path": ".metadata", "sha256": sha("m"), "bytes": 1, "host": "h0", "rank": 0},
            ],
        },
        "old/manifest.json",
    )
    assert old.tied_layers is None and old.file("__1_0.distcp").layers is None
    new = plan("lab", 2, [[("h0", 0, 4), ("h1", 4, 8)]])
    tp = plan_transfers(old, new, cluster(["h0", "h1"]), {}, remote_root=REMOTE_ROOT)
    assert tp.rule == "all"
    assert tp.rule_reason == (
        "the manifest does not record tied_layers (written by an older autohet): "
        "every file is moved"
    )
    assert {(i.dest_host, i.file) for i in tp.items} == {
        (h, f) for h in ("h0", "h1") for f in ("__0_0.distcp", "__1_0.distcp", ".metadata")
    }
    assert tp.skipped == () and tp.bytes_skipped == 0
    with pytest.raises(RecoveryError, match="'layers' transfer rule needs the layer record"):
        needed_files(old, new, rule="layers")
    # Layers recorded for every file but the tied groups not: still "all".
    no_ties = manifest(THREE_STAGES, tied=None)
    rule, why = choose_rule(no_ties)
    assert rule == "all" and "tied_layers" in why
    with pytest.raises(RecoveryError, match="unknown transfer rule"):
        choose_rule(no_ties, "some")  # type: ignore[arg-type]
