"""Known device types: memory, peak dense tensor throughput, bandwidths.

Figures are the vendors' published datasheet numbers, dense (no 2:4 sparsity),
for the training precision each card runs best (bf16 where supported, else fp16
with fp32 accumulate). Sources, once: NVIDIA V100, A100, A10, L4, L40S, T4, H100,
H200 and GH200 datasheets; NVIDIA Ampere GA102 and Ada AD102 architecture
whitepapers for RTX 3090/4090 and Turing for RTX 2080/Titan RTX (fp16 tensor
with fp32 accumulate); AWS G5 documentation for the A10G.

Link figures are per GPU and per direction, in Gbit/s (so they compare with
the cluster file's ``inter_node_gbps``): NVLink 3 on A100 is 600 GB/s both ways,
i.e. 300 GB/s = 2400 Gbit/s each way; PCIe 4.0 x16 is about 256 Gbit/s.

``matmul_efficiency`` is the fraction of peak an analytic profile assumes a
transformer layer reaches. Large GEMMs reach 70-80%, a whole layer less; 0.5
puts the cost model within ~10-20% of Megatron-LM's published A100 throughput
(benchmarks/megatron_check.py). Measured profiles replace it.

``cpu`` is a group of CPU cores acting as one device, so that a localhost
cluster can be planned, launched and tested on machines without GPUs; its
figures are deliberately modest and are meant to be replaced by
``autohet profile run``.

``fixed`` (``FixedCosts``) is what a step costs whatever its work: per eager op,
per collective message, per optimizer step. Small models are made of it (the
demo's TP 2 step on the CPU stand-in: 37 ms predicted from arithmetic and bytes,
316 ms measured on a quiet machine); large ones hide it behind their arithmetic.
``GPU_FIXED`` serves every GPU, ``CPU_FIXED`` the stand-in; the class docstring
says where the numbers come from.

Precision: a catalog type has one ``peak_tflops``, at its best training
precision, and the analytic model uses it whatever ``--precision`` a plan asks
for (measured profiles carry their own dtype). A type a cluster file defines
(``gpu_types:``, see ``gputypes.py``) may give a figure per precision; then
``peak_tflops_at(precision)`` picks the plan's, so an fp32 plan on a card with
slow fp32 is not costed at its bf16 rate.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from autohet_cli.errors import ConfigError, UnknownNameError

GIB = 1 << 30


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedCosts:
    """Time a device spends beyond arithmetic and bytes, for the analytic model.

    - ``op_us``: one eager op: the dispatcher and autograd's bookkeeping on the
      host, plus a kernel launch on a GPU. ``overlapped``: launches are queued
      ahead of the device (CUDA), so a layer takes the longer of its ops' host
      time and its device time; on the CPU the same thread does both: they add.
    - ``tp_op_us``: added to each op of a TP stage: DTensor's sharding propagation
      and its wrapping and unwrapping of local tensors, on the host.
    - ``hop_us``: one message of a collective or a stage-to-stage send (a ring
      all-reduce over n ranks sends 2(n-1) of them one after the other).
    - ``step_us``: once per step outside the stages' layers: the trainer's loop,
      fetching the batch, the loss/memory report (an all-reduce and a host sync).
    - ``optimizer_ops_per_tensor``: ops the optimizer step and gradient clipping run
      per parameter tensor (a GPU's foreach kernels cover many tensors per launch;
      on the CPU torch's Adam and the clip loop run each tensor's ops one by one).

    Where the numbers come from. GPUs: PyTorch's eager overhead (a few µs of
    dispatch and autograd per op plus ~5 µs per CUDA launch: ~10 µs), NCCL's
    small-message latency (~5 µs per ring step within a host) and the runtime's
    step outside its stages (~2 ms: Python, the batch, two small all-reduces that
    wait for the device); DTensor's per-op work is not charged (no GPU measured it
    here; ``profile run``'s TP runs calibrate what TP costs, ``Overhead.tp_step_ms``).
    The CPU stand-in (one thread per device, gloo over loopback) was measured with
    the runtime on the project's 2-core development machine while it was quiet
    (llama-tiny, fp32: data-parallel, TP 2 and two-stage plans at micro-batches 1,
    4 and 8, medians of 12-78 steps; op counts from the torch profiler), and these
    figures fit each of those plans' steps within 15%: 16 µs per op (the block's
    time at zero samples over its op count), 100 µs more per DTensor op, 1 ms per
    gloo message (two processes handing the cores to each other), 3 ms per step and
    12 ops per parameter tensor (torch's Adam steps CPU tensors one by one, the clip
    visits each). ``autohet profile run`` measures the real figures
    (``DeviceFacts.op_us``, the all-reduce fit, the step cost), which replace these.
    - ``zero1_sync_factor``: ZeRO-1's gradient reduce-scatter plus parameter
      all-gather against the all-reduce they replace. NCCL's ring runs both halves of
      its all-reduce as exactly these two collectives (1.0). gloo has no ring
      reduce-scatter or all-gather for CPU tensors: two processes on the development
      machine took 0.40 + 0.31 s for a 200 MB bucket against 0.20 s for its
      all-reduce, 3.5x (40 MB: 3.7x, 4 MB: 2.1x), so the planner no longer picks ZeRO-1
      on CPU devices for a "free" sync that runs 3.5 times as long.
    """

    op_us: float
    tp_op_us: float
    hop_us: float
    step_us: float
    optimizer_ops_per_tensor: float
    overlapped: bool
    zero1_sync_factor: float = 1.0


GPU_FIXED = FixedCosts(
    op_us=10.0,
    tp_op_us=0.0,
    hop_us=5.0,
    step_us=2000.0,
    optimizer_ops_per_tensor=2.0,
    overlapped=True,
)
# The CPU stand-in's figures as measured on the quiet development machine (class
# docstring), each time a quarter longer (SHARED), for the other work a small machine
# runs beside its workers: with the tests of three engineers running, its steps took
# 1.3-3x the quiet ones.
SHARED = 1.25
CPU_FIXED = FixedCosts(
    op_us=16.0 * SHARED,
    tp_op_us=100.0 * SHARED,
    hop_us=1000.0 * SHARED,
    step_us=3000.0 * SHARED,
    optimizer_ops_per_tensor=12.0,
    overlapped=False,
    zero1_sync_factor=3.5,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSpec:
    name: str
    mem_bytes: int
    peak_tflops: float
    mem_bandwidth_gbytes_s: float
    intra_node_gbps: float
    pcie_gbps: float
    nvlink: bool
    matmul_efficiency: float = 0.5
    runtime_reserve_bytes: int = 2 * GIB
    description: str = ""
    # (precision, TFLOP/s) pairs for types defined in a cluster file; empty: peak_tflops
    # at every precision (the catalog's convention).
    peak_tflops_by_precision: tuple[tuple[str, float], ...] = ()
    fixed: FixedCosts = GPU_FIXED

    def peak_tflops_at(self, precision: str) -> float:
        """Dense peak at ``precision``; a defined type without that figure is an error,
        since guessing fp32 from bf16 (or back) is off by 2-16x depending on the card."""
        if not self.peak_tflops_by_precision:
            return self.peak_tflops
        by = dict(self.peak_tflops_by_precision)
        if precision in by:
            return by[precision]
        raise ConfigError(
            f"GPU type {self.name!r} has no peak_tflops for {precision}; add "
            f"'{precision}: TFLOPS' under gpu_types.{self.name}.peak_tflops in the cluster file, "
            f"or plan with --precision {' or '.join(sorted(by))}"
        )


def _spec(
    name: str,
    mem_gb: float,
    tflops: float,
    mem_bw: float,
    nvlink_gbytes_s_bidir: float | None,
    pcie_gen: int,
    description: str,
) -> GpuSpec:
    pcie_gbps = {3: 128.0, 4: 256.0, 5: 512.0}[pcie_gen]
    intra = nvlink_gbytes_s_bidir / 2 * 8 if nvlink_gbytes_s_bidir else pcie_gbps
    return GpuSpec(
        name=name,
        mem_bytes=int(mem_gb * GIB),
        peak_tflops=tflops,
        mem_bandwidth_gbytes_s=mem_bw,
        intra_node_gbps=intra,
        pcie_gbps=pcie_gbps,
        nvlink=nvlink_gbytes_s_bidir is not None,
        description=description,
    )


CATALOG: dict[str, GpuSpec] = {
    s.name: s
    for s in (
        _spec("V100-16", 16, 125.0, 900.0, 300.0, 3, "NVIDIA V100 SXM2 16GB"),
        _spec("V100-32", 32, 125.0, 900.0, 300.0, 3, "NVIDIA V100 SXM2 32GB"),
        _spec("A100-40", 40, 312.0, 1555.0, 600.0, 4, "NVIDIA A100 SXM4 40GB"),
        _spec("A100-80", 80, 312.0, 2039.0, 600.0, 4, "NVIDIA A100 SXM4 80GB"),
        _spec("A10G", 24, 70.0, 600.0, None, 4, "NVIDIA A10G (AWS G5)"),
        _spec("L4", 24, 121.0, 300.0, None, 4, "NVIDIA L4"),
        _spec("L40S", 48, 362.0, 864.0, None, 4, "NVIDIA L40S"),
        _spec("T4", 16, 65.0, 320.0, None, 3, "NVIDIA T4"),
        _spec("RTX-2080", 8, 40.3, 448.0, None, 3, "NVIDIA GeForce RTX 2080"),
        _spec("Titan-RTX", 24, 130.0, 672.0, None, 3, "NVIDIA Titan RTX"),
        _spec("RTX-3090", 24, 71.0, 936.0, None, 4, "NVIDIA GeForce RTX 3090"),
        _spec("RTX-4090", 24, 165.2, 1008.0, None, 4, "NVIDIA GeForce RTX 4090"),
        _spec("H100-80", 80, 989.0, 3350.0, 900.0, 5, "NVIDIA H100 SXM5 80GB"),
        _spec("H200-141", 141, 989.0, 4800.0, 900.0, 5, "NVIDIA H200 SXM 141GB"),
        _spec("GH-96", 96, 989.0, 4000.0, 900.0, 5, "NVIDIA GH200 Grace Hopper 96GB HBM3"),
    )
}
# Sailor measured an RTX 2080 with 11 GB (the 2080 Ti); keep its memory as measured.
CATALOG["RTX-2080"] = GpuSpec(
    **{**{f: getattr(CATALOG["RTX-2080"], f) for f in GpuSpec.__slots__}, "mem_bytes": 11 * GIB}
)
CATALOG["cpu"] = GpuSpec(
    name="cpu",
    mem_bytes=4 * GIB,
    peak_tflops=0.2,
    mem_bandwidth_gbytes_s=20.0,
    # gloo between two worker processes over loopback TCP: ~0.5 GB/s (a 5 MB gradient
    # all-reduce of the demo's data-parallel plan took 13-15 ms on the quiet machine).
    intra_node_gbps=4.0 / SHARED,
    pcie_gbps=4.0 / SHARED,
    nvlink=False,
    # A layer of the stand-in's small models on one thread (the launcher sets
    # OMP_NUM_THREADS=1 per device) reaches ~40 GFLOP/s, a fifth of the core's peak
    # (the probe's llama-tiny block and head at micro-batch 8 in thread CPU time, and
    # the runtime's data-parallel steps on the quiet machine: small GEMMs, attention
    # and elementwise ops that wait on memory); shared, as the fixed costs (SHARED).
    matmul_efficiency=0.2 / SHARED,
    # A worker process's resident memory before any model: the interpreter, torch and
    # its libraries, gloo buffers (measured peak RSS of a tiny model: 330-400 MiB).
    runtime_reserve_bytes=512 * (1 << 20),
    description="a group of CPU cores acting as one device (fp32)",
    fixed=CPU_FIXED,
)

_ALIASES = {
    "h100": "H100-80",
    "h200": "H200-141",
    "gh200": "GH-96",
    "a10g": "A10G",
    "a10": "A10G",
    "l4": "L4",
    "l40s": "L40S",
    "t4": "T4",
    "rtx3090": "RTX-3090",
    "geforcertx3090": "RTX-3090",
    "rtx4090": "RTX-4090",
    "geforcertx4090": "RTX-4090",
    "rtx2080": "RTX-2080",
    "rtx2080ti": "RTX-2080",
    "geforcertx2080ti": "RTX-2080",
    "titanrtx": "Titan-RTX",
    "cpu": "cpu",
    "v100": "V100-16",
    "a100": "A100-40",
}


def _squash(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def canonical_gpu_name(raw: str) -> str:
    """Map common spellings to the canonical short name.

    Accepts the canonical names, ``A100-40GB``, ``a100_40g``, and what
    nvidia-smi prints (``NVIDIA A100-SXM4-40GB``, ``Tesla V100-SXM2-32GB``).
    """
    if raw in CATALOG:
        return raw
    text = _squash(raw)
    for prefix in ("nvidia", "tesla"):
        text = text.removeprefix(prefix)
    text = re.sub(r"(sxm\d?|pcie|nvl|hbm\d?e?)", "", text)
    text = text.removesuffix("gb").removesuffix("g")
    for name in CATALOG:
        if _squash(name) == text:
            return name
    if text in _ALIASES:
        return _ALIASES[text]
    m = re.fullmatch(r"(a100|v100|h100|h200|gh200)(\d+)", text)
    if m:
        base = {"a100": "A100", "v100": "V100", "h100": "H100", "h200": "H200", "gh200": "GH"}
        candidate = f"{base[m.group(1)]}-{m.group(2)}"
        if candidate in CATALOG:
            return candidate
    raise UnknownNameError(unknown_gpu_message(raw))


# What every "unknown GPU type" error shows: a cluster file's gpu_types: entry.
GPU_TYPES_EXAMPLE = (
    "gpu_types: {A6000: {mem_gb: 48, peak_tflops: {bf16: 154.8, fp16: 154.8, fp32: 38.7}, "
    "mem_bandwidth_gbytes_s: 768}}"
)


def unknown_gpu_message(raw: str, defined: Iterable[str] = ()) -> str:
    """The way forward for a type nobody knows: near misses, the known names, and
    how to define the type (a hand-written cluster file is where users meet this)."""
    names = sorted({*CATALOG, *defined}, key=str.lower)
    by_lower = {n.lower(): n for n in names}
    close = difflib.get_close_matches(raw.lower(), list(by_lower), n=1, cutoff=0.75)
    hint = f"did you mean {' or '.join(by_lower[c] for c in close)}? " if close else ""
    return (
        f"unknown GPU type {raw!r}; {hint}known types: {', '.join(names)}. "
        f"To use another card, define it in the cluster file, e.g. {GPU_TYPES_EXAMPLE} "
        "(example: profiles/clusters/custom-types.yaml); `autohet profile run` then measures it"
    )


def gpu_spec(name: str) -> GpuSpec:
    return CATALOG[canonical_gpu_name(name)]
