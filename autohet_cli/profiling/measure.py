"""The probe's spec from a model, and the probe's result as a profile (pure).

``autohet profile run`` sends ``spec_for(model, ...)`` to each host along with
``probe.py``, and turns each host's result into an ``autohet.profile/v1``
Profile with ``profile_from_probe``:

- the probe times one layer of each distinct kind (embedding, block, final norm,
  head) as one TP rank's shard, Megatron all-reduces included; every block of a
  model has the same shape, so the kinds expand to the model's full layer list;
- entries (source ``measured``) for each (TP degree, micro-batch size) that ran;
  those that ran out of memory or could not be split are left out, and noted;
- ``update_ms`` is the probe's Adam step on the shard's fp32 master weights, or,
  where it did not run, ~30 bytes per parameter streamed at the measured
  memory bandwidth (the analytic profile's estimate);
- the fixed costs the probe timed at several amounts of work (``fixedfit``): one
  op's host time and an iteration's cost beyond its layers, in the device facts;
- device facts (source ``measured``) keyed by the host's GPU type as the
  cluster file declares it, so a type the cluster defines (``gpu_types:``) is
  measured under its own name; the probe's device name is only checked against
  it (a card the catalog knows as another type, or no GPU where one was
  declared, is refused) and kept in meta. Without a declared type: the canonical
  catalog type of the device (``cpu`` without a GPU);
- meta: the host, when, software versions and the probe's version, plus a
  history entry with the precision and notes, so merged profiles keep every
  measurement's record (each entry carries its ``dtype`` too: plans use an entry
  only at their own precision).

A malformed result raises ProfileError naming the host and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, NoReturn

from autohet_cli.catalog import CATALOG, canonical_gpu_name
from autohet_cli.errors import ProfileError, UnknownNameError
from autohet_cli.estimates.profile import (
    DeviceFacts,
    EntryKey,
    LayerTiming,
    Profile,
    ProfileEntry,
)
from autohet_cli.models import ModelSpec
from autohet_cli.profiling.fixedfit import fit_line, probe_fixed

SPEC_SCHEMA = "autohet.probe-spec/v1"
RESULT_SCHEMA = "autohet.probe-result/v1"
DTYPES = ("auto", "fp32", "bf16", "fp16")
# Adam reads w, g, m, v and writes w, m, v (plus a 16-bit copy): ~30 bytes/param.
ADAM_BYTES_PER_PARAM = 30.0
_LAYER_FIELDS = ("fwd_ms", "bwd_ms", "act_bytes", "output_bytes")
_RECOMPUTE_FIELDS = ("recompute_fwd_ms", "recompute_bwd_ms")


def layer_shapes(model: ModelSpec) -> dict[str, dict[str, Any]]:
    """The shape of each distinct kind of partitionable layer, as the probe builds it."""
    h = model.hidden_size
    e = model.embed_proj_dim or h
    shapes: dict[str, dict[str, Any]] = {
        "embedding": {
            "vocab_size": model.padded_vocab_size,  # as trained: see ModelSpec
            "embed_dim": e,
            "hidden_size": h,
            "num_positions": model.num_positions,
        },
        "block": {
            "hidden_size": h,
            "num_heads": model.num_heads,
            "num_kv_heads": model.num_kv_heads,
            "ffn_hidden_size": model.ffn_hidden_size,
            "gated_mlp": model.gated_mlp,
            "norm": model.norm,
            "bias": model.bias,
            "qkv_bias": model.bias if model.qkv_bias is None else model.qkv_bias,
            "rotary": model.num_positions == 0,
        },
        "head": {
            "vocab_size": model.padded_vocab_size,  # as trained: see ModelSpec
            "embed_dim": e,
            "hidden_size": h,
            "final_norm": model.final_norm and not model.separate_final_norm,
            "norm": model.norm,
        },
    }
    if model.separate_final_norm:
        shapes["norm"] = {"hidden_size": h, "norm": model.norm}
    return shapes


def spec_for(
    model: ModelSpec,
    seq_len: int,
    tps: Sequence[int],
    mbss: Sequence[int],
    dtype: str = "auto",
    *,
    warmup: int = 2,
    repeat: int = 10,
    time_budget_s: float | None = None,
    cpu_threads: int | None = None,
    comm: str = "auto",
) -> dict[str, Any]:
    """The JSON spec ``probe.py`` takes to measure ``model``.

    ``dtype`` ``auto`` is bf16 on a GPU that supports it (else fp16) and fp32 on
    the CPU. ``time_budget_s`` None lets the probe choose (600 s on a GPU, 8 s on
    the CPU); repeats drop to fit it, never below one. ``cpu_threads`` sets the
    threads of a CPU device (e.g. the host's cores divided by the cluster file's
    ``cpu`` count); ``comm`` ``copy`` skips the real all-reduce and estimates TP
    communication from copy bandwidth.
    """
    if seq_len < 1:
        raise ProfileError(f"seq_len: must be at least 1, got {seq_len}")
    for name, values in (("tensor_parallel", tps), ("micro_batch_sizes", mbss)):
        if not values or any(v < 1 for v in values):
            raise ProfileError(f"{name}: expected positive integers, got {list(values)}")
    if dtype not in DTYPES:
        raise ProfileError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if comm not in ("auto", "copy"):
        raise ProfileError(f"comm: expected auto or copy, got {comm!r}")
    return {
        "schema": SPEC_SCHEMA,
        "model": model.name,
        "seq_len": seq_len,
        "tensor_parallel": sorted(set(tps)),
        "micro_batch_sizes": sorted(set(mbss)),
        "dtype": dtype,
        "warmup": warmup,
        "repeat": repeat,
        "time_budget_s": time_budget_s,
        "cpu_threads": cpu_threads,
        "comm": comm,
        "layers": layer_shapes(model),
    }


class _Reader:
    """Typed access to the probe's JSON; every failure names the host and the field."""

    def __init__(self, host: str) -> None:
        self.host = host

    def fail(self, at: str, problem: str) -> NoReturn:
        raise ProfileError(f"probe result from {self.host}: {at}: {problem}")

    def mapping(self, obj: Any, at: str) -> Mapping[str, Any]:
        if not isinstance(obj, Mapping):
            self.fail(at, f"expected an object, got {type(obj).__name__}")
        return obj

    def items(self, obj: Any, at: str) -> list[Any]:
        if not isinstance(obj, list):
            self.fail(at, f"expected a list, got {type(obj).__name__}")
        return obj

    def get(self, d: Mapping[str, Any], key: str, at: str) -> Any:
        if key not in d:
            self.fail(f"{at}.{key}" if at else key, "missing")
        return d[key]

    def text(self, d: Mapping[str, Any], key: str, at: str) -> str:
        value = self.get(d, key, at)
        if not isinstance(value, str) or not value:
            self.fail(f"{at}.{key}" if at else key, f"expected a non-empty string, got {value!r}")
        return value

    def number(self, d: Mapping[str, Any], key: str, at: str, *, positive: bool = False) -> float:
        value = self.get(d, key, at)
        where = f"{at}.{key}" if at else key
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(where, f"expected a number, got {value!r}")
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            self.fail(where, f"expected a finite {'positive' if positive else '>= 0'} number")
        return float(value)

    def integer(self, d: Mapping[str, Any], key: str, at: str, *, minimum: int = 0) -> int:
        value = self.get(d, key, at)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(f"{at}.{key}" if at else key, f"expected an integer >= {minimum}")
        return value


def profile_from_probe(
    model: ModelSpec, result: Any, *, host: str, gpu_type: str | None = None
) -> Profile:
    """The probe's result from ``host`` as measured profile entries and device facts,
    keyed by ``gpu_type`` (the host's type in the cluster file) when given."""
    r = _Reader(host)
    doc = r.mapping(result, "result")
    if doc.get("schema") != RESULT_SCHEMA:
        r.fail("schema", f"expected {RESULT_SCHEMA!r}, got {doc.get('schema')!r}")
    spec = r.mapping(r.get(doc, "spec", ""), "spec")
    if r.text(spec, "model", "spec") != model.name:
        r.fail("spec.model", f"measured {spec['model']!r}, not {model.name!r}")
    if r.get(spec, "layers", "spec") != layer_shapes(model):
        r.fail("spec.layers", f"the layer shapes measured are not those of {model.name}")
    seq_len = r.integer(spec, "seq_len", "spec", minimum=1)
    dtype = r.text(doc, "dtype", "")
    if dtype not in DTYPES[1:]:
        r.fail("dtype", f"expected one of {', '.join(DTYPES[1:])}, got {dtype!r}")
    device = _device(r, doc, gpu_type)
    notes = _comm_notes(r, doc)
    fit = allreduce_fit(r.mapping(doc.get("tp_comm") or {}, "tp_comm"))
    if fit is not None:
        device = replace(device, allreduce_hop_ms=fit[0], allreduce_gbytes_s=fit[1])
        notes.append(
            f"all-reduce fitted as {fit[0]:.4f} ms per ring step + {fit[1]:.2f} GB/s "
            "(gradient sync on one host)"
        )
    update = r.mapping(doc.get("update") or {}, "update")
    entries: dict[EntryKey, ProfileEntry] = {}
    num_estimated = 0
    for i, raw_run in enumerate(r.items(r.get(doc, "runs", ""), "runs")):
        at = f"runs[{i}]"
        run = r.mapping(raw_run, at)
        tp = r.integer(run, "tp", at, minimum=1)
        mbs = r.integer(run, "mbs", at, minimum=1)
        status = r.text(run, "status", at)
        if status != "ok":
            notes.append(f"tp {tp} mbs {mbs}: {status} ({run.get('reason', 'no reason given')})")
            continue
        key = EntryKey(
            model=model.name,
            gpu_type=device.gpu_type,
            tensor_parallel=tp,
            micro_batch_size=mbs,
            seq_len=seq_len,
        )
        if key in entries:
            r.fail(at, f"a second run of tp {tp} mbs {mbs}")
        layers, estimated = _layers(r, model, run, update, tp, device, at)
        num_estimated += estimated
        entries[key] = ProfileEntry(key=key, source="measured", dtype=dtype, layers=layers)
    if num_estimated:
        notes.append(
            f"update_ms of {num_estimated} layer(s) estimated as {ADAM_BYTES_PER_PARAM:g} bytes "
            "per parameter at the measured memory bandwidth (the probe's Adam step did not run)"
        )
    if not entries:
        notes.append("no (tp, mbs) combination ran; only the device facts were measured")
    fixed = probe_fixed(model, doc.get("fixed"), entries)
    device = replace(device, op_us=fixed.op_us, step_ms=fixed.step_ms)
    if fixed.op_us is not None or fixed.step_ms is not None:
        notes.append(fixed.note())
    meta = _meta(r, doc, model, host, device, notes)
    return Profile(devices={device.gpu_type: device}, entries=entries, meta=meta)


def allreduce_fit(tp_comm: Mapping[str, Any]) -> tuple[float, float] | None:
    """(ms per ring step, GB/s) fitted by least squares to the probe's real all-reduce
    among the fewest processes it ran: a ring of n moves 2(n-1)/n of the bytes in
    2(n-1) steps. None when no real all-reduce ran at two sizes or more, or the fit
    has no positive rate (times that do not grow with size)."""
    real = {
        int(tp): c
        for tp, c in tp_comm.items()
        if str(tp).isdigit()
        and int(tp) > 1
        and isinstance(c, Mapping)
        and str(c.get("method", "")).endswith("_allreduce")
        and isinstance(c.get("allreduce_ms"), Mapping)
    }
    if not real:
        return None
    n = min(real)
    points = []
    for size, ms in real[n]["allreduce_ms"].items():
        try:
            nbytes, t = int(size), float(ms)
        except (TypeError, ValueError):
            return None
        if nbytes > 0 and math.isfinite(t) and t >= 0:
            points.append((2 * (n - 1) / n * nbytes, t))
    # Relative errors (weights 1/t^2): the small sizes, where latency dominates,
    # count as much as the large ones, where the rate does.
    fit = fit_line(points, [1.0 / max(y, 1e-6) ** 2 for _, y in points])
    if fit is None or fit[1] <= 0:  # ms per byte
        return None
    intercept, slope = fit
    return intercept / (2 * (n - 1)), 1e-6 / slope


def _device(r: _Reader, doc: Mapping[str, Any], declared: str | None) -> DeviceFacts:
    dev = r.mapping(r.get(doc, "device", ""), "device")
    kind = r.text(dev, "type", "device")
    if kind == "cpu":
        gpu_type = _checked(r, declared, "cpu", "no GPU (it ran on the CPU)")
    elif kind == "cuda":
        name = r.text(dev, "name", "device")
        try:
            detected = canonical_gpu_name(name)
        except UnknownNameError as exc:
            if declared is None:
                r.fail("device.name", str(exc))
            detected = None
        gpu_type = _checked(r, declared, detected, f"{name!r} ({detected})")
    else:
        r.fail("device.type", f"expected cpu or cuda, got {kind!r}")
    matmul = r.mapping(r.get(doc, "matmul", ""), "matmul")
    bandwidth = r.mapping(r.get(doc, "mem_bandwidth", ""), "mem_bandwidth")
    return DeviceFacts(
        gpu_type=gpu_type,
        mem_bytes=r.integer(dev, "mem_bytes", "device", minimum=1),
        matmul_tflops=r.number(matmul, "tflops", "matmul", positive=True),
        mem_bandwidth_gbytes_s=r.number(bandwidth, "gbytes_s", "mem_bandwidth", positive=True),
        source="measured",
    )


def _checked(r: _Reader, declared: str | None, detected: str | None, found: str) -> str:
    """The type to file the measurement under: the declared one, unless the device
    is plainly another (a catalog type, or the CPU) and the numbers would lie."""
    if declared is None or declared == detected:
        assert detected is not None  # an unknown device without a declared type failed above
        return detected
    if detected is not None and (detected == "cpu" or declared == "cpu" or declared in CATALOG):
        r.fail(
            "device.name",
            f"the cluster file says gpus.type {declared} but the probe found {found}; "
            "fix the host's gpus.type, or the host's torch install if it should see a GPU",
        )
    return declared


def _layers(
    r: _Reader,
    model: ModelSpec,
    run: Mapping[str, Any],
    update: Mapping[str, Any],
    tp: int,
    device: DeviceFacts,
    at: str,
) -> tuple[tuple[LayerTiming, ...], int]:
    """The kinds measured in ``run`` expanded to every layer of ``model``."""
    measured = r.mapping(r.get(run, "layers", at), f"{at}.layers")
    by_kind: dict[str, LayerTiming] = {}
    estimated: set[str] = set()
    for kind in dict.fromkeys(layer.kind for layer in model.layers()):
        lat = f"{at}.layers.{kind}"
        d = r.mapping(r.get(measured, kind, f"{at}.layers"), lat)
        values = {f: r.number(d, f, lat) for f in _LAYER_FIELDS}
        # An older probe on the host may not time recomputation: planned from the plain times.
        rc = {f: r.number(d, f, lat) for f in _RECOMPUTE_FIELDS if f in d}
        num_params = r.integer(d, "num_params", lat)
        update_ms = _update_ms(r, update, tp, kind)
        if update_ms is None:
            estimated.add(kind)
            bytes_s = device.mem_bandwidth_gbytes_s * 1e9
            update_ms = num_params * ADAM_BYTES_PER_PARAM / bytes_s * 1e3
        by_kind[kind] = LayerTiming(
            fwd_ms=values["fwd_ms"],
            bwd_ms=values["bwd_ms"],
            update_ms=update_ms,
            num_params=num_params,
            act_bytes=values["act_bytes"],
            output_bytes=values["output_bytes"],
            recompute_fwd_ms=rc.get("recompute_fwd_ms") if len(rc) == 2 else None,
            recompute_bwd_ms=rc.get("recompute_bwd_ms") if len(rc) == 2 else None,
        )
    layers = tuple(by_kind[layer.kind] for layer in model.layers())
    return layers, sum(1 for layer in model.layers() if layer.kind in estimated)


def _update_ms(r: _Reader, update: Mapping[str, Any], tp: int, kind: str) -> float | None:
    per_tp = update.get(str(tp))
    if per_tp is None:
        return None
    at = f"update.{tp}.{kind}"
    rec = r.mapping(r.mapping(per_tp, f"update.{tp}").get(kind) or {}, at)
    if rec.get("status") != "ok":
        return None
    return r.number(rec, "ms", at)


def _comm_notes(r: _Reader, doc: Mapping[str, Any]) -> list[str]:
    notes = []
    for tp, raw in sorted(r.mapping(doc.get("tp_comm") or {}, "tp_comm").items()):
        comm = r.mapping(raw, f"tp_comm.{tp}")
        method = r.text(comm, "method", f"tp_comm.{tp}")
        notes.append(f"tp {tp} all-reduces: {method}: {comm.get('note', '')}".rstrip(": "))
    dev = r.mapping(doc["device"], "device")
    if dev.get("type") == "cpu":
        notes.append(
            f"cpu device: {dev.get('threads')} thread(s) of {dev.get('cores')} core(s); "
            f"memory {dev.get('mem_note', 'as reported')}"
        )
    notes += [str(n) for n in r.items(doc.get("notes") or [], "notes")]
    return notes


def _meta(
    r: _Reader,
    doc: Mapping[str, Any],
    model: ModelSpec,
    host: str,
    device: DeviceFacts,
    notes: list[str],
) -> dict[str, Any]:
    facts = r.mapping(r.get(doc, "host", ""), "host")
    software = {k: facts.get(k) for k in ("python", "torch", "cuda", "driver")}
    r.text(facts, "torch", "host")
    created = doc.get("created_utc")
    if not isinstance(created, str) or not created:
        created = datetime.now(UTC).isoformat(timespec="seconds")
    version = str(r.get(doc, "probe_version", ""))
    dev = r.mapping(doc["device"], "device")
    matmul = r.mapping(doc["matmul"], "matmul")
    record = {
        "measure": "probe",
        "model": model.name,
        "host": host,
        "hostname": facts.get("hostname"),
        "gpu_type": device.gpu_type,
        "device_name": dev.get("name"),
        "dtype": doc.get("dtype"),  # every entry of this measurement is in it
        "created": created,
        "probe_version": version,
        "software": software,
        "matmul_n": matmul.get("n"),
        "notes": notes,
    }
    return {
        "source": "measured",
        "created": created,
        "hosts": [host],
        "software": software,
        "probe_version": version,
        "history": [record],
    }
