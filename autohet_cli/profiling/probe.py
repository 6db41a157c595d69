"""autohet probe: time a model's layers on this host's accelerator (self-contained).

``autohet profile run`` copies this one file to each host and runs

    python probe.py --spec spec.json --out result.json

(or ``python -m autohet_cli.profiling.probe`` where autohet is installed). It imports
only the standard library and torch, so that it runs on any host with torch.

The spec (``autohet.probe-spec/v1``, written by ``autohet_cli.profiling.measure``)
gives the shapes of each distinct kind of partitionable layer (embedding, block,
final norm, head), the sequence length, the tensor-parallel degrees and micro-batch
sizes to measure, the dtype, warmup/repeat counts and a time budget. The result
(``autohet.probe-result/v1``) holds:

- host facts and the accelerator inventory (torch, and nvidia-smi when present);
  without a GPU the CPU is one device of type ``cpu`` with min(RAM/2, 8 GiB);
- square-GEMM TFLOP/s at the training dtype and copy bandwidth GB/s (medians);
- per TP degree t > 1, all-reduce milliseconds for each message size the layers
  send: a real all-reduce between t local processes (NCCL over t GPUs, gloo on
  the CPU) when possible, else estimated from the copy bandwidth (and it says so);
- per (t, micro-batch size) and layer kind: forward and backward ms of one TP
  rank's shard (heads/t, ffn/t, vocab/t; Megatron column/row split) plus that
  kind's TP all-reduces, the shard's parameters, the bytes it keeps for backward
  (unique storages seen by ``saved_tensors_hooks``, parameters excluded) and the
  bytes it sends on; ``oom`` where it ran out of memory;
- per (t, layer kind), the Adam step on fp32 master weights in ms;
- a training iteration over 1, 2 and 4 norm layers, for ``fixedfit`` to fit what an
  iteration costs beyond its layers (the loss, the clip, the optimizer's launches).

Times are medians; repeats drop (never below one) to stay within the budget.
Runs on Python >= 3.8 with torch >= 2.0, whatever the host has.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

PROBE_VERSION = "1.2"  # 1.1: layers also timed under recomputation; 1.2: fixed costs
SPEC_SCHEMA = "autohet.probe-spec/v1"
RESULT_SCHEMA = "autohet.probe-result/v1"
KINDS = ("embedding", "block", "norm", "head")
GIB = 1 << 30
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SHAPE_KEYS = {
    "embedding": ("vocab_size", "embed_dim", "hidden_size", "num_positions"),
    "block": (
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "ffn_hidden_size",
        "gated_mlp",
        "norm",
        "bias",
        "qkv_bias",
        "rotary",
    ),
    "norm": ("hidden_size", "norm"),
    "head": ("vocab_size", "embed_dim", "hidden_size", "final_norm", "norm"),
}
_SPEC_DEFAULTS: dict[str, Any] = {
    "dtype": "auto",
    "device": "auto",
    "warmup": 2,
    "repeat": 10,
    "time_budget_s": None,  # auto: 600 s on a GPU, 8 s on the CPU
    "cpu_threads": None,
    "comm": "auto",
}


class SpecError(ValueError):
    """The spec file is malformed (the message names the field)."""


class _Budget:
    """Wall-clock budget, shared out over the measurements still to do in proportion
    to their estimated cost (seconds per iteration), so each gets similar repeats."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.perf_counter() + seconds
        self.cost_left = 0.0
        self.exceeded = False

    def left_s(self) -> float:
        left = self.deadline - time.perf_counter()
        if left <= 0:
            self.exceeded = True
        return max(0.0, left)

    def fraction_s(self, fraction: float) -> float:
        return self.left_s() * fraction

    def share_s(self, cost: float) -> float:
        return self.left_s() * cost / max(self.cost_left, cost, 1e-9)

    def done(self, cost: float) -> None:
        self.cost_left = max(0.0, self.cost_left - cost)


# --- spec -------------------------------------------------------------------------------------


def check_spec(raw: Any) -> dict[str, Any]:
    """The spec with defaults filled in; SpecError naming the field when malformed."""
    if not isinstance(raw, dict):
        raise SpecError("spec: expected a JSON object")
    if raw.get("schema") != SPEC_SCHEMA:
        raise SpecError(f"spec.schema: expected {SPEC_SCHEMA!r}, got {raw.get('schema')!r}")
    required = ("model", "seq_len", "tensor_parallel", "micro_batch_sizes", "layers")
    allowed = {"schema", *required, *_SPEC_DEFAULTS}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise SpecError(f"spec: unknown key(s) {unknown} (allowed: {sorted(allowed)})")
    missing = [k for k in required if k not in raw]
    if missing:
        raise SpecError(f"spec: missing key(s) {missing}")
    spec = {**_SPEC_DEFAULTS, **raw}
    _positive_int(spec["seq_len"], "spec.seq_len")
    for key in ("tensor_parallel", "micro_batch_sizes"):
        values = spec[key]
        if not isinstance(values, list) or not values:
            raise SpecError(f"spec.{key}: expected a non-empty list of positive integers")
        for i, v in enumerate(values):
            _positive_int(v, f"spec.{key}[{i}]")
        spec[key] = sorted(set(values))
    if spec["dtype"] not in ("auto", *_DTYPES):
        raise SpecError(f"spec.dtype: expected auto, fp32, bf16 or fp16, got {spec['dtype']!r}")
    if spec["comm"] not in ("auto", "copy"):
        raise SpecError(f"spec.comm: expected auto or copy, got {spec['comm']!r}")
    _positive_int(spec["warmup"], "spec.warmup", minimum=0)
    _positive_int(spec["repeat"], "spec.repeat")
    if spec["cpu_threads"] is not None:
        _positive_int(spec["cpu_threads"], "spec.cpu_threads")
    budget = spec["time_budget_s"]
    number = isinstance(budget, (int, float)) and not isinstance(budget, bool)  # noqa: UP038
    if budget is not None and (not number or budget <= 0):
        raise SpecError(f"spec.time_budget_s: expected a positive number, got {budget!r}")
    layers = spec["layers"]
    if not isinstance(layers, dict) or not layers:
        raise SpecError("spec.layers: expected an object {kind: shape}")
    for kind, shape in layers.items():
        if kind not in _SHAPE_KEYS:
            raise SpecError(f"spec.layers: unknown layer kind {kind!r} (known: {KINDS})")
        if not isinstance(shape, dict):
            raise SpecError(f"spec.layers.{kind}: expected an object")
        absent = [k for k in _SHAPE_KEYS[kind] if k not in shape]
        if absent:
            raise SpecError(f"spec.layers.{kind}: missing key(s) {absent}")
    return spec


def _positive_int(value: Any, at: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{at}: expected an integer >= {minimum}, got {value!r}")


# --- host facts -------------------------------------------------------------------------------


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _ram_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _nvidia_smi() -> dict[str, Any] | None:
    out = _run(
        [
            "nvidia-smi",
            "--query-gpu=index,name,memory.total,driver_version",
            "--format=csv,noheader,nounits",
        ]
    )
    if out is None:
        return None
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        index, name, mem_mib, driver = parts
        with contextlib.suppress(ValueError):
            gpus.append(
                {
                    "index": int(index),
                    "name": name,
                    "mem_bytes": int(float(mem_mib)) << 20,
                    "driver": driver,
                }
            )
    return {"gpus": gpus, "topology": _run(["nvidia-smi", "topo", "-m"])}


def host_facts(smi: dict[str, Any] | None) -> dict[str, Any]:
    driver = smi["gpus"][0]["driver"] if smi and smi["gpus"] else None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver,
        "cpu_name": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "usable_cores": _usable_cores(),
        "ram_bytes": _ram_bytes(),
    }


def gpu_inventory() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "index": i,
                "name": props.name,
                "mem_bytes": int(props.total_memory),
                "capability": f"{props.major}.{props.minor}",
            }
        )
    return gpus


def pick_device(spec: dict[str, Any], gpus: list[dict[str, Any]]) -> torch.device:
    wanted = spec["device"]
    if wanted == "auto":
        return torch.device("cuda", 0) if gpus else torch.device("cpu")
    dev = torch.device(wanted)
    if dev.type == "cuda" and (dev.index or 0) >= len(gpus):
        raise SpecError(f"spec.device: {wanted!r} but this host has {len(gpus)} GPU(s)")
    return dev if dev.type == "cpu" or dev.index is not None else torch.device("cuda", 0)


def pick_dtype(spec: dict[str, Any], dev: torch.device) -> str:
    if spec["dtype"] != "auto":
        return str(spec["dtype"])
    if dev.type == "cpu":
        return "fp32"
    try:
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.4
        native = torch.cuda.get_device_capability(dev)[0] >= 8
    return "bf16" if native else "fp16"


def device_facts(dev: torch.device, gpus: list[dict[str, Any]], ram: int | None) -> dict[str, Any]:
    threads = torch.get_num_threads()
    if dev.type == "cuda":
        gpu = gpus[dev.index or 0]
        return {
            "type": "cuda",
            "index": gpu["index"],
            "name": gpu["name"],
            "mem_bytes": gpu["mem_bytes"],
            "cores": None,
            "threads": threads,
        }
    mem = min((ram or 16 * GIB) // 2, 8 * GIB)
    return {
        "type": "cpu",
        "index": None,
        "name": "cpu",
        "model": _cpu_name(),
        "mem_bytes": mem,
        "cores": _usable_cores(),
        "threads": threads,
        "mem_note": "min(RAM/2, 8 GiB)",
    }


# --- timing primitives ------------------------------------------------------------------------


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median_ms(fn: Callable[[], object], dev: torch.device, warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeat)):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _repeats(once_s: float, share_s: float, wanted: int) -> int:
    return max(1, min(wanted, int(share_s / max(once_s, 1e-6))))


def measure_matmul(dev: torch.device, dtype: torch.dtype, budget: _Budget) -> dict[str, Any]:
    n = 4096 if dev.type == "cuda" else 1024
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    once = _median_ms(lambda: a @ b, dev, 1, 1) / 1e3
    if dev.type == "cpu" and once > 0.5:  # a slow CPU: a smaller GEMM suffices
        n = 512
        a, b = a[:n, :n].contiguous(), b[:n, :n].contiguous()
        once /= 8
    repeat = max(3, _repeats(once, budget.fraction_s(0.03), 20 if dev.type == "cuda" else 5))
    ms = _median_ms(lambda: a @ b, dev, 1, repeat)
    return {"n": n, "repeat": repeat, "ms": ms, "tflops": 2 * n**3 / (ms / 1e3) / 1e12}


def measure_bandwidth(dev: torch.device, budget: _Budget) -> dict[str, Any]:
    nbytes = (256 if dev.type == "cuda" else 64) << 20
    src = torch.ones(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    once = _median_ms(lambda: dst.copy_(src), dev, 1, 1) / 1e3
    repeat = max(3, _repeats(once, budget.fraction_s(0.02), 10))
    ms = _median_ms(lambda: dst.copy_(src), dev, 1, repeat)
    # A copy reads and writes every byte.
    return {"nbytes": nbytes, "repeat": repeat, "ms": ms, "gbytes_s": 2 * nbytes / (ms / 1e3) / 1e9}


def measure_peer_copy() -> float | None:
    """GB/s of a cuda:0 -> cuda:1 copy, or None with fewer than two GPUs."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    nbytes = 64 << 20
    src = torch.ones(nbytes // 4, device="cuda:0")
    dst = torch.empty(nbytes // 4, device="cuda:1")

    def copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize(1)

    ms = _median_ms(copy, torch.device("cuda", 0), 2, 10)
    return nbytes / (ms / 1e3) / 1e9


# --- TP all-reduce ----------------------------------------------------------------------------


def _allreduce_worker(
    rank: int, world: int, backend: str, init_file: str, sizes: list[int], repeat: int, out: str
) -> None:
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = {}
        for nbytes in sizes:
            x = torch.ones(max(1, nbytes // 4), device=dev)
            times = []
            for i in range(3 + repeat):
                dist.barrier()
                _sync(dev)
                t0 = time.perf_counter()
                dist.all_reduce(x)
                _sync(dev)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            result[str(nbytes)] = statistics.median(times) * 1e3
        if rank == 0:
            with open(out, "w", encoding="utf-8") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _real_allreduce(backend: str, world: int, sizes: list[int], repeat: int) -> dict[str, float]:
    """Median ms per message size of an all-reduce among ``world`` local processes."""
    import multiprocessing

    from torch.multiprocessing.spawn import start_processes

    fork = backend == "gloo" and "fork" in multiprocessing.get_all_start_methods()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        args = (world, backend, os.path.join(tmp, "rdzv"), sizes, repeat, out)
        ctx = start_processes(  # type: ignore[no-untyped-call]
            _allreduce_worker,
            args=args,
            nprocs=world,
            join=False,
            start_method="fork" if fork else "spawn",
        )
        deadline = time.perf_counter() + (60 if fork else 300)
        while not ctx.join(timeout=1):
            if time.perf_counter() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError("all-reduce workers did not finish in time")
        with open(out, encoding="utf-8") as f:
            return {str(k): float(v) for k, v in json.load(f).items()}


def measure_tp_comm(
    tp: int,
    sizes: list[int],
    dev: torch.device,
    spec: dict[str, Any],
    copy_gbytes_s: float,
    peer_gbytes_s: float | None,
    budget: _Budget,
) -> dict[str, Any]:
    """All-reduce ms for each size at TP degree ``tp``: measured, else estimated."""
    note = ""
    if spec["comm"] == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if backend == "nccl" and torch.cuda.device_count() < tp:
            note = f"this host has {torch.cuda.device_count()} GPU(s), fewer than tp {tp}; "
        elif backend == "nccl" and not _nccl_available():
            note = "torch.distributed has no NCCL here; "
        else:
            repeat = 20 if budget.left_s() > 30.0 else 5
            try:
                times = _non_decreasing(_real_allreduce(backend, tp, sizes, repeat))
                among = "GPUs" if backend == "nccl" else "processes (1 thread each)"
                return {
                    "method": f"{backend}_allreduce",
                    "allreduce_ms": times,
                    "note": f"measured: {backend} all-reduce among {tp} local {among}, "
                    "median per size, made non-decreasing in size",
                }
            except Exception as exc:  # noqa: BLE001 - any failure falls back to the estimate
                note = f"{backend} all-reduce failed ({type(exc).__name__}: {exc}); "
    gbps, what = (peer_gbytes_s, "GPU-to-GPU copy") if peer_gbytes_s else (copy_gbytes_s, "")
    what = what or f"{'device' if dev.type == 'cuda' else 'memory'} copy"
    ring = 2 * (tp - 1) / tp
    times = {str(n): ring * n / (gbps * 1e9) * 1e3 for n in sizes}
    return {
        "method": "copy_bandwidth",
        "allreduce_ms": times,
        "gbytes_s": gbps,
        "note": f"{note}estimated as a ring all-reduce at the {what} bandwidth "
        f"({gbps:.1f} GB/s), without latency",
    }


def _non_decreasing(times: dict[str, float]) -> dict[str, float]:
    """A message never takes longer than a bigger one: scheduling hiccups on a busy
    host otherwise show up as slow small all-reduces."""
    out, best = {}, math.inf
    for size in sorted(times, key=int, reverse=True):
        best = min(best, times[size])
        out[size] = best
    return out


def _nccl_available() -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_nccl_available())
    except ImportError:
        return False


# --- layer shards -----------------------------------------------------------------------------


class _RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(kind: str, h: int) -> nn.Module:
    return _RMSNorm(h) if kind == "rmsnorm" else nn.LayerNorm(h)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _Block(nn.Module):
    """One TP rank's shard of a transformer block (pre-norm, Megatron split)."""

    def __init__(self, s: dict[str, Any], tp: int) -> None:
        super().__init__()
        h, f = int(s["hidden_size"]), int(s["ffn_hidden_size"])
        self.hd = h // int(s["num_heads"])
        self.nh = int(s["num_heads"]) // tp
        self.nkv = max(1, int(s["num_kv_heads"]) // tp)
        self.gated = bool(s["gated_mlp"])
        self.rotary = bool(s["rotary"])
        self.norm1 = _norm(s["norm"], h)
        self.qkv = nn.Linear(h, (self.nh + 2 * self.nkv) * self.hd, bias=bool(s["qkv_bias"]))
        self.proj = nn.Linear(self.nh * self.hd, h, bias=False)  # row-parallel
        self.norm2 = _norm(s["norm"], h)
        self.up = nn.Linear(h, (2 if self.gated else 1) * (f // tp), bias=bool(s["bias"]))
        self.down = nn.Linear(f // tp, h, bias=False)  # row-parallel
        # Row-parallel biases are added once, after the all-reduce: whole on every rank.
        self.proj_bias = nn.Parameter(torch.zeros(h)) if s["bias"] else None
        self.down_bias = nn.Parameter(torch.zeros(h)) if s["bias"] else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, self.nh + 2 * self.nkv, self.hd)
        q, k, v = (z.transpose(1, 2) for z in qkv.split([self.nh, self.nkv, self.nkv], dim=2))
        if self.rotary:
            pos = torch.arange(t, device=x.device, dtype=torch.float32)
            inv = 1.0 / 10000 ** (torch.arange(0, self.hd, 2, device=x.device) / self.hd)
            ang = torch.outer(pos, inv).repeat(1, 2)
            cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.nkv != self.nh:
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, self.nh * self.hd))
        if self.proj_bias is not None:
            x = x + self.proj_bias
        u = self.up(self.norm2(x))
        if self.gated:
            gate, u = u.chunk(2, dim=-1)
            u = F.silu(gate) * u
        else:
            u = F.gelu(u, approximate="tanh")
        x = x + self.down(u)
        return x + self.down_bias if self.down_bias is not None else x


class _Embedding(nn.Module):
    """Vocab-parallel token embedding (vocab/t rows), whole positions and projection."""

    def __init__(self, s: dict[str, Any], tp: int) -> None:
        super().__init__()
        e, h = int(s["embed_dim"]), int(s["hidden_size"])
        self.rows = math.ceil(int(s["vocab_size"]) / tp)
        self.tok = nn.Embedding(self.rows, e)
        self.proj = nn.Linear(e, h, bias=False) if e != h else None
        npos = int(s["num_positions"])
        self.pos = nn.Embedding(npos, h) if npos else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        if self.proj is not None:
            x = self.proj(x)
        if self.pos is not None:
            where = torch.arange(ids.shape[1], device=ids.device) % self.pos.num_embeddings
            x = x + self.pos(where)
        return torch.as_tensor(x)


class _Head(nn.Module):
    """Final norm (if part of the head), projection, vocab-parallel logits and fp32 loss,
    the loss in chunks of tokens with its gradients formed in the forward, as the
    runtime's head takes it (``_ChunkedLoss``)."""

    def __init__(self, s: dict[str, Any], tp: int) -> None:
        super().__init__()
        e, h = int(s["embed_dim"]), int(s["hidden_size"])
        self.norm = _norm(s["norm"], h) if s["final_norm"] else None
        self.proj = nn.Linear(h, e, bias=False) if e != h else None
        self.rows = math.ceil(int(s["vocab_size"]) / tp)
        self.out = nn.Linear(e, self.rows, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        if self.proj is not None:
            x = self.proj(x)
        flat = x.flatten(0, 1)
        step = max(1, min(flat.shape[0], CHUNK_LOGIT_BYTES // (4 * self.rows)))
        total = _ChunkedLoss.apply(flat, self.out.weight, targets.flatten(), step)  # type: ignore[no-untyped-call]
        return torch.as_tensor(total) / flat.shape[0]


# A copy of the runtime's head loss (runtime/models/loss.py, _FusedHeadLoss), because
# this file runs alone on hosts that need not have autohet installed; the two are
# checked equal in tests/unit/test_chunked_loss.py.
CHUNK_LOGIT_BYTES = 256 * 2**20
GROUP_LOGIT_BYTES = 2**30


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Any, weight: Any, targets: Any, step: int) -> Any:
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        n = targets.numel()
        # the weight's gradient once per group of chunks, as the runtime forms it
        fit = GROUP_LOGIT_BYTES // (hidden.element_size() * weight.shape[0])
        group = max(step, min(n, fit - fit % step))
        for g0 in range(0, n, group):
            gs = []
            for start in range(g0, min(n, g0 + group), step):
                h, t = hidden[start : start + step], targets[start : start + step]
                logits = h @ weight.t()
                real = logits.float()
                lse = torch.logsumexp(real, dim=-1)
                total += (lse - real.gather(1, t[:, None]).squeeze(1)).sum()
                grad = real.sub_(lse[:, None]).exp_()
                grad[torch.arange(t.numel(), device=t.device), t] -= 1.0
                g = grad.to(logits.dtype)
                del logits, real, grad
                grad_h[start : start + step] = g @ weight
                gs.append(g)
            g = gs[0] if len(gs) == 1 else torch.cat(gs)
            grad_w += g.t() @ hidden[g0 : g0 + len(g)]
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: Any) -> Any:
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), (grad_w * grad_out).to(grad_h.dtype), None, None


def shard_problem(kind: str, s: dict[str, Any], tp: int) -> str | None:
    """Why ``kind`` cannot be split ``tp`` ways, or None."""
    if kind != "block" or tp == 1:
        return None
    heads, kv, ffn = int(s["num_heads"]), int(s["num_kv_heads"]), int(s["ffn_hidden_size"])
    if heads % tp:
        return f"{heads} attention heads do not split {tp} ways"
    if ffn % tp:
        return f"ffn size {ffn} does not split {tp} ways"
    if (kv % tp if kv >= tp else tp % kv) or (heads // tp) % max(1, kv // tp):
        return f"{kv} key/value heads do not split (or replicate) {tp} ways"
    return None


def build_shard(
    kind: str, s: dict[str, Any], tp: int, dev: torch.device, dtype: torch.dtype
) -> nn.Module:
    make: Callable[[], nn.Module]
    if kind == "block":
        make = lambda: _Block(s, tp)  # noqa: E731
    elif kind == "embedding":
        make = lambda: _Embedding(s, tp)  # noqa: E731
    elif kind == "head":
        make = lambda: _Head(s, tp)  # noqa: E731
    else:
        make = lambda: _norm(s["norm"], int(s["hidden_size"]))  # noqa: E731
    with dev:  # initialised where it runs (a meta device would load torch's decompositions)
        module = make()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # norm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return module.to(dtype)


def _rough_bytes(kind: str, s: dict[str, Any], tp: int, mbs: int, seq: int, nbytes: int) -> float:
    """A generous estimate of a shard's peak memory, to avoid swapping a CPU host to death."""
    tokens = mbs * seq
    h = int(s["hidden_size"])
    if kind == "block":
        width = 8 * h + (3 * int(s["ffn_hidden_size"]) + 4 * h) / tp
        attn = mbs * int(s["num_heads"]) / tp * seq * seq * 4  # a non-flash kernel's scores
        params = (4 * h * h + 3 * h * int(s["ffn_hidden_size"])) / tp
        return tokens * width * nbytes * 3 + attn + params * nbytes * 3
    if kind in ("embedding", "head"):
        rows = int(s["vocab_size"]) / tp
        chunk = max(1, min(tokens, CHUNK_LOGIT_BYTES // (4 * rows)))
        logits = chunk * rows * 12 + rows * int(s["embed_dim"]) * 4 if kind == "head" else 0.0
        return rows * int(s["embed_dim"]) * nbytes * 3 + tokens * h * nbytes * 4 + logits
    return tokens * h * nbytes * 4


# --- layer timing -----------------------------------------------------------------------------


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def _saved_bytes(module: nn.Module, run: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``run`` and sum the unique storages autograd keeps for backward,
    leaving out the module's own parameters."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):
            return t
        if ptr and ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), int(n))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


def time_layer(
    kind: str,
    module: nn.Module,
    s: dict[str, Any],
    mbs: int,
    seq: int,
    dev: torch.device,
    dtype: torch.dtype,
    warmup: int,
    repeat: int,
    share_s: float,
) -> dict[str, Any]:
    """Forward/backward ms of one micro-batch through ``module`` (compute only),
    plain and under activation recomputation as the runtime runs a recompute stage
    (a non-reentrant ``torch.utils.checkpoint`` per layer): checkpoint's per-call
    work runs on the CPU, so on a fast GPU its forward is not the plain one and its
    backward not the plain backward plus a forward. The plain timing gets 60% of
    the share, the recomputation the rest."""
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = getattr(module, "rows", 1)
    targets = torch.randint(0, rows, (mbs, seq), device=dev, generator=gen)
    if kind == "embedding":
        x = torch.randint(0, rows, (mbs, seq), device=dev, generator=gen)
    else:
        h = int(s["hidden_size"])
        x = torch.randn(mbs, seq, h, device=dev, dtype=dtype, generator=gen).requires_grad_()

    def forward() -> torch.Tensor:
        return torch.as_tensor(module(x, targets) if kind == "head" else module(x))

    def rc_forward() -> torch.Tensor:
        if kind == "head":  # the runtime's head keeps no logits: it is never recomputed
            return forward()
        return torch.as_tensor(checkpoint(module, x, use_reentrant=False))

    grad: list[torch.Tensor] = []

    def backward(out: torch.Tensor) -> None:
        if kind == "head":
            out.backward()  # type: ignore[no-untyped-call]
        else:
            if not grad:
                grad.append(torch.randn_like(out) * 1e-2)
            out.backward(grad[0])  # type: ignore[no-untyped-call]
        if x.requires_grad:
            x.grad = None

    def iteration(fwd_fn: Callable[[], torch.Tensor] = forward) -> tuple[float, float]:
        _sync(dev)
        t0 = time.perf_counter()
        out = fwd_fn()
        _sync(dev)
        t1 = time.perf_counter()
        backward(out)
        _sync(dev)
        return t1 - t0, time.perf_counter() - t1

    def medians(
        fwd_fn: Callable[[], torch.Tensor], until_s: float, once: float | None = None
    ) -> tuple[float, float, int]:
        """Median forward and backward ms until ``until_s``; ``once``: the seconds of
        a first iteration already run (else one is run here: slower than steady state)."""
        if once is None:
            once = sum(iteration(fwd_fn))
        for _ in range(warmup):  # as many as the share allows beside one timed iteration
            if once * 2 > until_s - time.perf_counter():
                break
            once = sum(iteration(fwd_fn))
        times = [
            iteration(fwd_fn) for _ in range(_repeats(once, until_s - time.perf_counter(), repeat))
        ]
        return (
            statistics.median(t[0] for t in times) * 1e3,
            statistics.median(t[1] for t in times) * 1e3,
            len(times),
        )

    start = time.perf_counter()
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    out, act_bytes = _saved_bytes(module, forward)
    alloc_delta = torch.cuda.memory_allocated(dev) - before if dev.type == "cuda" else None
    output_bytes = 0 if kind == "head" else out.numel() * out.element_size()
    backward(out)
    del out
    _sync(dev)
    once = time.perf_counter() - start  # the hooked first run: the plain timing's warm-up
    fwd, bwd, reps = medians(forward, start + 0.6 * share_s, once)
    rc_fwd, rc_bwd, _ = medians(rc_forward, start + share_s)
    module.zero_grad(set_to_none=True)
    return {
        "compute_fwd_ms": fwd,
        "compute_bwd_ms": bwd,
        "compute_recompute_fwd_ms": rc_fwd,
        "compute_recompute_bwd_ms": rc_bwd,
        "repeat": reps,
        "num_params": sum(p.numel() for p in module.parameters()),
        "act_bytes": act_bytes,
        "output_bytes": output_bytes,
        "cuda_alloc_delta_bytes": alloc_delta,
    }


def _adam(params: list[nn.Parameter], dtype: torch.dtype) -> Callable[[], None]:
    """An Adam step over fp32 master copies of ``params`` (plus the copy back to 16 bits),
    written with the ``torch._foreach_*`` kernels ``torch.optim.Adam(foreach=True)`` runs,
    because importing torch.optim loads torch._dynamo (seconds on a small host). Its
    gradients are constants: the step's time does not depend on their values."""
    with torch.no_grad():
        master = [p.detach().float().clone() for p in params]
        grads = [torch.full_like(m, 1e-3) for m in master]
        exp_avg = [torch.zeros_like(m) for m in master]
        exp_sq = [torch.zeros_like(m) for m in master]
    lr, beta1, beta2, eps = 1e-4, 0.9, 0.999, 1e-8

    @torch.no_grad()
    def step() -> None:
        torch._foreach_mul_(exp_avg, beta1)
        torch._foreach_add_(exp_avg, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_sq, beta2)
        torch._foreach_addcmul_(exp_sq, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(exp_sq)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(master, exp_avg, denom, value=-lr)
        if dtype != torch.float32:
            for p, m in zip(params, master):  # noqa: B905 - Python 3.8 has no strict=
                p.copy_(m)

    return step


def measure_update(
    module: nn.Module, dev: torch.device, dtype: torch.dtype, share_s: float, repeat: int
) -> dict[str, Any]:
    """One Adam step over the shard's fp32 master weights (``_adam``)."""
    step = _adam(list(module.parameters()), dtype)
    once = 0.0
    for _ in range(3):  # the first steps allocate the state and initialise lazily
        start = time.perf_counter()
        step()
        _sync(dev)
        once = time.perf_counter() - start
    reps = _repeats(once, share_s - once, repeat)
    return {"ms": _median_ms(step, dev, 0, reps), "repeat": reps}


# --- fixed costs ------------------------------------------------------------------------------

_ITERATION_LAYERS = (1, 2, 4)  # norm layers per training iteration


def _iteration(
    s: dict[str, Any], k: int, dev: torch.device, dtype: torch.dtype, seq: int
) -> Callable[[], object]:
    """A training iteration over ``k`` norm layers of the model's width, as the runtime
    runs one: gradients reset, forward and a loss, backward, the clip's global norm
    and scaling, an Adam step, the loss read back to the host."""
    layers = nn.Sequential(*[_norm(str(s["norm"]), int(s["hidden_size"])) for _ in range(k)])
    layers = layers.to(device=dev, dtype=dtype)
    params = list(layers.parameters())
    adam = _adam(params, dtype)
    x = torch.randn(1, seq, int(s["hidden_size"]), device=dev, dtype=dtype)

    def run() -> float:
        for p in params:
            p.grad = None
        loss = layers(x).float().pow(2).mean()
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()
        coef = (1.0 / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        adam()
        return float(loss.item())

    return run


def measure_fixed(
    spec: dict[str, Any], dev: torch.device, dtype: torch.dtype, budget: _Budget
) -> dict[str, Any]:
    """A training iteration's medians over 1, 2 and 4 norm layers, for ``fixedfit`` to
    fit its cost beyond its layers. The sizes are timed in turns, round after round,
    so that a busy spell of the host slows each of them alike instead of tilting the
    line. (One op's host time needs no run of its own: ``fixedfit`` reads it from the
    block's times at several micro-batch sizes.)"""
    block = spec["layers"].get("block") or spec["layers"].get("norm")
    if block is None:  # an embedding and a head alone: no norm of the model's width
        return {"iteration_ms": {}}
    seq = min(int(spec["seq_len"]), 128)  # the iteration's fixed part, not its work
    runs = {
        "iteration_ms": {str(k): _iteration(block, k, dev, dtype, seq) for k in _ITERATION_LAYERS}
    }
    times: dict[str, dict[str, list[float]]] = {g: {w: [] for w in r} for g, r in runs.items()}

    def one_round() -> None:
        for group, by_work in runs.items():
            for work, run in by_work.items():
                times[group][work].append(_median_ms(run, dev, 0, 1))

    start = time.perf_counter()
    one_round()  # warm-up: first calls allocate and initialise lazily
    once = time.perf_counter() - start
    for group in times.values():
        for found in group.values():
            found.clear()
    for _ in range(max(3, _repeats(once, budget.fraction_s(0.03), 15))):
        one_round()
    return {g: {w: statistics.median(t) for w, t in by.items()} for g, by in times.items()}


def _comm_plan(
    kind: str, s: dict[str, Any], mbs: int, seq: int, nbytes: int
) -> dict[str, list[int]]:
    """Message sizes of the Megatron all-reduces of one kind's shard, per pass."""
    tokens = mbs * seq
    act = tokens * int(s["hidden_size"]) * nbytes
    if kind == "block":  # after attention and after the MLP; their mirrors in backward
        return {"fwd": [act, act], "bwd": [act, act]}
    if kind == "embedding":  # the vocab-parallel lookup's partial sums
        return {"fwd": [act], "bwd": []}
    if kind == "head":  # vocab-parallel cross-entropy: max, sum, target logit; input grads
        return {"fwd": [tokens * 4] * 3, "bwd": [tokens * int(s["embed_dim"]) * nbytes]}
    return {"fwd": [], "bwd": []}


def _free(dev: torch.device) -> None:
    if dev.type == "cuda":  # a full collection costs ~0.1 s: only where memory is tight
        import gc

        gc.collect()
        torch.cuda.empty_cache()


@dataclass
class _Ctx:
    """What every layer measurement needs to know."""

    spec: dict[str, Any]
    dev: torch.device
    dtype: torch.dtype
    mem_bytes: int
    flops_s: float  # measured GEMM rate
    bytes_s: float  # measured copy bandwidth
    tp_comm: dict[str, Any]
    log: Callable[[str], None]

    @property
    def seq(self) -> int:
        return int(self.spec["seq_len"])

    @property
    def nbytes(self) -> int:
        return torch.finfo(self.dtype).bits // 8


_OVERHEAD_S = 1e-3  # per iteration: Python, autograd and small kernels


def _shard_params(kind: str, s: dict[str, Any], tp: int) -> float:
    h = int(s["hidden_size"])
    if kind == "block":
        kv = int(s["num_kv_heads"]) * h // int(s["num_heads"])
        mlp = (3 if s["gated_mlp"] else 2) * h * int(s["ffn_hidden_size"])
        return (2 * h * h + 2 * h * kv + mlp) / tp
    if kind in ("embedding", "head"):
        return int(s["vocab_size"]) * int(s["embed_dim"]) / tp + h * int(s.get("num_positions", 0))
    return h


def _iter_cost_s(kind: str, s: dict[str, Any], tp: int, mbs: int, ctx: _Ctx) -> float:
    """Estimated seconds of one forward and backward, to share the budget out."""
    tokens, h = mbs * ctx.seq, int(s["hidden_size"])
    flops = 0.0
    if kind == "block":
        flops = 2 * tokens * _shard_params(kind, s, tp) + 4 * tokens * ctx.seq * h / tp
    elif kind == "head":
        flops = 2 * tokens * _shard_params(kind, s, tp)
    moved = tokens * h * ctx.nbytes * 8
    return 3 * flops / ctx.flops_s + moved / ctx.bytes_s + _OVERHEAD_S


def _update_cost_s(kind: str, s: dict[str, Any], tp: int, ctx: _Ctx) -> float:
    return _shard_params(kind, s, tp) * 30 / ctx.bytes_s + _OVERHEAD_S


def _time_kind(
    kind: str, s: dict[str, Any], tp: int, ctx: _Ctx, budget: _Budget
) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """Per micro-batch size, one kind's shard at ``tp``; and its optimizer step."""
    mbss = ctx.spec["micro_batch_sizes"]
    problem = shard_problem(kind, s, tp)
    if problem is not None:
        budget.done(_update_cost_s(kind, s, tp, ctx))
        for mbs in mbss:
            budget.done(_iter_cost_s(kind, s, tp, mbs, ctx))
        return {m: {"status": "skipped", "reason": problem} for m in mbss}, {"status": "skipped"}
    module = None
    cost = _update_cost_s(kind, s, tp, ctx)
    # Weights, gradients and Adam's fp32 state: a CPU host must never be pushed into swap.
    state_bytes = _shard_params(kind, s, tp) * (2 * ctx.nbytes + 16)
    try:
        if ctx.dev.type == "cpu" and state_bytes > ctx.mem_bytes:
            raise MemoryError(f"shard and optimizer state predicted at {state_bytes:.3g} bytes")
        module = build_shard(kind, s, tp, ctx.dev, ctx.dtype)
        timed = measure_update(module, ctx.dev, ctx.dtype, budget.share_s(cost), 5)
        update = {"status": "ok", **timed}
    except Exception as exc:  # noqa: BLE001 - only out-of-memory is expected here
        if not _is_oom(exc):
            raise
        update = {"status": "oom", "reason": _short(exc)}
    budget.done(cost)
    _free(ctx.dev)
    by_mbs: dict[int, dict[str, Any]] = {}
    oom_reason = "" if module is not None else f"the shard alone: {update.get('reason')}"
    for mbs in mbss:
        cost = _iter_cost_s(kind, s, tp, mbs, ctx)
        if not oom_reason and ctx.dev.type == "cpu":
            if _rough_bytes(kind, s, tp, mbs, ctx.seq, ctx.nbytes) > ctx.mem_bytes:
                oom_reason = f"mbs {mbs} predicted to exceed the CPU device memory"
        if oom_reason or module is None:
            by_mbs[mbs] = {"status": "oom", "reason": oom_reason}
        else:
            by_mbs[mbs] = _time_one(kind, module, s, tp, mbs, ctx, budget.share_s(cost))
            oom_reason = by_mbs[mbs].get("reason", "")
        budget.done(cost)
    del module
    _free(ctx.dev)
    return by_mbs, update


def _time_one(
    kind: str, module: nn.Module, s: dict[str, Any], tp: int, mbs: int, ctx: _Ctx, share_s: float
) -> dict[str, Any]:
    warmup, repeat = int(ctx.spec["warmup"]), int(ctx.spec["repeat"])
    reason = ""
    try:
        r = time_layer(kind, module, s, mbs, ctx.seq, ctx.dev, ctx.dtype, warmup, repeat, share_s)
    except Exception as exc:  # noqa: BLE001 - only out-of-memory is expected here
        if not _is_oom(exc):
            raise
        reason = f"mbs {mbs}: {_short(exc)}"
    if reason:  # outside the handler, so that the traceback's tensors can be freed
        module.zero_grad(set_to_none=True)
        _free(ctx.dev)
        return {"status": "oom", "reason": reason}
    comm = _comm_ms(_comm_plan(kind, s, mbs, ctx.seq, ctx.nbytes), ctx.tp_comm.get(str(tp)))
    r.update(
        status="ok",
        comm_fwd_ms=comm["fwd"],
        comm_bwd_ms=comm["bwd"],
        fwd_ms=r["compute_fwd_ms"] + comm["fwd"],
        bwd_ms=r["compute_bwd_ms"] + comm["bwd"],
        # the re-run forward repeats the forward's all-reduces
        recompute_fwd_ms=r["compute_recompute_fwd_ms"] + comm["fwd"],
        recompute_bwd_ms=r["compute_recompute_bwd_ms"] + comm["fwd"] + comm["bwd"],
    )
    ctx.log(f"tp {tp} mbs {mbs} {kind}: fwd {r['fwd_ms']:.3f} ms, bwd {r['bwd_ms']:.3f} ms")
    return r


def _first_backward(dev: torch.device) -> None:
    """The first backward of a process imports sympy (seconds on a small host): do it
    before any layer is timed, so that no estimate of a layer's time includes it."""
    x = torch.ones(2, device=dev, requires_grad=True)
    (x * 2).sum().backward()  # type: ignore[no-untyped-call]


def _comm_ms(plan: dict[str, list[int]], comm: dict[str, Any] | None) -> dict[str, float]:
    if comm is None:
        return {"fwd": 0.0, "bwd": 0.0}
    table = comm["allreduce_ms"]
    return {p: sum(float(table[str(n)]) for n in sizes) for p, sizes in plan.items()}


def _short(exc: BaseException) -> str:
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"


def _comm_sizes(spec: dict[str, Any], kinds: list[str], nbytes: int) -> list[int]:
    seq = int(spec["seq_len"])
    return sorted(
        {
            n
            for k in kinds
            for m in spec["micro_batch_sizes"]
            for sizes in _comm_plan(k, spec["layers"][k], m, seq, nbytes).values()
            for n in sizes
        }
    )


def _grad_sizes(spec: dict[str, Any], kinds: list[str], dev: torch.device) -> list[int]:
    """Bytes of each layer kind's fp32 gradients (the runtime reduces in fp32) and
    their sum, capped to keep the probe quick: the sizes data-parallel gradient
    sync moves, so the all-reduce's latency and rate fit where it is used."""
    cap = (512 if dev.type == "cuda" else 64) << 20
    each = [int(4 * _shard_params(k, spec["layers"][k], 1)) for k in kinds]
    return sorted({min(cap, n) for n in [*each, sum(each), 1 << 20] if n > 0})


def run(raw_spec: Any, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure what ``raw_spec`` asks for on this host; the result as a JSON-ready dict."""
    say = log or (lambda _msg: None)
    spec = check_spec(raw_spec)
    seconds = spec["time_budget_s"]
    if seconds is None:
        seconds = 8.0 if spec["device"] == "cpu" or not torch.cuda.is_available() else 600.0
    budget = _Budget(float(seconds))
    if spec["cpu_threads"]:
        torch.set_num_threads(int(spec["cpu_threads"]))
    with contextlib.suppress(RuntimeError):
        torch.set_flush_denormal(True)
    smi = _nvidia_smi()
    gpus = gpu_inventory()
    dev = pick_device(spec, gpus)
    dtype_name = pick_dtype(spec, dev)
    dtype = _DTYPES[dtype_name]
    host = host_facts(smi)
    device = device_facts(dev, gpus, host["ram_bytes"])
    say(f"device {device['name']} ({dev}), dtype {dtype_name}")
    _first_backward(dev)
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
        sizes = _comm_sizes(spec, kinds, torch.finfo(dtype).bits // 8)
        if not grads_timed:  # gradient sizes too, once: autohet fits latency + rate
            sizes = sorted(set(sizes) | set(_grad_sizes(spec, kinds, dev)))
        comm = measure_tp_comm(tp, sizes, dev, spec, bandwidth["gbytes_s"], peer, budget)
        grads_timed = grads_timed or comm["method"].endswith("_allreduce")
        tp_comm[str(tp)] = comm
        say(f"tp {tp}: {comm['note']}")
    ctx = _Ctx(
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
        _update_cost_s(k, spec["layers"][k], tp, ctx)
        + sum(_iter_cost_s(k, spec["layers"][k], tp, m, ctx) for m in spec["micro_batch_sizes"])
        for tp in tps
        for k in kinds
    )
    per_kind: dict[tuple[int, str], dict[int, dict[str, Any]]] = {}
    update: dict[str, dict[str, Any]] = {str(tp): {} for tp in tps}
    for tp in tps:
        for kind in kinds:
            per_kind[tp, kind], update[str(tp)][kind] = _time_kind(
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
    layers = {k: per_kind[tp, k][mbs] for k in kinds}
    bad = {k: r for k, r in layers.items() if r["status"] != "ok"}
    if not bad:
        return {"tp": tp, "mbs": mbs, "status": "ok", "layers": layers}
    status = "oom" if any(r["status"] == "oom" for r in bad.values()) else "skipped"
    reason = "; ".join(f"{k}: {r.get('reason', r['status'])}" for k, r in bad.items())
    return {"tp": tp, "mbs": mbs, "status": status, "reason": reason, "layers": layers}


def _write_atomic(path: str, text: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".probe-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probe.py", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="spec JSON file, or - for stdin")
    parser.add_argument("--out", help="result JSON file (default: stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"probe: {msg}", file=sys.stderr, flush=True)

    try:
        if args.spec == "-":
            raw = json.load(sys.stdin)
        else:
            with open(args.spec, encoding="utf-8") as f:
                raw = json.load(f)
        result = run(raw, log)
    except (OSError, json.JSONDecodeError, SpecError) as exc:
        print(f"probe: error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        _write_atomic(args.out, text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
