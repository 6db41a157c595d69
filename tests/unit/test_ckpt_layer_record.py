"""The manifest's layer record (``layers``, ``shared``, ``tied_layers``): the schema
round-trips it, rejects bad values naming the field, still reads and verifies older
manifests, and the HMAC covers it; the writer's helpers compute it from DCP's
metadata and leave the shared entries to rank 0."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from autohet_cli.ckpt.files import CheckpointError
from autohet_cli.ckpt.format import (
    ManifestAuthError,
    mac_of,
    manifest_from_json,
    manifest_to_dict,
    parse_manifest,
    signed_manifest_text,
    verified_manifest,
)
from autohet_cli.ckpt.state import (
    entry_layer,
    keep_written,
    manifest_files,
    stored_layers,
    tied_layer_groups,
)
from autohet_cli.errors import ConfigError

KEY = b"k" * 32
SHA = "ab" * 32


def raw(record: bool = True) -> dict[str, Any]:
    files: list[dict[str, Any]] = [
        {"path": "__0_0.distcp", "sha256": SHA, "bytes": 10, "host": "a", "rank": 0},
        {"path": "__1_0.distcp", "sha256": SHA, "bytes": 20, "host": "b", "rank": 1},
        {"path": ".metadata", "sha256": SHA, "bytes": 3, "host": "a", "rank": 0},
    ]
    d: dict[str, Any] = {
        "schema": "autohet.checkpoint/v1",
        "step": 4,
        "plan": "lab.v1",
        "plan_sha256": SHA,
        "world_size": 2,
        "files": files,
    }
    if record:
        files[0] |= {"layers": [0, 1, 2], "shared": True}
        files[1] |= {"layers": [0, 3, 4, 5], "shared": False}
        d["tied_layers"] = [[0, 5]]
    return d


# --------------------------------------------------------------------- schema


def test_the_layer_record_round_trips_and_is_authenticated() -> None:
    m = parse_manifest(raw(), "m")
    assert m.file("__0_0.distcp").layers == (0, 1, 2) and m.file("__0_0.distcp").shared
    assert m.file("__1_0.distcp").layers == (0, 3, 4, 5)
    assert m.file("__1_0.distcp").shared is False
    assert m.file(".metadata").layers is None and m.file(".metadata").shared is None
    assert m.tied_layers == ((0, 5),)
    assert m.layer_info_missing() is None
    assert manifest_to_dict(m) == raw()
    text = signed_manifest_text(m, KEY)
    assert verified_manifest(text, KEY, "m") == m
    # The HMAC covers the record: moving a layer to another file breaks it.
    forged = json.loads(text)
    forged["files"][1]["layers"] = [3, 4, 5]
    with pytest.raises(ManifestAuthError, match="does not verify"):
        verified_manifest(json.dumps(forged), KEY, "m")
    forged = json.loads(text)
    forged["tied_layers"] = []
    with pytest.raises(ManifestAuthError, match="does not verify"):
        verified_manifest(json.dumps(forged), KEY, "m")


def test_an_older_manifest_without_the_record_still_reads_and_verifies() -> None:
    old = raw(record=False)
    text = json.dumps(old | {"hmac_sha256": mac_of(old, KEY)}, indent=2)
    m = verified_manifest(text, KEY, "old")
    assert m == manifest_from_json(text, "old")
    assert m.tied_layers is None and all(f.layers is None and f.shared is None for f in m.files)
    assert manifest_to_dict(m) == old  # written back without the fields it never had
    assert m.layer_info_missing() == "the manifest does not record tied_layers"
    partial = copy.deepcopy(old)
    partial["tied_layers"] = []
    partial["files"][0] |= {"layers": [0], "shared": True}
    assert parse_manifest(partial, "p").layer_info_missing() == (
        "the manifest does not record the layers of __1_0.distcp"
    )


def _edit(fn: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    d = raw()
    fn(d)
    return d


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["files"][0].update(layers="0,1"), r"files\[0\].layers: expected a list"),
        (
            lambda d: d["files"][0].update(layers=[0, "1"]),
            r"files\[0\].layers\[1\]: expected an int",
        ),
        (lambda d: d["files"][0].update(layers=[True]), r"files\[0\].layers\[0\]: expected an int"),
        (lambda d: d["files"][0].update(layers=[-1]), r"files\[0\].layers: .* must be >= 0"),
        (lambda d: d["files"][0].update(layers=[2, 1]), r"files\[0\].layers: .*distinct and asc"),
        (lambda d: d["files"][0].update(layers=[1, 1]), r"files\[0\].layers: .*distinct and asc"),
        (lambda d: d["files"][1].update(shared="no"), r"files\[1\].shared: expected true or false"),
        (lambda d: d["files"][1].update(shared=None), r"files\[1\].shared: expected true or false"),
        (lambda d: d["files"][1].pop("layers"), r"files\[1\].layers: missing"),
        (lambda d: d["files"][1].pop("shared"), r"files\[1\].shared: missing"),
        (lambda d: d["files"][2].update(layers=[0], shared=False), r"files\[2\]: only a DCP data"),
        (lambda d: d["files"][0].update(layer=[0]), r"files\[0\]: unknown key 'layer'"),
        (lambda d: d.update(tied_layers="0,5"), "tied_layers: expected a list"),
        (lambda d: d.update(tied_layers=[0, 5]), r"tied_layers\[0\]: expected a list"),
        (lambda d: d.update(tied_layers=[[0]]), r"tied_layers\[0\]: a tied group spans at least 2"),
        (lambda d: d.update(tied_layers=[[0, 5.0]]), r"tied_layers\[0\]\[1\]: expected an int"),
        (lambda d: d.update(tied_layer=[[0, 5]]), "unknown key 'tied_layer'"),
    ],
)
def test_bad_layer_records_are_refused_naming_the_field(
    edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_manifest(_edit(edit), "ck/manifest.json")


# --------------------------------------------------------------------- the writer's side


def _index(fqn: str, tensor: bool = True) -> MetadataIndex:
    return MetadataIndex(fqn, torch.Size([0]) if tensor else None, 0 if tensor else None)


def test_stored_layers_reads_where_dcp_put_each_entry() -> None:
    placed = {
        "model.layers.0.wte.weight": "__0_0.distcp",
        "model.layers.1.attn.weight": "__0_0.distcp",
        "optimizer.state.layers.0.wte.weight.exp_avg": "__1_0.distcp",  # tied: layer 0's name
        "optimizer.param_groups.layers.5.lm_head.weight.lr": "__1_0.distcp",
        "model.layers.5.lm_head.weight": "__2_0.distcp",
        "step": "__0_0.distcp",
        "run": "__0_0.distcp",
    }
    metadata = Metadata(
        state_dict_metadata={},
        planner_data={k: tuple(k.split(".", 1)) for k in placed},
        storage_data={
            _index(k, not k.startswith(("step", "run", "optimizer.param"))): _StorageInfo(f, 0, 1)
            for k, f in placed.items()
        },
    )
    assert stored_layers(metadata) == {
        "__0_0.distcp": ((0, 1), True),
        "__1_0.distcp": ((0, 5), False),
        "__2_0.distcp": ((5,), False),
    }
    metadata.planner_data = None  # without the planner's paths: split at the first dot
    assert stored_layers(metadata)["__1_0.distcp"] == ((0, 5), False)
    entries = [
        {"path": p, "sha256": SHA, "bytes": 1, "host": "a", "rank": r}
        for p, r in [("__0_0.distcp", 0), (".metadata", 0), ("__3_0.distcp", 3)]
    ]
    files = manifest_files(entries, stored_layers(metadata))
    assert [(f.path, f.layers, f.shared) for f in files] == [
        ("__0_0.distcp", (0, 1), True),
        (".metadata", None, None),
        ("__3_0.distcp", (), False),  # DCP put nothing there
    ]


def test_stored_layers_refuses_metadata_without_storage_data() -> None:
    """What ``dcp.save`` returns under torch 2.11 (no storage_data) is never read as
    "no file holds any layer": the writer reads the written .metadata instead."""
    with pytest.raises(CheckpointError, match=r"no storage_data .*\.metadata"):
        stored_layers(Metadata(state_dict_metadata={}, storage_data=None))


def test_entry_layer_and_tied_groups() -> None:
    assert entry_layer(("model", "layers.3.attn.weight")) == 3
    assert entry_layer(("optimizer", "state.layers.12.mlp.w.exp_avg")) == 12
    assert entry_layer(("optimizer", "param_groups.layers.2.w.lr")) == 2
    assert entry_layer(("model", "final_norm.weight")) is None
    assert entry_layer(("step",)) is None and entry_layer(("run",)) is None
    tied = [("layers.0.wte.weight", "layers.5.lm_head.weight"), ("layers.2.a", "layers.2.b")]
    assert tied_layer_groups(tied) == ((0, 5),)  # a group within one layer moves nothing


def test_only_rank_0_keeps_the_entries_of_no_layer() -> None:
    state = {
        "model": {"layers.1.w": 1, "final_norm.weight": 2},
        "optimizer": {"state.layers.1.w.exp_avg": 3, "state.final_norm.weight.exp_avg": 4},
        "step": 7,
        "loss_scale": None,
        "run": "{}",
    }
    everyone = keep_written(state, lambda layers: True, [])
    assert everyone == state
    other = keep_written(state, lambda layers: True, [], shared=False)
    assert other == {"model": {"layers.1.w": 1}, "optimizer": {"state.layers.1.w.exp_avg": 3}}
