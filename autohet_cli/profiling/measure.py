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

The spec is ``profiling.probespec``; the result's fields other than the runs are
read by ``profiling.probefields``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from autohet_cli.estimates.profile import (
    DeviceFacts,
    EntryKey,
    LayerTiming,
    Profile,
    ProfileEntry,
)
from autohet_cli.models import ModelSpec
from autohet_cli.profiling.fixedfit import fit_line, probe_fixed
from autohet_cli.profiling.probefields import ProbeReader, comm_notes, device_facts, probe_meta
from autohet_cli.profiling.probespec import DTYPES, SPEC_SCHEMA, layer_shapes, spec_for

RESULT_SCHEMA = "autohet.probe-result/v1"
# Adam reads w, g, m, v and writes w, m, v (plus a 16-bit copy): ~30 bytes/param.
ADAM_BYTES_PER_PARAM = 30.0
_LAYER_FIELDS = ("fwd_ms", "bwd_ms", "act_bytes", "output_bytes")
_RECOMPUTE_FIELDS = ("recompute_fwd_ms", "recompute_bwd_ms")

# Re-exported: ``profiling.run`` and the tests import the spec's names from here.
__all__ = [
    "ADAM_BYTES_PER_PARAM",
    "DTYPES",
    "RESULT_SCHEMA",
    "SPEC_SCHEMA",
    "allreduce_fit",
    "layer_shapes",
    "profile_from_probe",
    "spec_for",
]


def profile_from_probe(
    model: ModelSpec, result: Any, *, host: str, gpu_type: str | None = None
) -> Profile:
    """The probe's result from ``host`` as measured profile entries and device facts,
    keyed by ``gpu_type`` (the host's type in the cluster file) when given."""
    r = ProbeReader(host)
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
    device = device_facts(r, doc, gpu_type)
    notes = comm_notes(r, doc)
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
    meta = probe_meta(r, doc, model, host, device, notes)
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


def _layers(
    r: ProbeReader,
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


def _update_ms(r: ProbeReader, update: Mapping[str, Any], tp: int, kind: str) -> float | None:
    per_tp = update.get(str(tp))
    if per_tp is None:
        return None
    at = f"update.{tp}.{kind}"
    rec = r.mapping(r.mapping(per_tp, f"update.{tp}").get(kind) or {}, at)
    if rec.get("status") != "ok":
        return None
    return r.number(rec, "ms", at)
