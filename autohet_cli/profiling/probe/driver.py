"""The probe's run: every measurement the spec asks for, in order, as one result.

The order matters: the device's rates come first because the layers' share of
the time budget is estimated from them, and the TP all-reduces before the
layers because each layer's times include its all-reduces. The result
(``autohet.probe-result/v1``) is a JSON-ready dict whose keys and meanings
autohet's ``measure.profile_from_probe`` reads; it must not change without a
new ``PROBE_VERSION``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch

from .comm import comm_sizes, grad_sizes, measure_tp_comm
from .fixed import measure_fixed
from .host import (
    DTYPES,
    device_facts,
    gpu_inventory,
    host_facts,
    nvidia_smi,
    pick_device,
    pick_dtype,
)
from .kinds import Ctx, iter_cost_s, time_kind, update_cost_s
from .layers import first_backward
from .rates import measure_bandwidth, measure_matmul, measure_peer_copy
from .spec import KINDS, PROBE_VERSION, RESULT_SCHEMA, check_spec
from .timing import Budget


def run(raw_spec: Any, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure what ``raw_spec`` asks for on this host; the result as a JSON-ready dict."""
    say = log or (lambda _msg: None)
    spec = check_spec(raw_spec)
    seconds = spec["time_budget_s"]
    if seconds is None:
        seconds = 8.0 if spec["device"] == "cpu" or not torch.cuda.is_available() else 600.0
    budget = Budget(float(seconds))
    if spec["cpu_threads"]:
        torch.set_num_threads(int(spec["cpu_threads"]))
    with contextlib.suppress(RuntimeError):
        torch.set_flush_denormal(True)
    smi = nvidia_smi()
    gpus = gpu_inventory()
    dev = pick_device(spec, gpus)
    dtype_name = pick_dtype(spec, dev)
    dtype = DTYPES[dtype_name]
    host = host_facts(smi)
    device = device_facts(dev, gpus, host["ram_bytes"])
    say(f"device {device['name']} ({dev}), dtype {dtype_name}")
    first_backward(dev)
    matmul = measure_matmul(dev, dtype, budget)
    bandwidth = measure_bandwidth(dev, budget)
    say(f"matmul {matmul['tflops']:.3f} TFLOP/s, copy {bandwidth['gbytes_s']:.1f} GB/s")
    fixed = measure_fixed(spec, dev, dtype, budget)
    tps = spec["tensor_parallel"]
    kinds = [k for k in KINDS if k in spec["layers"]]
    peer = measure_peer_copy() if dev.type == "cuda" and max(tps) > 1 else None
    tp_comm = {}
    grads_timed = False
    for tp in sorted(t for t in tps if t > 1):
        sizes = comm_sizes(spec, kinds, torch.finfo(dtype).bits // 8)
        if not grads_timed:  # gradient sizes too, once: autohet fits latency + rate
            sizes = sorted(set(sizes) | set(grad_sizes(spec, kinds, dev)))
        comm = measure_tp_comm(tp, sizes, dev, spec, bandwidth["gbytes_s"], peer, budget)
        grads_timed = grads_timed or comm["method"].endswith("_allreduce")
        tp_comm[str(tp)] = comm
        say(f"tp {tp}: {comm['note']}")
    ctx = Ctx(
        spec=spec,
        dev=dev,
        dtype=dtype,
        mem_bytes=int(device["mem_bytes"]),
        flops_s=matmul["tflops"] * 1e12,
        bytes_s=bandwidth["gbytes_s"] * 1e9,
        tp_comm=tp_comm,
        log=say,
    )
    budget.cost_left = sum(
        update_cost_s(k, spec["layers"][k], tp, ctx)
        + sum(iter_cost_s(k, spec["layers"][k], tp, m, ctx) for m in spec["micro_batch_sizes"])
        for tp in tps
        for k in kinds
    )
    per_kind: dict[tuple[int, str], dict[int, dict[str, Any]]] = {}
    update: dict[str, dict[str, Any]] = {str(tp): {} for tp in tps}
    for tp in tps:
        for kind in kinds:
            per_kind[tp, kind], update[str(tp)][kind] = time_kind(
                kind, spec["layers"][kind], tp, ctx, budget
            )
    runs = [_run_record(tp, m, kinds, per_kind) for tp in tps for m in spec["micro_batch_sizes"]]
    notes = []
    if budget.exceeded:
        notes.append(f"time budget of {budget.seconds:g} s ran out; later repeats were cut to 1")
    return {
        "schema": RESULT_SCHEMA,
        "probe_version": PROBE_VERSION,
        "spec": spec,
        "host": host,
        "gpus": gpus,
        "nvidia_smi": smi,
        "device": device,
        "dtype": dtype_name,
        "matmul": matmul,
        "mem_bandwidth": bandwidth,
        "fixed": fixed,
        "peer_copy_gbytes_s": peer,
        "tp_comm": tp_comm,
        "update": update,
        "runs": runs,
        "elapsed_s": budget.seconds - (budget.deadline - time.perf_counter()),
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
        "notes": notes,
    }


def _run_record(
    tp: int, mbs: int, kinds: list[str], per_kind: dict[tuple[int, str], dict[int, dict[str, Any]]]
) -> dict[str, Any]:
    """One (TP degree, micro-batch size) with its layer kinds: ok only if every kind ran."""
    layers = {k: per_kind[tp, k][mbs] for k in kinds}
    bad = {k: r for k, r in layers.items() if r["status"] != "ok"}
    if not bad:
        return {"tp": tp, "mbs": mbs, "status": "ok", "layers": layers}
    status = "oom" if any(r["status"] == "oom" for r in bad.values()) else "skipped"
    reason = "; ".join(f"{k}: {r.get('reason', r['status'])}" for k, r in bad.items())
    return {"tp": tp, "mbs": mbs, "status": status, "reason": reason, "layers": layers}
