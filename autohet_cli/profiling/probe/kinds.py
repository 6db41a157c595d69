"""Each layer kind at each TP degree and micro-batch size: the probe's main loop body.

For one (TP degree, kind) this builds the shard once, times its optimizer step,
then each micro-batch size from the smallest, adding the kind's TP all-reduces
to its compute times. The time budget is shared out in proportion to each
measurement's estimated cost (from the measured GEMM rate and bandwidth), so
that a big model's blocks do not starve its norms of repeats. Running out of
memory ends the sizes above the one that failed: they are reported ``oom``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .comm import comm_ms, comm_plan
from .layers import time_layer
from .memory import free, is_oom, rough_bytes
from .shards import build_shard, shard_params, shard_problem
from .timing import Budget
from .update import measure_update


@dataclass
class Ctx:
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


def iter_cost_s(kind: str, s: dict[str, Any], tp: int, mbs: int, ctx: Ctx) -> float:
    """Estimated seconds of one forward and backward, to share the budget out."""
    tokens, h = mbs * ctx.seq, int(s["hidden_size"])
    flops = 0.0
    if kind == "block":
        flops = 2 * tokens * shard_params(kind, s, tp) + 4 * tokens * ctx.seq * h / tp
    elif kind == "head":
        flops = 2 * tokens * shard_params(kind, s, tp)
    moved = tokens * h * ctx.nbytes * 8
    return 3 * flops / ctx.flops_s + moved / ctx.bytes_s + _OVERHEAD_S


def update_cost_s(kind: str, s: dict[str, Any], tp: int, ctx: Ctx) -> float:
    """Estimated seconds of one Adam step over the shard (memory-bound)."""
    return shard_params(kind, s, tp) * 30 / ctx.bytes_s + _OVERHEAD_S


def time_kind(
    kind: str, s: dict[str, Any], tp: int, ctx: Ctx, budget: Budget
) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """Per micro-batch size, one kind's shard at ``tp``; and its optimizer step."""
    mbss = ctx.spec["micro_batch_sizes"]
    problem = shard_problem(kind, s, tp)
    if problem is not None:
        budget.done(update_cost_s(kind, s, tp, ctx))
        for mbs in mbss:
            budget.done(iter_cost_s(kind, s, tp, mbs, ctx))
        return {m: {"status": "skipped", "reason": problem} for m in mbss}, {"status": "skipped"}
    module = None
    cost = update_cost_s(kind, s, tp, ctx)
    # Weights, gradients and Adam's fp32 state: a CPU host must never be pushed into swap.
    state_bytes = shard_params(kind, s, tp) * (2 * ctx.nbytes + 16)
    try:
        if ctx.dev.type == "cpu" and state_bytes > ctx.mem_bytes:
            raise MemoryError(f"shard and optimizer state predicted at {state_bytes:.3g} bytes")
        module = build_shard(kind, s, tp, ctx.dev, ctx.dtype)
        timed = measure_update(module, ctx.dev, ctx.dtype, budget.share_s(cost), 5)
        update = {"status": "ok", **timed}
    except Exception as exc:  # noqa: BLE001 - only out-of-memory is expected here
        if not is_oom(exc):
            raise
        update = {"status": "oom", "reason": _short(exc)}
    budget.done(cost)
    free(ctx.dev)
    by_mbs: dict[int, dict[str, Any]] = {}
    oom_reason = "" if module is not None else f"the shard alone: {update.get('reason')}"
    for mbs in mbss:
        cost = iter_cost_s(kind, s, tp, mbs, ctx)
        if not oom_reason and ctx.dev.type == "cpu":
            if rough_bytes(kind, s, tp, mbs, ctx.seq, ctx.nbytes) > ctx.mem_bytes:
                oom_reason = f"mbs {mbs} predicted to exceed the CPU device memory"
        if oom_reason or module is None:
            by_mbs[mbs] = {"status": "oom", "reason": oom_reason}
        else:
            by_mbs[mbs] = _time_one(kind, module, s, tp, mbs, ctx, budget.share_s(cost))
            oom_reason = by_mbs[mbs].get("reason", "")
        budget.done(cost)
    del module
    free(ctx.dev)
    return by_mbs, update


def _time_one(
    kind: str, module: nn.Module, s: dict[str, Any], tp: int, mbs: int, ctx: Ctx, share_s: float
) -> dict[str, Any]:
    warmup, repeat = int(ctx.spec["warmup"]), int(ctx.spec["repeat"])
    reason = ""
    try:
        r = time_layer(kind, module, s, mbs, ctx.seq, ctx.dev, ctx.dtype, warmup, repeat, share_s)
    except Exception as exc:  # noqa: BLE001 - only out-of-memory is expected here
        if not is_oom(exc):
            raise
        reason = f"mbs {mbs}: {_short(exc)}"
    if reason:  # outside the handler, so that the traceback's tensors can be freed
        module.zero_grad(set_to_none=True)
        free(ctx.dev)
        return {"status": "oom", "reason": reason}
    comm = comm_ms(comm_plan(kind, s, mbs, ctx.seq, ctx.nbytes), ctx.tp_comm.get(str(tp)))
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


def _short(exc: BaseException) -> str:
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"
