"""Import the Sailor planner's measured per-layer profiles (pure).

Sailor (eth-easl/sailor, MIT) publishes, per model and GPU type,
``profiles/<MODEL>/<GPU>/profile.json`` = ``{mbs: {tp: {layer: [fwd_s, bwd_s,
update_s]}}}`` and, per model and TP degree, ``llm_info.json`` with each layer's
parameters per GPU and its activation and output sizes *per sample*. We turn
both into ``autohet.profile/v1`` entries with ``source: sailor``:

- times: seconds to milliseconds as ``round(s * 1000, 9)``, so ``ms / 1000``
  gives back the published value (Sailor's resolution is 1 microsecond);
- ``num_params`` = ``params_floats``; ``act_bytes`` / ``output_bytes`` =
  ``act_mem_bytes`` / ``act_output_bytes`` times the micro-batch size;
- a TP degree measured but missing from ``llm_info.json`` gets sizes
  extrapolated as ``x(tp) = whole + split / tp`` through the two largest TP
  degrees it has (exact for parameters and outputs where Sailor has the degree);
- model and GPU names become our canonical names (``OPT-350`` -> ``OPT-350M``);
- dtype ``bf16`` and sequence length 2048, those of Sailor's measurements.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from autohet_cli.catalog import CATALOG, canonical_gpu_name
from autohet_cli.errors import ConfigError, ProfileError, UnknownNameError
from autohet_cli.estimates.profile import (
    DeviceFacts,
    EntryKey,
    LayerTiming,
    Profile,
    ProfileEntry,
)
from autohet_cli.models import ZOO, ModelSpec, canonical_model_name
from autohet_cli.yamlio import as_list, as_mapping, coerce

ORIGIN = "eth-easl/sailor cf2c8e3"
SEQ_LEN = 2048
DTYPE = "bf16"
_INFO_KEYS = ("params_floats", "act_mem_bytes", "act_output_bytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class _LayerInfo:
    """One layer of ``llm_info.json`` at one TP degree (sizes per sample)."""

    num_params: int
    act_bytes_per_sample: float
    output_bytes_per_sample: float


def import_sailor(root: Path, model: str, *, skip_gpus: Iterable[str] = ()) -> Profile:
    """All of Sailor's measurements of ``model`` under ``root`` as one Profile.

    ``model`` may be our zoo name or Sailor's (``OPT-350``). ``skip_gpus`` leaves
    GPU types out, e.g. one whose file does not match the model.
    """
    spec = ZOO[canonical_model_name(model)]
    profiles_dir = root / "profiles"
    if not profiles_dir.is_dir():
        raise ConfigError(
            f"{profiles_dir}: no such directory; pass the Sailor data root, the directory "
            "holding profiles/<MODEL>/<GPU>/profile.json and llm_info.json"
        )
    model_dir = profiles_dir / _sailor_model_dir(profiles_dir, spec.name)
    info = _read_llm_info(root / "llm_info.json", spec)
    skip = {canonical_gpu_name(g) for g in skip_gpus}
    entries: list[ProfileEntry] = []
    notes = [
        f"dtype {DTYPE} and seq_len {SEQ_LEN} are those of Sailor's measurements; "
        "act_bytes and output_bytes are Sailor's byte counts (4 bytes per float) as published"
    ]
    for gpu_dir in sorted(p for p in model_dir.iterdir() if p.is_dir()):
        gpu = _gpu_name(gpu_dir)
        if gpu in skip:
            notes.append(f"{gpu}: skipped on request")
            continue
        gpu_entries = _import_gpu(gpu_dir / "profile.json", spec, gpu, info)
        notes += _zero_time_notes(gpu, gpu_entries)
        entries += gpu_entries
    if not entries:
        raise ProfileError(f"{model_dir}: no GPU type left to import (all skipped or none there)")
    notes += _derived_notes(spec, info, entries)
    devices = {e.key.gpu_type: _catalog_device(e.key.gpu_type) for e in entries}
    return Profile(
        devices=devices, entries={e.key: e for e in entries}, meta=_meta(root, spec.name, notes)
    )


def _meta(root: Path, model: str, notes: list[str]) -> dict[str, Any]:
    created = datetime.now(UTC).isoformat(timespec="seconds")
    return {
        "source": "sailor",
        "origin": ORIGIN,
        "imported_from": str(root),
        "created": created,
        "dtype": DTYPE,
        # Notes live in the history entry so that merged files keep every import's.
        "history": [
            {
                "import": "sailor",
                "model": model,
                "from": str(root),
                "created": created,
                "notes": notes,
            }
        ],
    }


def _sailor_model_dir(profiles_dir: Path, model: str) -> str:
    names = sorted(p.name for p in profiles_dir.iterdir() if p.is_dir())
    found = _sailor_key(names, model)
    if found is None:
        listed = ", ".join(_describe(n) for n in names) or "none"
        raise ConfigError(
            f"{profiles_dir}: no measurements of {model}; models measured here: {listed}"
        )
    return found


def _sailor_key(names: Iterable[str], model: str) -> str | None:
    """The Sailor spelling among ``names`` of zoo model ``model``."""
    for name in names:
        try:
            if canonical_model_name(name) == model:
                return name
        except UnknownNameError:
            continue
    return None


def _describe(sailor_name: str) -> str:
    try:
        return f"{sailor_name} (= {canonical_model_name(sailor_name)})"
    except UnknownNameError:
        return f"{sailor_name} (not in the zoo)"


def _gpu_name(gpu_dir: Path) -> str:
    try:
        return canonical_gpu_name(gpu_dir.name)
    except UnknownNameError as exc:
        raise ConfigError(f"{gpu_dir}: directory name is not a GPU type: {exc}") from None


def _catalog_device(gpu: str) -> DeviceFacts:
    spec = CATALOG[gpu]
    return DeviceFacts(
        gpu_type=gpu,
        mem_bytes=spec.mem_bytes,
        matmul_tflops=spec.peak_tflops,
        mem_bandwidth_gbytes_s=spec.mem_bandwidth_gbytes_s,
        source="catalog",
    )


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: file not found; is this a copy of Sailor's data (eth-easl/sailor)?"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; is this a copy of Sailor's data?") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} (line {exc.lineno}): not valid JSON: {exc.msg}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid JSON: nested too deeply") from None


def _int_key(key: str, at: str) -> int:
    try:
        value = int(key)
    except ValueError:
        raise ConfigError(f"{at}: key {key!r} is not a positive integer") from None
    if value < 1:
        raise ConfigError(f"{at}: key {key!r} is not a positive integer")
    return value


def _by_layer(raw: Any, at: str) -> list[Any]:
    """``{"0": x, "1": y, ...}`` as ``[x, y, ...]``, requiring layers 0..n-1."""
    d = as_mapping(raw, at)
    expected = [str(i) for i in range(len(d))]
    odd = sorted(set(d) - set(expected))
    if odd:
        raise ConfigError(f"{at}: layer keys must be 0..{len(d) - 1}; unexpected {odd[:5]}")
    return [d[k] for k in expected]


def _check_layers(n: int, spec: ModelSpec, at: str, remedy: str) -> None:
    if n != spec.num_layers:
        raise ConfigError(
            f"{at}: {n} layers, but {spec.name} has {spec.num_layers} partitionable layers; "
            f"these numbers are not {spec.name}'s ({remedy})"
        )


def _read_llm_info(path: Path, spec: ModelSpec) -> dict[int, tuple[_LayerInfo, ...]]:
    raw = as_mapping(_read_json(path), str(path))
    key = _sailor_key(raw, spec.name)
    if key is None:
        raise ProfileError(
            f"{path}: no sizes for {spec.name}; models listed: {', '.join(sorted(raw))}"
        )
    out = {}
    for tp_key, layers in as_mapping(raw[key], f"{path}: {key}").items():
        at = f"{path}: {key}.{tp_key}"
        rows = _by_layer(layers, at)
        _check_layers(len(rows), spec, at, "fix llm_info.json")
        out[_int_key(tp_key, at)] = tuple(_layer_info(r, f"{at}.{i}") for i, r in enumerate(rows))
    if not out:
        raise ProfileError(f"{path}: {key}: no TP degrees listed")
    return out


def _layer_info(raw: Any, at: str) -> _LayerInfo:
    d = as_mapping(raw, at)
    missing = [k for k in _INFO_KEYS if k not in d]
    if missing:
        raise ConfigError(f"{at}: missing {', '.join(missing)}")
    return _LayerInfo(
        num_params=coerce(d["params_floats"], int, f"{at}.params_floats"),
        act_bytes_per_sample=coerce(d["act_mem_bytes"], float, f"{at}.act_mem_bytes"),
        output_bytes_per_sample=coerce(d["act_output_bytes"], float, f"{at}.act_output_bytes"),
    )


def _info_at(info: Mapping[int, tuple[_LayerInfo, ...]], tp: int) -> tuple[_LayerInfo, ...]:
    """Sizes at ``tp``: as listed, else ``whole + split / tp`` through the two largest
    listed degrees (through zero with only one), rounded up."""
    if tp in info:
        return info[tp]
    degrees = sorted(info)[-2:]
    if len(degrees) == 1:
        degrees = [degrees[0], degrees[0]]

    def fit(x1: float, x2: float) -> int:
        t1, t2 = degrees
        split = (x1 - x2) / (1 / t1 - 1 / t2) if t1 != t2 else x2 * t2
        whole = x2 - split / t2
        return max(0, math.ceil(whole + split / tp))

    return tuple(
        _LayerInfo(
            num_params=fit(a.num_params, b.num_params),
            act_bytes_per_sample=float(fit(a.act_bytes_per_sample, b.act_bytes_per_sample)),
            output_bytes_per_sample=float(
                fit(a.output_bytes_per_sample, b.output_bytes_per_sample)
            ),
        )
        for a, b in zip(info[degrees[0]], info[degrees[1]], strict=True)
    )


def _import_gpu(
    path: Path, spec: ModelSpec, gpu: str, info: Mapping[int, tuple[_LayerInfo, ...]]
) -> list[ProfileEntry]:
    raw = as_mapping(_read_json(path), str(path))
    entries = []
    for mbs_key, by_tp in raw.items():
        mbs = _int_key(mbs_key, str(path))
        for tp_key, by_layer in as_mapping(by_tp, f"{path}: mbs {mbs_key}").items():
            at = f"{path}: mbs {mbs_key}, tp {tp_key}"
            tp = _int_key(tp_key, at)
            times = [_times(t, f"{at}, layer {i}") for i, t in enumerate(_by_layer(by_layer, at))]
            _check_layers(
                len(times), spec, at, f"fix the file, or leave {gpu} out with --skip-gpu {gpu}"
            )
            entries.append(_entry(spec.name, gpu, tp, mbs, times, _info_at(info, tp)))
    return entries


def _times(raw: Any, at: str) -> tuple[float, float, float]:
    values = as_list(raw, at)
    if len(values) != 3:
        raise ConfigError(f"{at}: expected [fwd_s, bwd_s, update_s], got {len(values)} values")
    fwd, bwd, upd = (coerce(v, float, at) for v in values)
    if min(fwd, bwd, upd) < 0 or not all(math.isfinite(x) for x in (fwd, bwd, upd)):
        raise ConfigError(f"{at}: times must be finite and not negative, got {values}")
    return fwd, bwd, upd


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 9)


def _entry(
    model: str,
    gpu: str,
    tp: int,
    mbs: int,
    times: list[tuple[float, float, float]],
    info: tuple[_LayerInfo, ...],
) -> ProfileEntry:
    layers = tuple(
        LayerTiming(
            fwd_ms=_ms(fwd),
            bwd_ms=_ms(bwd),
            update_ms=_ms(upd),
            num_params=li.num_params,
            act_bytes=li.act_bytes_per_sample * mbs,
            output_bytes=li.output_bytes_per_sample * mbs,
        )
        for (fwd, bwd, upd), li in zip(times, info, strict=True)
    )
    key = EntryKey(
        model=model, gpu_type=gpu, tensor_parallel=tp, micro_batch_size=mbs, seq_len=SEQ_LEN
    )
    return ProfileEntry(key=key, source="sailor", dtype=DTYPE, layers=layers)


def _zero_time_notes(gpu: str, entries: list[ProfileEntry]) -> list[str]:
    notes = []
    no_update = sum(all(lt.update_ms == 0 for lt in e.layers) for e in entries)
    if no_update:
        notes.append(
            f"{gpu}: update_ms is 0 in every layer of {no_update} of {len(entries)} "
            "(tp, mbs) entries: Sailor did not time the optimizer step there"
        )
    zero_bwd = sorted({i for e in entries for i, lt in enumerate(e.layers) if lt.bwd_ms == 0})
    if zero_bwd:
        notes.append(f"{gpu}: bwd_ms is 0 for layer(s) {zero_bwd} in some entries, as published")
    return notes


def _derived_notes(
    spec: ModelSpec, info: Mapping[int, tuple[_LayerInfo, ...]], entries: list[ProfileEntry]
) -> list[str]:
    derived = sorted({e.key.tensor_parallel for e in entries} - set(info))
    if not derived:
        return []
    basis = " and ".join(str(t) for t in sorted(info)[-2:])
    return [
        f"tp {', '.join(map(str, derived))}: llm_info.json lists no sizes for {spec.name} at "
        f"this degree; num_params, act_bytes and output_bytes are extrapolated as "
        f"whole + split / tp through tp {basis}"
    ]
