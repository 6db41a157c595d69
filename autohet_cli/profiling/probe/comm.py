"""Collectives: the all-reduces a TP shard sends, and their time on this host.

A layer split ``t`` ways sends Megatron's all-reduces (``comm_plan``); the probe
adds their time to the shard's compute time, so that a TP degree's entry holds
what one rank spends. Per TP degree t > 1 the time per message size is a real
all-reduce between t local processes (NCCL over t GPUs, gloo on the CPU) when
possible, else estimated as a ring all-reduce at the copy bandwidth, and the
result says which. The sizes the data-parallel gradient sync moves are timed
too, once, so that autohet fits the all-reduce's latency and rate
(``measure.py``) where it is used.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from .shards import shard_params
from .timing import Budget, sync

# --- what the layers send ---------------------------------------------------------------------


def comm_plan(
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


def comm_ms(plan: dict[str, list[int]], comm: dict[str, Any] | None) -> dict[str, float]:
    """Milliseconds of ``plan``'s messages per pass, from a TP degree's ``measure_tp_comm``
    (None at TP 1: nothing is sent)."""
    if comm is None:
        return {"fwd": 0.0, "bwd": 0.0}
    table = comm["allreduce_ms"]
    return {p: sum(float(table[str(n)]) for n in sizes) for p, sizes in plan.items()}


def comm_sizes(spec: dict[str, Any], kinds: list[str], nbytes: int) -> list[int]:
    """Every message size the layers of ``kinds`` send at the spec's micro-batch sizes."""
    seq = int(spec["seq_len"])
    return sorted(
        {
            n
            for k in kinds
            for m in spec["micro_batch_sizes"]
            for sizes in comm_plan(k, spec["layers"][k], m, seq, nbytes).values()
            for n in sizes
        }
    )


def grad_sizes(spec: dict[str, Any], kinds: list[str], dev: torch.device) -> list[int]:
    """Bytes of each layer kind's fp32 gradients (the runtime reduces in fp32) and
    their sum, capped to keep the probe quick: the sizes data-parallel gradient
    sync moves, so the all-reduce's latency and rate fit where it is used."""
    cap = (512 if dev.type == "cuda" else 64) << 20
    each = [int(4 * shard_params(k, spec["layers"][k], 1)) for k in kinds]
    return sorted({min(cap, n) for n in [*each, sum(each), 1 << 20] if n > 0})


# --- measuring them ---------------------------------------------------------------------------


def _allreduce_worker(
    rank: int, world: int, backend: str, init_file: str, sizes: list[int], repeat: int, out: str
) -> None:
    """One of ``world`` processes timing an all-reduce of each size; rank 0 writes the
    medians to ``out``. At module level, so that a spawned worker finds it by its
    module's name (in the zipapp too: the archive is on the worker's ``sys.path``)."""
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
                sync(dev)
                t0 = time.perf_counter()
                dist.all_reduce(x)
                sync(dev)
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
    budget: Budget,
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
