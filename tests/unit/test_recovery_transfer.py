"""The shard transfer plan: files in place are skipped, survivors serve before remote
storage, remote only for files whose every copy was lost, load spread over peers, the
fastest link chosen, and idempotence (the 'layers' rule: test_recovery_transfer_layers).
The manifests here carry no layer record, so the plan moves every file ('all')."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from autohet_cli.cluster import Cluster, cluster_from_dict
from autohet_cli.plan import Device, Pipeline, Plan, Stage
from autohet_cli.recovery.errors import RecoveryError
from autohet_cli.recovery.manifest import COMPLETE, MANIFEST, Manifest, parse_manifest
from autohet_cli.recovery.transfer import TransferPlan, plan_transfers
from autohet_cli.settings import TrainingSettings

REMOTE_ROOT = "/tmp/autohet-remote"
MB = 1_000_000


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def cluster(
    hosts: Sequence[str],
    pairs: Mapping[tuple[str, str], float] | None = None,
    addresses: Mapping[str, str] | None = None,
) -> Cluster:
    return cluster_from_dict(
        {
            "schema": "autohet.cluster/v1",
            "name": "t",
            "network": {
                "inter_node_gbps": 100,
                "pairs": [{"hosts": list(k), "gbps": v} for k, v in (pairs or {}).items()],
            },
            "hosts": [
                {
                    "name": h,
                    "address": (addresses or {}).get(h, f"127.0.0.{i + 2}"),
                    "gpus": {"type": "A100-40", "count": 4},
                    "checkpoint_dir": f"/ck/{h}",
                }
                for i, h in enumerate(hosts)
            ],
        },
        "t.yaml",
    )


def plan(name: str, version: int, hosts_layers: Sequence[Sequence[tuple[str, int, int]]]) -> Plan:
    """One pipeline per entry; a stage per (host, start, end); one GPU per stage."""
    used: dict[str, int] = {}
    pipelines = []
    for stages in hosts_layers:
        built = []
        for host, a, b in stages:
            gpu = used.get(host, 0)
            used[host] = gpu + 1
            built.append(
                Stage(
                    layer_start=a,
                    layer_end=b,
                    gpu_type="A100-40",
                    tensor_parallel=1,
                    devices=(Device(host=host, gpu=gpu),),
                )
            )
        pipelines.append(Pipeline(num_microbatches=2, stages=tuple(built)))
    return Plan(
        name=name,
        version=version,
        model_name="gpt-tiny",
        num_layers=8,
        training=TrainingSettings(
            global_batch_size=2 * len(pipelines), micro_batch_size=1, seq_len=64
        ),
        tensor_parallel=1,
        pipelines=tuple(pipelines),
    )


# The writer: 2 pipelines x 2 stages; ranks 0,1 on h0 (layers 0-4, 4-8), ranks 2,3 on h1.
WRITER = plan("lab", 1, [[("h0", 0, 4), ("h0", 4, 8)], [("h1", 0, 4), ("h1", 4, 8)]])


def manifest(
    sizes: Sequence[int] = (40 * MB, 30 * MB, 20 * MB, 10 * MB),
    hosts: Sequence[str] = ("h0", "h0", "h1", "h1"),
) -> Manifest:
    files: list[dict[str, Any]] = [
        {"path": f"__{r}_0.distcp", "sha256": sha(f"f{r}"), "bytes": n, "host": hosts[r], "rank": r}
        for r, n in enumerate(sizes)
    ]
    files.append(
        {"path": ".metadata", "sha256": sha("meta"), "bytes": 1000, "host": "h0", "rank": 0}
    )
    return parse_manifest(
        {
            "schema": "autohet.checkpoint/v1",
            "step": 40,
            "plan": "lab.v1",
            "plan_sha256": sha("plan"),
            "world_size": len(sizes),
            "files": files,
        },
        "manifest.json",
    )


def holding(m: Manifest, *paths: str, markers: bool = False) -> dict[str, str]:
    """A host's verified files: the given manifest files with their right hashes."""
    out = {p: m.file(p).sha256 for p in paths}
    if markers:
        out |= {MANIFEST: "x", COMPLETE: ""}
    return out


def as_written(m: Manifest) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for f in m.files:
        out.setdefault(f.host, {})[f.path] = f.sha256
    return out


def applied(
    tp: TransferPlan, present: Mapping[str, Mapping[str, str]]
) -> dict[str, dict[str, str]]:
    """The listings after the executor carried out ``tp`` (files + markers)."""
    after = {h: dict(v) for h, v in present.items()}
    for item in tp.items:
        after.setdefault(item.dest_host, {})[item.file] = item.sha256
    for h in tp.finalize_hosts:
        after.setdefault(h, {}).update({MANIFEST: "x", COMPLETE: ""})
    return after


ALL = ("__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", ".metadata")


def test_files_already_in_place_produce_no_transfer() -> None:
    m = manifest()
    c = cluster(["h0", "h1"])
    present = {"h0": holding(m, *ALL, markers=True), "h1": holding(m, *ALL, markers=True)}
    tp = plan_transfers(m, WRITER, c, present, remote_root=REMOTE_ROOT)
    assert tp.items == ()
    assert set(tp.in_place) == {(h, f) for h in ("h0", "h1") for f in ALL}
    assert tp.finalize_hosts == ()
    assert tp.bytes_from_peers == tp.bytes_from_remote == 0
    assert tp.predicted_time_s == 0.0


def test_peers_serve_before_remote_and_plan_is_idempotent() -> None:
    m = manifest()
    c = cluster(["h0", "h1", "h2"])
    new = plan("lab", 2, [[("h0", 0, 8)], [("h2", 0, 8)]])  # h1 lost, h2 new
    present = as_written(m)
    present["h0"] |= {MANIFEST: "x", COMPLETE: ""}
    del present["h1"]
    # h1's files survive nowhere else; the remote copy has everything.
    tp = plan_transfers(m, new, c, present, remote_root=REMOTE_ROOT, lost=["h1"])
    by = {(i.dest_host, i.file): i for i in tp.items}
    # h2 gets h0's files from the peer h0, h1's files from remote storage.
    assert by[("h2", "__0_0.distcp")].source.kind == "peer"
    assert by[("h2", "__0_0.distcp")].source.host == "h0"
    assert by[("h2", ".metadata")].source.host == "h0"
    for f in ("__2_0.distcp", "__3_0.distcp"):
        assert by[("h2", f)].source.kind == "remote"
        assert by[("h0", f)].source.kind == "remote"
        assert by[("h2", f)].source.path == f"{REMOTE_ROOT}/lab/step-00000040/{f}"
        assert by[("h2", f)].fallbacks == ()
    # Fallbacks end with remote storage.
    assert [s.kind for s in by[("h2", "__0_0.distcp")].fallbacks] == ["remote"]
    assert by[("h2", "__0_0.distcp")].dest_path == "/ck/h2/lab/step-00000040/__0_0.distcp"
    assert by[("h2", "__0_0.distcp")].source.path == "/ck/h0/lab/step-00000040/__0_0.distcp"
    assert set(tp.in_place) == {("h0", "__0_0.distcp"), ("h0", "__1_0.distcp"), ("h0", ".metadata")}
    assert tp.finalize_hosts == ("h2",)
    assert tp.bytes_from_remote == 2 * (20 + 10) * MB
    assert tp.bytes_from_peers == 40 * MB + 30 * MB + 1000
    # Rerun after the transfers: nothing left to do.
    again = plan_transfers(m, new, c, applied(tp, present), remote_root=REMOTE_ROOT, lost=["h1"])
    assert again.items == () and again.finalize_hosts == ()


def test_remote_only_for_files_whose_every_copy_was_lost() -> None:
    m = manifest()
    c = cluster(["h0", "h1", "h2", "h3"])
    # h1 lost; h3 had received a copy of rank 2's file earlier (say, a previous recovery).
    present = as_written(m)
    present["h3"] = holding(m, "__2_0.distcp")
    new = plan("lab", 2, [[("h0", 0, 4), ("h2", 4, 8)], [("h3", 0, 4), ("h3", 4, 8)]])
    tp = plan_transfers(m, new, c, present, remote_root=REMOTE_ROOT, lost=["h1"])
    survivors = {h for h in present if h != "h1"}
    remote_files = {i.file for i in tp.items if i.source.kind == "remote"}
    assert remote_files == {"__3_0.distcp"}
    for item in tp.items:
        holders = {h for h in survivors if present[h].get(item.file) == item.sha256}
        if item.source.kind == "remote":
            assert not holders, f"{item.file} came from remote though {holders} hold it"
        else:
            assert item.source.host in holders
            assert item.source.host != "h1"


def test_lost_hosts_never_serve_even_if_listed() -> None:
    m = manifest()
    c = cluster(["h0", "h1", "h2"])
    present = as_written(m)  # h1's listing from before it died is still there
    new = plan("lab", 2, [[("h0", 0, 8)], [("h2", 0, 8)]])
    tp = plan_transfers(m, new, c, present, remote_root=REMOTE_ROOT, lost=["h1"])
    assert all(i.source.host != "h1" for i in tp.items)
    assert not any(s.host == "h1" for i in tp.items for s in i.fallbacks)


def test_files_lost_everywhere_are_an_error_naming_them() -> None:
    m = manifest()
    c = cluster(["h0", "h1", "h2"])
    present = as_written(m)
    del present["h1"]
    new = plan("lab", 2, [[("h0", 0, 8)], [("h2", 0, 8)]])
    remote_has = [
        "__0_0.distcp",
        "__1_0.distcp",
        ".metadata",
        "__2_0.distcp",
    ]  # rank 3 never uploaded
    with pytest.raises(RecoveryError, match=r"every copy of __3_0.distcp \(written on h1\)"):
        plan_transfers(
            m, new, c, present, remote_root=REMOTE_ROOT, remote_files=remote_has, lost=["h1"]
        )


def test_a_copy_with_the_wrong_hash_is_neither_in_place_nor_a_source() -> None:
    m = manifest()
    c = cluster(["h0", "h1", "h2"])
    present = as_written(m)
    present["h1"]["__2_0.distcp"] = sha("torn write")
    present["h2"] = {"__0_0.distcp": sha("stale")}
    new = plan("lab", 2, [[("h1", 0, 8)], [("h2", 0, 8)]])
    tp = plan_transfers(m, new, c, present, remote_root=REMOTE_ROOT)
    by = {(i.dest_host, i.file): i for i in tp.items}
    assert ("h1", "__2_0.distcp") in by  # replaced at h1
    assert by[("h1", "__2_0.distcp")].source.kind == "remote"  # nobody has a good copy
    assert by[("h2", "__0_0.distcp")].source.host == "h0"  # the stale copy is replaced
    assert by[("h2", "__2_0.distcp")].source.kind == "remote"


def test_load_is_spread_over_peers() -> None:
    # Two survivors hold every file; two new hosts need all of them.
    m = manifest(sizes=(10 * MB,) * 4)
    c = cluster(["h0", "h1", "h2", "h3"])
    full = holding(m, *ALL, markers=True)
    present = {"h0": dict(full), "h1": dict(full)}
    new = plan("lab", 2, [[("h2", 0, 8)], [("h3", 0, 8)]])
    tp = plan_transfers(m, new, c, present, remote_root=REMOTE_ROOT)
    assert tp.bytes_from_remote == 0
    per_source: dict[str, int] = {}
    for i in tp.items:
        assert i.source.host is not None
        per_source[i.source.host] = per_source.get(i.source.host, 0) + i.num_bytes
    assert set(per_source) == {"h0", "h1"}
    assert abs(per_source["h0"] - per_source["h1"]) <= 10 * MB  # within one file
    # Each source serves one destination at full speed, in parallel.
    for dest in ("h2", "h3"):
        assert len({i.source.host for i in tp.items_for(dest)}) == 1
    # Balanced pipes: the predicted time is about half of one source doing it all.
    one_source = 2 * (4 * 10 * MB + 1000) * 8 / 100e9
    assert tp.predicted_time_s == pytest.approx(one_source / 2, rel=0.15)


def test_one_destination_draws_from_every_peer() -> None:
    m = manifest(sizes=(10 * MB,) * 4)
    c = cluster(["h0", "h1", "h2", "h3"])
    full = holding(m, *ALL, markers=True)
    present = {"h0": dict(full), "h1": dict(full), "h3": dict(full)}
    new = plan("lab", 2, [[("h2", 0, 8)]])
    tp = plan_transfers(m, new, c, present, remote_root=REMOTE_ROOT)
    counts: dict[str | None, int] = {}
    for i in tp.items:
        if i.file != ".metadata":
            counts[i.source.host] = counts.get(i.source.host, 0) + 1
    assert sorted(counts.values()) == [1, 1, 2]


def test_fastest_link_is_chosen_and_fallbacks_follow_link_speed() -> None:
    m = manifest()
    c = cluster(["h0", "h1", "h2"], pairs={("h1", "h2"): 400.0, ("h0", "h2"): 25.0})
    full = holding(m, *ALL, markers=True)
    present = {"h0": dict(full), "h1": dict(full)}
    new = plan("lab", 2, [[("h2", 0, 8)]])
    tp = plan_transfers(m, new, c, present, remote_root=REMOTE_ROOT, remote_gbps=50.0)
    big = next(i for i in tp.items if i.file == "__0_0.distcp")
    assert big.source.host == "h1"
    assert big.source.gbps == 400.0
    assert [(s.kind, s.host, s.gbps) for s in big.fallbacks] == [
        ("peer", "h0", 25.0),
        ("remote", None, 50.0),  # remote last even when faster than a peer
    ]
    assert big.predicted_s == pytest.approx(40 * MB * 8 / 400e9)
    # The 400 Gbit/s peer takes everything: 8x faster than h0, so it stays ahead.
    assert {i.source.host for i in tp.items} == {"h1"}
    assert tp.predicted_s_by_source["h1"] == pytest.approx(sum(i.predicted_s for i in tp.items))


def test_a_host_on_the_same_machine_is_preferred() -> None:
    m = manifest()
    # h2 and h3 are two entries for one machine (two GPU sets, two checkpoint dirs).
    c = cluster(
        ["h0", "h1", "h2", "h3"],
        pairs={("h0", "h2"): 400.0},
        addresses={"h2": "10.0.0.9", "h3": "10.0.0.9"},
    )
    full = holding(m, *ALL, markers=True)
    present = {"h0": dict(full), "h3": dict(full)}
    new = plan("lab", 2, [[("h2", 0, 8)]])
    tp = plan_transfers(m, new, c, present, remote_root=REMOTE_ROOT)
    assert {(i.source.kind, i.source.host) for i in tp.items} == {("local", "h3")}
    assert tp.items[0].fallbacks[0].host == "h0"
    assert tp.bytes_from_peers == m.num_bytes


def test_new_plan_hosts_must_be_in_the_cluster() -> None:
    m = manifest()
    with pytest.raises(RecoveryError, match="not in the cluster"):
        plan_transfers(
            m, plan("lab", 2, [[("hx", 0, 8)]]), cluster(["h0"]), {}, remote_root=REMOTE_ROOT
        )


def test_transfer_plan_to_dict_is_json() -> None:
    m = manifest()
    c = cluster(["h0", "h1", "h2"])
    new = plan("lab", 2, [[("h0", 0, 8)], [("h2", 0, 8)]])
    present = as_written(m)
    del present["h1"]
    tp = plan_transfers(m, new, c, present, remote_root=REMOTE_ROOT, lost=["h1"])
    d = json.loads(json.dumps(tp.to_dict()))
    assert d["step"] == 40 and d["plan"] == "lab"
    assert d["bytes_from_remote"] == tp.bytes_from_remote
    # No layer record in this manifest: every file moves, and the report says why.
    assert d["rule"] == "all" and d["bytes_skipped"] == 0 and d["skipped"] == []
    assert "does not record" in d["rule_reason"]
    assert d["items"][0].keys() >= {"file", "dest_host", "source", "bytes", "sha256", "fallbacks"}
    assert tp.step_dir == "step-00000040"
