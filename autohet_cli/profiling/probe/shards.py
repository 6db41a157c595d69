"""One TP rank's shard of each layer kind, built as the runtime builds the layer.

The probe times a shard, not a whole layer: at TP degree t a block keeps heads/t
and ffn/t (Megatron's column/row split), an embedding or a head vocab/t rows,
and norms stay whole. Its parameters are counted exactly as the model zoo counts
them at TP 1, so autohet can check the measurement against the model. Shapes
that do not split ``t`` ways are reported (``shard_problem``), never timed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .loss import CHUNK_LOGIT_BYTES, ChunkedLoss


class _RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(kind: str, h: int) -> nn.Module:
    """The model's norm: ``rmsnorm`` or else a LayerNorm."""
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
        self.norm1 = make_norm(s["norm"], h)
        self.qkv = nn.Linear(h, (self.nh + 2 * self.nkv) * self.hd, bias=bool(s["qkv_bias"]))
        self.proj = nn.Linear(self.nh * self.hd, h, bias=False)  # row-parallel
        self.norm2 = make_norm(s["norm"], h)
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
    runtime's head takes it (``ChunkedLoss``)."""

    def __init__(self, s: dict[str, Any], tp: int) -> None:
        super().__init__()
        e, h = int(s["embed_dim"]), int(s["hidden_size"])
        self.norm = make_norm(s["norm"], h) if s["final_norm"] else None
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
        total = ChunkedLoss.apply(flat, self.out.weight, targets.flatten(), step)  # type: ignore[no-untyped-call]
        return torch.as_tensor(total) / flat.shape[0]


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
    """``kind``'s shard at ``tp`` on ``dev`` in ``dtype``, initialised as for training."""
    make: Callable[[], nn.Module]
    if kind == "block":
        make = lambda: _Block(s, tp)  # noqa: E731
    elif kind == "embedding":
        make = lambda: _Embedding(s, tp)  # noqa: E731
    elif kind == "head":
        make = lambda: _Head(s, tp)  # noqa: E731
    else:
        make = lambda: make_norm(s["norm"], int(s["hidden_size"]))  # noqa: E731
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


def shard_params(kind: str, s: dict[str, Any], tp: int) -> float:
    """About how many parameters ``kind``'s shard at ``tp`` has, from its shape alone
    (before one is built: to share the budget out, to foresee memory, to size messages)."""
    h = int(s["hidden_size"])
    if kind == "block":
        kv = int(s["num_kv_heads"]) * h // int(s["num_heads"])
        mlp = (3 if s["gated_mlp"] else 2) * h * int(s["ffn_hidden_size"])
        return (2 * h * h + 2 * h * kv + mlp) / tp
    if kind in ("embedding", "head"):
        return int(s["vocab_size"]) * int(s["embed_dim"]) / tp + h * int(s.get("num_positions", 0))
    return h
