"""The ``autohet.profile/v1`` artifact as YAML: to and from plain data, files (pure).

Reading checks what the types cannot: keys known and required, counts within the
limits of ``limits.py``, times not negative, recomputation times both or neither,
one entry per key; anything else is a ``ConfigError`` naming where it is. Writing
is sorted, so one profile always gives the same text. Split from
``estimates.profile`` (the types and their merging) by responsibility.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from autohet_cli.errors import ConfigError
from autohet_cli.estimates.profile import (
    SCHEMA,
    SOURCES,
    DeviceFacts,
    EntryKey,
    LayerTiming,
    Overhead,
    Profile,
    ProfileEntry,
)
from autohet_cli.limits import MAX_GLOBAL_BATCH, MAX_SEQ_LEN, MAX_TENSOR_PARALLEL
from autohet_cli.yamlio import (
    as_list,
    as_mapping,
    check_keys,
    coerce,
    dump_yaml,
    load_yaml,
    write_new,
    write_replace,
)
from autohet_cli.yamlio import field as get

T = TypeVar("T", int, float)
_LAYER_KEYS = ("fwd_ms", "bwd_ms", "update_ms", "num_params", "act_bytes", "output_bytes")
_RECOMPUTE_KEYS = ("recompute_fwd_ms", "recompute_bwd_ms")  # optional, both or neither


def profile_to_dict(p: Profile) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "meta": dict(p.meta),
        "devices": {
            name: {
                "mem_bytes": d.mem_bytes,
                "matmul_tflops": d.matmul_tflops,
                "mem_bandwidth_gbytes_s": d.mem_bandwidth_gbytes_s,
                "source": d.source,
                **(
                    {
                        "allreduce_hop_ms": d.allreduce_hop_ms,
                        "allreduce_gbytes_s": d.allreduce_gbytes_s,
                    }
                    if d.allreduce_gbytes_s is not None
                    else {}
                ),
                **({"op_us": d.op_us} if d.op_us is not None else {}),
                **({"step_ms": d.step_ms} if d.step_ms is not None else {}),
            }
            for name, d in sorted(p.devices.items())
        },
        "entries": [_entry_to_dict(p.entries[k]) for k in sorted(p.entries, key=entry_order)],
        **(
            {
                "overheads": {
                    name: {
                        "step_ms": o.step_ms,
                        "mem_bytes": o.mem_bytes,
                        "sync_x": o.sync_x,
                        **({"shard_x": o.shard_x} if o.shard_x != 1.0 else {}),
                        "p2p_ms": o.p2p_ms,
                        "source": o.source,
                        "runs": o.runs,
                        **(
                            {"tp_step_ms": dict(sorted(o.tp_step_ms.items()))}
                            if o.tp_step_ms
                            else {}
                        ),
                    }
                    for name, o in sorted(p.overheads.items())
                }
            }
            if p.overheads
            else {}
        ),
    }


def entry_order(k: EntryKey) -> tuple[str, str, int, int, int]:
    """The order entries are written and listed in: model, GPU type, TP, mbs, seq_len."""
    return (k.model, k.gpu_type, k.tensor_parallel, k.micro_batch_size, k.seq_len)


def entry_header(e: ProfileEntry) -> dict[str, Any]:
    """An entry's key, source and dtype as plain data: the head of its YAML form here
    and of its line in ``autohet profile show`` (``profiling.store.entry_totals``)."""
    k = e.key
    return {
        "model": k.model,
        "gpu_type": k.gpu_type,
        "tensor_parallel": k.tensor_parallel,
        "micro_batch_size": k.micro_batch_size,
        "seq_len": k.seq_len,
        "source": e.source,
        "dtype": e.dtype,
    }


def _entry_to_dict(e: ProfileEntry) -> dict[str, Any]:
    return {**entry_header(e), "layers": [_layer_to_dict(lt) for lt in e.layers]}


def _layer_to_dict(lt: LayerTiming) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(lt, name) for name in _LAYER_KEYS}
    if lt.recompute_fwd_ms is not None and lt.recompute_bwd_ms is not None:
        out.update(recompute_fwd_ms=lt.recompute_fwd_ms, recompute_bwd_ms=lt.recompute_bwd_ms)
    return out


def profile_from_dict(raw: Any, where: str) -> Profile:
    d = as_mapping(raw, where)
    check_keys(d, where, ["schema"], ["meta", "devices", "entries", "overheads"])
    if d["schema"] != SCHEMA:
        raise ConfigError(f"{where}: schema: expected {SCHEMA!r}, got {d['schema']!r}")
    devices = {}
    for name, dv in as_mapping(d.get("devices") or {}, f"{where}: devices").items():
        at = f"{where}: devices.{name}"
        dm = as_mapping(dv, at)
        check_keys(
            dm,
            at,
            ["mem_bytes", "matmul_tflops", "mem_bandwidth_gbytes_s"],
            ["source", "allreduce_hop_ms", "allreduce_gbytes_s", "op_us", "step_ms"],
        )
        hop = get(dm, "allreduce_hop_ms", float, at, None)
        rate = get(dm, "allreduce_gbytes_s", float, at, None)
        if (hop is None) != (rate is None) or (rate is not None and (rate <= 0 or hop < 0)):
            raise ConfigError(
                f"{at}: allreduce_hop_ms (>= 0) and allreduce_gbytes_s (> 0) go together"
            )
        devices[str(name)] = DeviceFacts(
            gpu_type=str(name),
            mem_bytes=_positive(dm, "mem_bytes", int, at),
            matmul_tflops=_positive(dm, "matmul_tflops", float, at),
            mem_bandwidth_gbytes_s=_positive(dm, "mem_bandwidth_gbytes_s", float, at),
            source=get(dm, "source", str, at, "measured"),
            allreduce_hop_ms=hop,
            allreduce_gbytes_s=rate,
            op_us=_not_negative(dm, "op_us", at),
            step_ms=_not_negative(dm, "step_ms", at),
        )
    entries = {}
    for i, ev in enumerate(as_list(d.get("entries") or [], f"{where}: entries")):
        entry = _entry_from_dict(ev, f"{where}: entries[{i}]")
        if entry.key in entries:
            raise ConfigError(f"{where}: entries[{i}]: duplicate entry for {entry.key}")
        entries[entry.key] = entry
    meta = as_mapping(d.get("meta") or {}, f"{where}: meta")
    overheads = {}
    for name, ov in as_mapping(d.get("overheads") or {}, f"{where}: overheads").items():
        at = f"{where}: overheads.{name}"
        om = as_mapping(ov, at)
        check_keys(
            om,
            at,
            [],
            ["step_ms", "mem_bytes", "sync_x", "shard_x", "p2p_ms", "source", "runs", "tp_step_ms"],
        )
        tp_step = {}
        for tp, ms in as_mapping(om.get("tp_step_ms") or {}, f"{at}.tp_step_ms").items():
            degree = coerce(tp, int, f"{at}.tp_step_ms")
            tp_step[degree] = coerce(ms, float, f"{at}.tp_step_ms.{tp}")
            if degree < 2 or tp_step[degree] < 0:
                raise ConfigError(
                    f"{at}.tp_step_ms: TP degrees >= 2 with times >= 0, got {tp}: {ms}"
                )
        o = Overhead(
            step_ms=get(om, "step_ms", float, at, 0.0),
            mem_bytes=get(om, "mem_bytes", int, at, 0),
            sync_x=get(om, "sync_x", float, at, 1.0),
            shard_x=get(om, "shard_x", float, at, 1.0),
            p2p_ms=get(om, "p2p_ms", float, at, 0.0),
            source=get(om, "source", str, at, "calibrated"),
            runs=get(om, "runs", int, at, 1),
            tp_step_ms=tp_step,
        )
        if (
            min(o.step_ms, o.mem_bytes, o.p2p_ms) < 0
            or o.runs < 1
            or not o.sync_x > 0
            or not o.shard_x > 0
        ):
            raise ConfigError(
                f"{at}: step_ms, mem_bytes and p2p_ms must be >= 0, sync_x and shard_x > 0, "
                "runs >= 1"
            )
        overheads[str(name)] = o
    return Profile(devices=devices, entries=entries, meta=dict(meta), overheads=overheads)


def _entry_from_dict(raw: Any, at: str) -> ProfileEntry:
    em = as_mapping(raw, at)
    check_keys(
        em,
        at,
        ["model", "gpu_type", "tensor_parallel", "micro_batch_size", "seq_len", "layers"],
        ["source", "dtype"],
    )
    layers = []
    for j, lv in enumerate(as_list(em["layers"], f"{at}.layers")):
        lat = f"{at}.layers[{j}]"
        lm = as_mapping(lv, lat)
        check_keys(lm, lat, _LAYER_KEYS, _RECOMPUTE_KEYS)
        given = [k for k in _RECOMPUTE_KEYS if k in lm]
        if len(given) == 1:
            raise ConfigError(
                f"{lat}: {given[0]} without {({*_RECOMPUTE_KEYS} - {given[0]}).pop()}: give "
                "both recomputation times or neither"
            )
        timing = LayerTiming(
            fwd_ms=get(lm, "fwd_ms", float, lat),
            bwd_ms=get(lm, "bwd_ms", float, lat),
            update_ms=get(lm, "update_ms", float, lat),
            num_params=get(lm, "num_params", int, lat),
            act_bytes=get(lm, "act_bytes", float, lat),
            output_bytes=get(lm, "output_bytes", float, lat),
            recompute_fwd_ms=get(lm, "recompute_fwd_ms", float, lat) if given else None,
            recompute_bwd_ms=get(lm, "recompute_bwd_ms", float, lat) if given else None,
        )
        for name in _LAYER_KEYS + (_RECOMPUTE_KEYS if given else ()):
            if getattr(timing, name) < 0:
                raise ConfigError(
                    f"{lat}.{name}: must not be negative, got {getattr(timing, name)}"
                )
        layers.append(timing)
    key = EntryKey(
        model=get(em, "model", str, at),
        gpu_type=get(em, "gpu_type", str, at),
        tensor_parallel=_count(em, "tensor_parallel", MAX_TENSOR_PARALLEL, at),
        micro_batch_size=_count(em, "micro_batch_size", MAX_GLOBAL_BATCH, at),
        seq_len=_count(em, "seq_len", MAX_SEQ_LEN, at),
    )
    source = get(em, "source", str, at, "measured")
    if source not in SOURCES:
        raise ConfigError(f"{at}.source: expected one of {', '.join(SOURCES)}, got {source!r}")
    return ProfileEntry(
        key=key, source=source, dtype=get(em, "dtype", str, at, "bf16"), layers=tuple(layers)
    )


def _count(m: Mapping[str, Any], key: str, bound: int, at: str) -> int:
    value = get(m, key, int, at)
    if not 1 <= value <= bound:
        raise ConfigError(f"{at}.{key}: must be 1 to {bound:,}, got {value}")
    return value


def _positive(m: Mapping[str, Any], key: str, typ: type[T], at: str) -> T:
    value = get(m, key, typ, at)
    if value <= 0:
        raise ConfigError(f"{at}.{key}: must be positive, got {value}")
    return value


def _not_negative(m: Mapping[str, Any], key: str, at: str) -> float | None:
    value = get(m, key, float, at, None)
    if value is not None and not value >= 0:
        raise ConfigError(f"{at}.{key}: must be >= 0 (a time), got {value}")
    return value


def load_profile(path: str | Path) -> Profile:
    return profile_from_dict(load_yaml(path), str(path))


def save_profile(p: Profile, path: str | Path, *, overwrite: bool = False) -> Path:
    text = dump_yaml(profile_to_dict(p))
    return write_replace(path, text) if overwrite else write_new(path, text)
