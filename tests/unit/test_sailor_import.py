"""Sailor import, the profile artifact's round trip and strictness, and merging."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from autohet_cli.catalog import CATALOG
from autohet_cli.errors import ConfigError, ProfileError, UnknownNameError
from autohet_cli.models import get_model
from autohet_cli.profiling.sailor import import_sailor
from autohet_cli.profiling.schema import (
    DeviceFacts,
    EntryKey,
    LayerTiming,
    Profile,
    ProfileEntry,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)
from autohet_cli.profiling.store import find_entry, load_profiles, merge_profiles, tp_mbs_pairs

SHIPPED = Path(__file__).resolve().parents[2] / "profiles" / "sailor"
# zoo name -> (Sailor's name, GPU types left out of the import)
MODELS = {
    "OPT-350M": ("OPT-350", ()),
    # Sailor's GPT-Neo-2.7/GH-96/profile.json is a copy of OPT-350's (26 layers, not 34).
    "GPT-Neo-2.7B": ("GPT-Neo-2.7", ("GH-96",)),
    "LLaMA-3-8B": ("LLAMA-3-8", ()),
    "OPT-30B": ("OPT-30", ()),
}
GPU_DIRS = {"A100-40", "A100-80", "GH-96", "V100-16", "RTX-3090", "RTX-2080", "Titan-RTX"}


@pytest.fixture(scope="module")
def imported(sailor_root: Path) -> dict[str, Profile]:
    return {
        name: import_sailor(sailor_root, sailor_name, skip_gpus=skip)
        for name, (sailor_name, skip) in MODELS.items()
    }


def _source_files(root: Path, model: str) -> dict[str, Any]:
    sailor_name, skip = MODELS[model]
    return {
        d.name: json.loads((d / "profile.json").read_text())
        for d in sorted((root / "profiles" / sailor_name).iterdir())
        if d.name not in skip
    }


# --- import: values -------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_times_reproduce_the_source_exactly(
    sailor_root: Path, imported: dict[str, Profile], model: str
) -> None:
    profile = imported[model]
    num_checked = 0
    for gpu, by_mbs in _source_files(sailor_root, model).items():
        for mbs, by_tp in by_mbs.items():
            for tp, by_layer in by_tp.items():
                key = EntryKey(
                    model=model,
                    gpu_type=gpu,
                    tensor_parallel=int(tp),
                    micro_batch_size=int(mbs),
                    seq_len=2048,
                )
                entry = find_entry(profile, key)
                for i, lt in enumerate(entry.layers):
                    fwd, bwd, upd = by_layer[str(i)]
                    for got_ms, want_s in ((lt.fwd_ms, fwd), (lt.bwd_ms, bwd), (lt.update_ms, upd)):
                        assert math.isclose(got_ms / 1000, want_s, rel_tol=1e-12, abs_tol=0.0)
                num_checked += 1
    assert num_checked == len(profile.entries)


@pytest.mark.parametrize("model", MODELS)
def test_every_entry_has_the_zoo_layer_count(imported: dict[str, Profile], model: str) -> None:
    num_layers = get_model(model).num_layers
    entries = imported[model].entries.values()
    assert entries
    assert {len(e.layers) for e in entries} == {num_layers}
    assert {(e.source, e.dtype, e.key.seq_len, e.key.model) for e in entries} == {
        ("sailor", "bf16", 2048, model)
    }


def test_layer_counts_match_the_readme() -> None:
    assert [get_model(m).num_layers for m in MODELS] == [26, 34, 35, 50]


@pytest.mark.parametrize("model", MODELS)
def test_sizes_follow_llm_info_and_scale_with_mbs(
    sailor_root: Path, imported: dict[str, Profile], model: str
) -> None:
    info = json.loads((sailor_root / "llm_info.json").read_text())[MODELS[model][0]]
    for entry in imported[model].entries.values():
        tp, mbs = entry.key.tensor_parallel, entry.key.micro_batch_size
        if str(tp) not in info:
            continue  # extrapolated: see the test below
        for i, lt in enumerate(entry.layers):
            row = info[str(tp)][str(i)]
            assert lt.num_params == row["params_floats"]
            assert lt.act_bytes == row["act_mem_bytes"] * mbs
            assert lt.output_bytes == row["act_output_bytes"] * mbs


def test_params_do_not_depend_on_mbs_and_bytes_are_linear(imported: dict[str, Profile]) -> None:
    p = imported["OPT-350M"]
    for tp, mbs in tp_mbs_pairs(p, "OPT-350M", "GH-96"):
        one = find_entry(p, _key("OPT-350M", "GH-96", tp, 1))
        e = find_entry(p, _key("OPT-350M", "GH-96", tp, mbs))
        assert [lt.num_params for lt in e.layers] == [lt.num_params for lt in one.layers]
        assert [lt.act_bytes for lt in e.layers] == [lt.act_bytes * mbs for lt in one.layers]
        assert [lt.output_bytes for lt in e.layers] == [lt.output_bytes * mbs for lt in one.layers]


def test_devices_come_from_the_catalog(imported: dict[str, Profile]) -> None:
    devices = imported["OPT-350M"].devices
    assert set(devices) == GPU_DIRS
    for name, dev in devices.items():
        assert dev.source == "catalog"
        assert dev.mem_bytes == CATALOG[name].mem_bytes
        assert dev.matmul_tflops == CATALOG[name].peak_tflops
    assert set(imported["GPT-Neo-2.7B"].devices) == {"A100-40", "A100-80", "V100-16"}


def test_meta_says_where_numbers_came_from(sailor_root: Path, imported: dict[str, Profile]) -> None:
    meta = imported["LLaMA-3-8B"].meta
    assert meta["source"] == "sailor"
    assert meta["origin"] == "eth-easl/sailor cf2c8e3"
    assert meta["imported_from"] == str(sailor_root)
    assert meta["created"].endswith("+00:00")
    assert meta["dtype"] == "bf16"
    notes = " | ".join(meta["history"][-1]["notes"])
    assert "bf16" in notes
    assert "tp 8" in notes and "extrapolated" in notes  # LLaMA on V100-16 ran at tp 8
    assert "A100-40: update_ms is 0" in notes


def test_tp_missing_from_llm_info_is_extrapolated_accurately(
    sailor_root: Path, tmp_path: Path
) -> None:
    """Drop OPT-350's tp 8 sizes, which Sailor does list, and compare the estimate."""
    root = _copy_sailor(sailor_root, tmp_path, "OPT-350", ["V100-16"])
    info = json.loads((root / "llm_info.json").read_text())
    truth = info["OPT-350"].pop("8")
    (root / "llm_info.json").write_text(json.dumps(info))
    profile = import_sailor(root, "OPT-350M")
    entry = find_entry(profile, _key("OPT-350M", "V100-16", 8, 2))
    for i, lt in enumerate(entry.layers):
        row = truth[str(i)]
        assert lt.num_params == row["params_floats"]
        assert lt.output_bytes == row["act_output_bytes"] * 2
        assert lt.act_bytes == pytest.approx(row["act_mem_bytes"] * 2, rel=0.02)
    assert any("tp 8" in n for n in profile.meta["history"][-1]["notes"])


def test_zoo_and_sailor_spellings_give_the_same_entries(sailor_root: Path) -> None:
    a = import_sailor(sailor_root, "LLAMA-3-8")
    b = import_sailor(sailor_root, "llama-3-8b")
    assert a.entries == b.entries


@pytest.mark.parametrize("model", MODELS)
def test_shipped_profiles_match_a_fresh_import(imported: dict[str, Profile], model: str) -> None:
    path = SHIPPED / f"{model}.yaml"
    assert path.stat().st_size < 2_000_000
    shipped = load_profile(path)
    assert shipped.entries == imported[model].entries
    assert shipped.devices == imported[model].devices
    assert shipped.meta["source"] == "sailor"


# --- import: errors -------------------------------------------------------------------------


def test_mislabelled_file_is_refused_naming_it(sailor_root: Path) -> None:
    with pytest.raises(ConfigError) as err:
        import_sailor(sailor_root, "GPT-Neo-2.7B")
    msg = str(err.value)
    assert str(sailor_root / "profiles" / "GPT-Neo-2.7" / "GH-96" / "profile.json") in msg
    assert "26 layers" in msg and "34" in msg and "--skip-gpu GH-96" in msg


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nowhere/profiles: no such directory.*llm_info"):
        import_sailor(tmp_path / "nowhere", "OPT-350M")


def test_model_not_in_the_data_lists_what_is(sailor_root: Path) -> None:
    with pytest.raises(ConfigError) as err:
        import_sailor(sailor_root, "LLaMA-2-7B")
    msg = str(err.value)
    assert "no measurements of LLaMA-2-7B" in msg
    assert "OPT-350 (= OPT-350M)" in msg and "LLAMA-3-8 (= LLaMA-3-8B)" in msg


def test_unknown_model_name(sailor_root: Path) -> None:
    with pytest.raises(UnknownNameError, match="unknown model"):
        import_sailor(sailor_root, "Bloom-176")


def test_malformed_json_names_the_file(sailor_root: Path, tmp_path: Path) -> None:
    root = _copy_sailor(sailor_root, tmp_path, "LLAMA-3-8", ["GH-96"])
    bad = root / "profiles" / "LLAMA-3-8" / "GH-96" / "profile.json"
    bad.write_text(bad.read_text()[:-20])
    with pytest.raises(ConfigError, match=rf"{bad} \(line \d+\): not valid JSON"):
        import_sailor(root, "LLaMA-3-8B")


def test_bad_values_name_the_layer(sailor_root: Path, tmp_path: Path) -> None:
    root = _copy_sailor(sailor_root, tmp_path, "LLAMA-3-8", ["GH-96"])
    path = root / "profiles" / "LLAMA-3-8" / "GH-96" / "profile.json"
    data = json.loads(path.read_text())
    data["1"]["2"]["7"] = [0.1, -0.2, 0.0]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"mbs 1, tp 2, layer 7: times must be finite"):
        import_sailor(root, "LLaMA-3-8B")


def test_missing_llm_info(sailor_root: Path, tmp_path: Path) -> None:
    root = _copy_sailor(sailor_root, tmp_path, "LLAMA-3-8", ["GH-96"])
    (root / "llm_info.json").unlink()
    with pytest.raises(ConfigError, match=r"llm_info.json: file not found"):
        import_sailor(root, "LLaMA-3-8B")


def test_model_missing_from_llm_info(sailor_root: Path, tmp_path: Path) -> None:
    root = _copy_sailor(sailor_root, tmp_path, "LLAMA-3-8", ["GH-96"])
    info = json.loads((root / "llm_info.json").read_text())
    del info["LLAMA-3-8"]
    (root / "llm_info.json").write_text(json.dumps(info))
    with pytest.raises(ProfileError, match=r"llm_info.json: no sizes for LLaMA-3-8B"):
        import_sailor(root, "LLaMA-3-8B")


# --- the profile artifact -------------------------------------------------------------------


def test_dict_round_trip(imported: dict[str, Profile]) -> None:
    for profile in imported.values():
        assert profile_from_dict(profile_to_dict(profile), "mem") == profile


def test_file_round_trip(imported: dict[str, Profile], tmp_path: Path) -> None:
    path = save_profile(imported["LLaMA-3-8B"], tmp_path / "p.yaml")
    assert load_profile(path) == imported["LLaMA-3-8B"]
    with pytest.raises(ConfigError, match="already exists"):
        save_profile(imported["LLaMA-3-8B"], path)


@pytest.mark.parametrize(
    ("where", "field_name"),
    [
        (lambda d: d, "entrys"),
        (lambda d: d["devices"]["GH-96"], "mem_gb"),
        (lambda d: d["entries"][0], "tp"),
        (lambda d: d["entries"][0]["layers"][3], "fwd_mss"),
    ],
)
def test_unknown_keys_are_rejected_naming_the_field(
    imported: dict[str, Profile], where: Any, field_name: str
) -> None:
    d = copy.deepcopy(profile_to_dict(imported["LLaMA-3-8B"]))
    where(d)[field_name] = 1
    with pytest.raises(ConfigError, match=rf"unknown key '{field_name}'"):
        profile_from_dict(d, "p.yaml")


def test_error_names_the_position() -> None:
    d = profile_to_dict(_profile(_entry("A100-40", "measured", 1.0)))
    d["entries"][0]["layers"][0]["fwd_ms"] = "fast"
    with pytest.raises(ConfigError, match=r"p.yaml: entries\[0\].layers\[0\].fwd_ms"):
        profile_from_dict(d, "p.yaml")


# --- merging --------------------------------------------------------------------------------


def test_measured_beats_analytic_in_either_order() -> None:
    measured = _profile(_entry("V100-16", "measured", 5.0))
    analytic = _profile(_entry("V100-16", "analytic", 9.0))
    key = _key("m", "V100-16", 1, 1)
    assert _fwd(measured.merged_with(analytic), key) == 5.0
    assert _fwd(analytic.merged_with(measured), key) == 5.0
    assert _fwd(merge_profiles([measured, analytic]), key) == 5.0


def test_newer_beats_older_and_other_types_stay() -> None:
    old = _profile(_entry("V100-16", "sailor", 5.0), _entry("A100-40", "sailor", 2.0))
    new = _profile(_entry("V100-16", "measured", 4.0), _entry("RTX-3090", "measured", 3.0))
    merged = old.merged_with(new)
    assert _fwd(merged, _key("m", "V100-16", 1, 1)) == 4.0
    assert _fwd(merged, _key("m", "A100-40", 1, 1)) == 2.0
    assert _fwd(merged, _key("m", "RTX-3090", 1, 1)) == 3.0


def test_measured_device_facts_survive_catalog_ones() -> None:
    measured = Profile(devices={"T4": _device("T4", "measured", 50.0)})
    catalog = Profile(devices={"T4": _device("T4", "catalog", 65.0)})
    assert measured.merged_with(catalog).devices["T4"].matmul_tflops == 50.0
    assert catalog.merged_with(measured).devices["T4"].matmul_tflops == 50.0


def test_load_profiles_merges_files_in_order(tmp_path: Path) -> None:
    save_profile(_profile(_entry("V100-16", "sailor", 5.0)), tmp_path / "a" / "1.yaml")
    save_profile(_profile(_entry("V100-16", "measured", 4.0)), tmp_path / "a" / "2.yaml")
    save_profile(_profile(_entry("T4", "analytic", 8.0)), tmp_path / "b.yaml")
    merged = load_profiles([tmp_path / "a", tmp_path / "b.yaml"])
    assert _fwd(merged, _key("m", "V100-16", 1, 1)) == 4.0
    assert _fwd(merged, _key("m", "T4", 1, 1)) == 8.0
    (tmp_path / "empty").mkdir()
    with pytest.raises(ProfileError, match="no profile files"):
        load_profiles([tmp_path / "empty"])


def test_find_entry_lists_what_exists() -> None:
    p = _profile(_entry("V100-16", "sailor", 5.0))
    with pytest.raises(ProfileError, match=r"at tp 2, mbs 1.*profiled: tp 1 mbs 1"):
        find_entry(p, _key("m", "V100-16", 2, 1))


# --- helpers --------------------------------------------------------------------------------


def _key(model: str, gpu: str, tp: int, mbs: int) -> EntryKey:
    return EntryKey(
        model=model, gpu_type=gpu, tensor_parallel=tp, micro_batch_size=mbs, seq_len=2048
    )


def _entry(gpu: str, source: str, fwd_ms: float) -> ProfileEntry:
    layer = LayerTiming(
        fwd_ms=fwd_ms,
        bwd_ms=2 * fwd_ms,
        update_ms=0.5,
        num_params=10,
        act_bytes=1.0,
        output_bytes=1.0,
    )
    return ProfileEntry(key=_key("m", gpu, 1, 1), source=source, dtype="bf16", layers=(layer,))


def _profile(*entries: ProfileEntry) -> Profile:
    return Profile(entries={e.key: e for e in entries})


def _device(gpu: str, source: str, tflops: float) -> DeviceFacts:
    return DeviceFacts(
        gpu_type=gpu,
        mem_bytes=16 << 30,
        matmul_tflops=tflops,
        mem_bandwidth_gbytes_s=320.0,
        source=source,
    )


def _fwd(p: Profile, key: EntryKey) -> float:
    return find_entry(p, key).layers[0].fwd_ms


def _copy_sailor(root: Path, tmp_path: Path, model: str, gpus: list[str]) -> Path:
    """A small copy of the Sailor data: one model, some GPU types."""
    dst = tmp_path / "sailor"
    for gpu in gpus:
        shutil.copytree(root / "profiles" / model / gpu, dst / "profiles" / model / gpu)
    shutil.copy(root / "llm_info.json", dst / "llm_info.json")
    return dst
