"""Analytic profiles: per-layer times estimated from the device catalog (pure).

Used for every (GPU type, model, TP degree, micro-batch size) that nobody
measured, and marked ``analytic`` so the cost model adds the TP all-reduces a
measurement would have included. A layer takes the longer of its compute time
(FLOPs at a fraction of peak) and its memory time (activations written and
parameters read at the memory bandwidth): a roofline, which keeps small layers
(embedding, norms) from costing nothing. Backward costs twice the forward.
The optimizer update streams every state byte once at memory bandwidth.

Each layer also pays its ops' fixed host time (``estimates.fixed``: dispatch and
launch per op, DTensor's per-op work under TP, the optimizer's per-tensor ops): on
a GPU the longer of it and the device's work, on the CPU on top of it. A measured
per-op time (``DeviceFacts.op_us``, from the probe) replaces the catalog's.

Below the cost model, which calls ``analytic_entry`` for every combination a profile
lacks: an estimate needs only the catalog and the model, so it sits apart from the
profiling that measures over SSH, and the cost model imports nothing above itself
(``profiling.analytic`` re-exports it for older imports).
"""

from __future__ import annotations

from autohet_cli.catalog import GpuSpec
from autohet_cli.estimates.fixed import dispatch_ms, layer_ops, param_tensors, with_dispatch
from autohet_cli.estimates.profile import DeviceFacts, EntryKey, LayerTiming, ProfileEntry
from autohet_cli.models import LayerSpec, ModelSpec

# Adam touches w, g, m, v (read) and w, m, v (+16-bit copy) (write): ~30 bytes/param.
_UPDATE_BYTES_PER_PARAM = {"adam": 30.0, "sgd": 18.0}
# A transformer layer reaches this share of what the device's pure GEMM reaches.
_LAYER_OVER_GEMM = 0.85


def effective_tflops(spec: GpuSpec, measured: DeviceFacts | None, precision: str) -> float:
    """Achievable layer throughput: measured matmul rate if we have it, else the
    spec's peak at the run's precision (one figure for catalog types)."""
    if measured is not None and measured.source == "measured" and measured.matmul_tflops > 0:
        return measured.matmul_tflops * _LAYER_OVER_GEMM
    return spec.peak_tflops_at(precision) * spec.matmul_efficiency


def layer_timing(
    layer: LayerSpec,
    spec: GpuSpec,
    *,
    tp: int,
    micro_batch_size: int,
    seq_len: int,
    dtype_bytes: int,
    optimizer: str,
    precision: str,
    measured: DeviceFacts | None = None,
    model: ModelSpec | None = None,
) -> LayerTiming:
    """One layer's estimate; ``model`` (for the op counts) adds the fixed host time
    of its ops, without it the timing is arithmetic and bytes alone."""
    flops = layer.fwd_flops(seq_len, micro_batch_size) / tp
    tflops = effective_tflops(spec, measured, precision)
    mem_bw = (measured.mem_bandwidth_gbytes_s if measured else 0.0) or spec.mem_bandwidth_gbytes_s
    # A pipeline stage holding a tied head keeps its own copy of the embedding.
    params_per_gpu = layer.num_params // tp if layer.kind != "norm" else layer.num_params
    act = layer.act_bytes(seq_len, micro_batch_size, tp, dtype_bytes)
    out = layer.output_bytes(seq_len, micro_batch_size, dtype_bytes)
    moved = act + out + params_per_gpu * dtype_bytes
    fwd_ms = max(flops / (tflops * 1e12), moved / (mem_bw * 1e9)) * 1e3
    bwd_ms = 2.0 * fwd_ms
    update_ms = params_per_gpu * _UPDATE_BYTES_PER_PARAM[optimizer] / (mem_bw * 1e9) * 1e3
    if model is not None:
        fixed, op_us = spec.fixed, measured.op_us if measured is not None else None
        ops_fwd, ops_bwd = layer_ops(layer, model)
        ops_update = param_tensors(layer, model) * fixed.optimizer_ops_per_tensor
        fwd_ms = with_dispatch(fixed, fwd_ms, dispatch_ms(fixed, ops_fwd, tp, op_us))
        bwd_ms = with_dispatch(fixed, bwd_ms, dispatch_ms(fixed, ops_bwd, tp, op_us))
        # DTensor's per-op work reaches the optimizer where it steps tensor by tensor
        # (torch's Adam on CPU tensors); a GPU's foreach kernels take whole lists
        # per op, and the clip runs on local shards
        opt_tp = 1 if fixed.overlapped else tp
        update_ms = with_dispatch(fixed, update_ms, dispatch_ms(fixed, ops_update, opt_tp, op_us))
    return LayerTiming(
        fwd_ms=fwd_ms,
        bwd_ms=bwd_ms,
        update_ms=update_ms,
        num_params=params_per_gpu,
        act_bytes=act,
        output_bytes=out,
    )


def analytic_entry(
    model: ModelSpec,
    spec: GpuSpec,
    *,
    tp: int,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    optimizer: str,
    measured: DeviceFacts | None = None,
) -> ProfileEntry:
    """The analytic profile entry of ``model`` on one GPU of ``spec``'s type: each
    layer's ``layer_timing`` at the run's precision, without TP communication (the
    cost model adds it to entries marked ``analytic``)."""
    dtype_bytes = 4 if precision == "fp32" else 2
    layers = tuple(
        layer_timing(
            layer,
            spec,
            tp=tp,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            dtype_bytes=dtype_bytes,
            optimizer=optimizer,
            measured=measured,
            precision=precision,
            model=model,
        )
        for layer in model.layers()
    )
    key = EntryKey(
        model=model.name,
        gpu_type=spec.name,
        tensor_parallel=tp,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
    )
    return ProfileEntry(key=key, source="analytic", dtype=precision, layers=layers)
