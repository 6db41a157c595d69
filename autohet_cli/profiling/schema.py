"""The ``autohet.profile/v1`` artifact: device facts and per-layer timings.

An entry is keyed by (model, GPU type, TP degree, micro-batch size, sequence
length) and lists, per partitionable layer, forward/backward/optimizer-update
milliseconds for one micro-batch on one GPU of the TP group, the parameters that
GPU holds, the activation bytes it keeps for backward and the bytes the layer
sends to the next stage. ``source`` says where numbers came from: ``measured``
(autohet profile run), ``sailor`` (imported measurements), ``analytic``
(computed from the catalog) or ``calibrated`` (analytic scaled per layer to the
nearest measurement of the same GPU type; made at planning time, never stored).
Measured, imported and calibrated entries already include TP communication;
analytic ones do not, and the cost model adds it.

We store parameter *counts* (``num_params``) rather than bytes, so that memory
follows the training precision and optimizer chosen at plan time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from autohet_cli.errors import ConfigError
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
SCHEMA = "autohet.profile/v1"
SOURCES = ("measured", "sailor", "analytic", "calibrated")
_LAYER_KEYS = ("fwd_ms", "bwd_ms", "update_ms", "num_params", "act_bytes", "output_bytes")
_RECOMPUTE_KEYS = ("recompute_fwd_ms", "recompute_bwd_ms")  # optional, both or neither
# Profile meta: the entries whose recomputation times a recompute run fitted
# (profiling.calibrate: a plain run's ratios then leave them alone); merging keeps
# the marks of entries the newer profile does not replace.
RC_FITTED = "recompute_calibrated"


def rc_mark(k: EntryKey) -> str:
    """An entry's name in ``RC_FITTED``."""
    return f"{k.model}|{k.gpu_type}|tp{k.tensor_parallel}|mbs{k.micro_batch_size}|{k.seq_len}"


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerTiming:
    fwd_ms: float
    bwd_ms: float
    update_ms: float
    num_params: int
    act_bytes: float
    output_bytes: float
    # Under activation recomputation (the layer wrapped in a non-reentrant
    # torch.utils.checkpoint, as the runtime runs a recompute stage): the forward,
    # and the backward with the forward re-run in it. Measured, because neither is
    # the plain times' sum: checkpoint's per-call work runs on the CPU and can
    # starve a fast GPU (GPT-1.3B on an H100, micro-batch 2: the forward took 1.9x
    # the plain one). None (analytic, imported or older profiles): the forward,
    # and backward + forward, which is what the GPU computes.
    recompute_fwd_ms: float | None = None
    recompute_bwd_ms: float | None = None

    @property
    def rc_fwd_ms(self) -> float:
        """The forward under recomputation (measured, else the plain forward)."""
        return self.fwd_ms if self.recompute_fwd_ms is None else self.recompute_fwd_ms

    @property
    def rc_bwd_ms(self) -> float:
        """The backward under recomputation, the re-run forward included."""
        if self.recompute_bwd_ms is None:
            return self.bwd_ms + self.fwd_ms
        return self.recompute_bwd_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class EntryKey:
    model: str
    gpu_type: str
    tensor_parallel: int
    micro_batch_size: int
    seq_len: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileEntry:
    key: EntryKey
    source: str
    dtype: str
    layers: tuple[LayerTiming, ...]

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"profile entry source {self.source!r}: expected one of {SOURCES}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceFacts:
    gpu_type: str
    mem_bytes: int
    matmul_tflops: float
    mem_bandwidth_gbytes_s: float
    source: str  # catalog | measured
    # A real intra-host all-reduce (NCCL/gloo) fitted as latency + rate by the probe:
    # each of a ring's 2(n-1) steps costs ``allreduce_hop_ms`` plus its bytes at
    # ``allreduce_gbytes_s``. None: not measured (the cluster's link speed is used).
    allreduce_hop_ms: float | None = None
    allreduce_gbytes_s: float | None = None
    # Fixed costs the probe measured (None: not measured, the catalog's figures
    # stand): one eager op's host time (dispatch, autograd, launch), and a training
    # iteration's time beyond its layers (the intercept of its time against the
    # number of layers: the loss, the optimizer's and zero_grad's fixed work).
    op_us: float | None = None
    step_ms: float | None = None

    def allreduce_ms(self, nbytes: float, participants: int) -> float | None:
        """A ring all-reduce of ``nbytes`` among ``participants`` on one host, from
        the measured fit (None without one)."""
        if self.allreduce_gbytes_s is None or self.allreduce_hop_ms is None:
            return None
        if participants <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (participants - 1)
        moved = steps / participants * nbytes
        return steps * self.allreduce_hop_ms + moved / (self.allreduce_gbytes_s * 1e9) * 1e3


@dataclass(frozen=True, slots=True, kw_only=True)
class Overhead:
    """What a GPU type costs beyond its layers, measured from runs
    (``autohet profile calibrate``): a fixed time per step (optimizer launch,
    framework, the step's small collectives) and memory the process holds beyond
    weights, optimizer state and activations (allocator, libraries, buffers)."""

    step_ms: float = 0.0
    mem_bytes: int = 0
    sync_x: float = 1.0  # measured / predicted gradient all-reduce time
    p2p_ms: float = 0.0  # fixed cost of one stage-to-stage exchange (latency)
    source: str = "calibrated"
    runs: int = 1  # runs it was measured from
    # Per TP degree > 1, what a step of a TP stage costs beyond ``step_ms`` (DTensor's
    # optimizer and norm over shards): averaged into step_ms, a TP run's fixed cost
    # would be charged to every TP 1 plan.
    tp_step_ms: Mapping[int, float] = field(default_factory=dict)

    def step_cost_ms(self, tp: int) -> float:
        return self.step_ms + (self.tp_step_ms.get(tp, 0.0) if tp > 1 else 0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    devices: Mapping[str, DeviceFacts] = field(default_factory=dict)
    entries: Mapping[EntryKey, ProfileEntry] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    overheads: Mapping[str, Overhead] = field(default_factory=dict)  # per GPU type

    def entry(self, key: EntryKey) -> ProfileEntry | None:
        return self.entries.get(key)

    def models(self) -> list[str]:
        return sorted({k.model for k in self.entries})

    def merged_with(self, newer: Profile) -> Profile:
        """``newer`` wins per entry and per device, except that an analytic entry
        never replaces a measured one: re-profiling one GPU type keeps the rest."""
        entries = dict(self.entries)
        for k, e in newer.entries.items():
            old = entries.get(k)
            if old is None or e.source != "analytic" or old.source == "analytic":
                entries[k] = e
        devices = dict(self.devices)
        overheads = {**self.overheads, **newer.overheads}
        for name, dev in newer.devices.items():
            old_dev = devices.get(name)
            if old_dev is None or dev.source == "measured" or old_dev.source != "measured":
                if old_dev is not None and dev.allreduce_gbytes_s is None:
                    # a re-probe without TP > 1 measured no all-reduce: keep the fit
                    dev = replace(
                        dev,
                        allreduce_hop_ms=old_dev.allreduce_hop_ms,
                        allreduce_gbytes_s=old_dev.allreduce_gbytes_s,
                    )
                if old_dev is not None and dev.op_us is None:  # a probe before 1.2
                    dev = replace(dev, op_us=old_dev.op_us, step_ms=old_dev.step_ms)
                devices[name] = dev
                if dev.source == "measured" and name not in newer.overheads:
                    # Overheads are refitted against the numbers they corrected
                    # (sync factor against the old all-reduce model, step cost
                    # against the old layer times): new numbers void them.
                    overheads.pop(name, None)
        meta = dict(self.meta)
        history = list(meta.get("history", [])) + list(newer.meta.get("history", []))
        absorbed = list(meta.get("calibrated_from", []))
        absorbed += [r for r in newer.meta.get("calibrated_from", []) if r not in absorbed]
        runs = {**meta.get("runtime_runs", {}), **newer.meta.get("runtime_runs", {})}
        # recomputation times a run fitted: kept unless newer entries replaced them
        replaced = {rc_mark(k) for k in newer.entries}
        rc_fitted = [m for m in meta.get(RC_FITTED, []) if m not in replaced]
        rc_fitted += [m for m in newer.meta.get(RC_FITTED, []) if m not in rc_fitted]
        meta.update({k: v for k, v in newer.meta.items() if k != "history"})
        if history:
            meta["history"] = history
        if absorbed:
            meta["calibrated_from"] = absorbed
        if runs:
            meta["runtime_runs"] = runs
        meta.pop(RC_FITTED, None)
        if rc_fitted:
            meta[RC_FITTED] = sorted(rc_fitted)
        return Profile(devices=devices, entries=entries, meta=meta, overheads=overheads)

    def with_entries(self, entries: Iterable[ProfileEntry]) -> Profile:
        merged = dict(self.entries)
        merged.update({e.key: e for e in entries})
        return replace(self, entries=merged)


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
        "entries": [_entry_to_dict(e) for _, e in sorted(p.entries.items(), key=_sort_key)],
        **(
            {
                "overheads": {
                    name: {
                        "step_ms": o.step_ms,
                        "mem_bytes": o.mem_bytes,
                        "sync_x": o.sync_x,
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


def _sort_key(item: tuple[EntryKey, ProfileEntry]) -> tuple[str, str, int, int, int]:
    k = item[0]
    return (k.model, k.gpu_type, k.tensor_parallel, k.micro_batch_size, k.seq_len)


def _entry_to_dict(e: ProfileEntry) -> dict[str, Any]:
    k = e.key
    return {
        "model": k.model,
        "gpu_type": k.gpu_type,
        "tensor_parallel": k.tensor_parallel,
        "micro_batch_size": k.micro_batch_size,
        "seq_len": k.seq_len,
        "source": e.source,
        "dtype": e.dtype,
        "layers": [_layer_to_dict(lt) for lt in e.layers],
    }


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
            om, at, [], ["step_ms", "mem_bytes", "sync_x", "p2p_ms", "source", "runs", "tp_step_ms"]
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
            p2p_ms=get(om, "p2p_ms", float, at, 0.0),
            source=get(om, "source", str, at, "calibrated"),
            runs=get(om, "runs", int, at, 1),
            tp_step_ms=tp_step,
        )
        if min(o.step_ms, o.mem_bytes, o.p2p_ms) < 0 or o.runs < 1 or not o.sync_x > 0:
            raise ConfigError(
                f"{at}: step_ms, mem_bytes and p2p_ms must be >= 0, sync_x > 0, runs >= 1"
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
