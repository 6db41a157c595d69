"""LLaMA family: LLaMA-2/3/3.1, Mistral, Qwen2 and Phi-3.

Pre-RMSNorm blocks with rotary positions (LLaMA-3.1's ``llama3`` frequency
scaling and ``linear`` scaling included), grouped-query attention and a SwiGLU
MLP; Qwen2 adds biases to q, k and v. Layers follow ``ModelSpec.layers()``:
``embedding``, the blocks, ``final_norm``, ``head``; parameter names inside a
layer are HuggingFace's, so the mapping to ``LlamaForCausalLM`` & co is
mechanical. Phi-3 checkpoints fuse q/k/v (``qkv_proj``) and gate/up
(``gate_up_proj``); ``hf_sources`` maps them onto our separate projections.

Mistral's sliding window equals plain causal attention while ``seq_len`` is at
most the window; longer sequences are refused (``common_problems``).

Tensor parallelism (Megatron): q/k/v and gate/up are column-parallel, o and
down row-parallel; heads split across TP ranks in contiguous blocks, which keeps
each query head with its key/value head (query head j uses kv head
j // (heads / kv_heads)), so num_heads and num_kv_heads must both divide by the
TP degree. Embedding and head are split over the padded vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from autohet_cli.models import ModelSpec
from autohet_cli.runtime.model_api import ModelRequest
from autohet_cli.runtime.models import common
from autohet_cli.runtime.models.common import FinalNorm, Head, HFSource, activation, embedding

RESIDUAL = ("o_proj.weight", "down_proj.weight")


def problems(spec: ModelSpec, request: ModelRequest) -> list[str]:
    out = []
    if not spec.gated_mlp or spec.norm != "rmsnorm" or spec.num_positions:
        out.append("not a LLaMA-like architecture (gated MLP, RMSNorm, rotary positions)")
    if not spec.separate_final_norm:
        out.append("the final norm folded into the head (LLaMA keeps it as its own layer)")
    return out


def tied_names(spec: ModelSpec) -> tuple[tuple[str, ...], ...]:
    return common.tied_head(spec, "embed_tokens")


def make_layer(spec: ModelSpec, index: int, request: ModelRequest) -> nn.Module:
    kind = spec.layers()[index].kind
    if kind == "block":
        return Block(spec, request.seq_len)
    layer: nn.Module = {"embedding": Embedding, "norm": FinalNorm, "head": Head}[kind](spec)
    return layer


class Embedding(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = embedding(spec.padded_vocab_size, spec.hidden_size)

    def forward(self, idx: Tensor) -> Tensor:
        out: Tensor = self.embed_tokens(idx)
        return out

    def tp_plan(self) -> dict[str, object]:
        return {"embed_tokens": common.vocab_parallel_embedding()}


def inverse_frequencies(spec: ModelSpec) -> Tensor:
    """RoPE's inverse frequencies, computed exactly as transformers does (float32, CPU)."""
    dim = spec.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
    inv = 1.0 / (spec.rope_theta ** (steps / dim))
    r = spec.rope_scaling
    if r is None:
        return inv
    if r.kind == "linear":
        return inv / r.factor
    # LLaMA-3.1: long wavelengths slowed by `factor`, short kept, the middle blended.
    old = r.original_max_position_embeddings
    low_wavelen, high_wavelen = old / r.low_freq_factor, old / r.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / r.factor, inv)
    smooth = (old / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(common.Attention):
    """Rotary positions on queries and keys."""

    cos: Tensor
    sin: Tensor

    def __init__(self, spec: ModelSpec, seq_len: int) -> None:
        super().__init__(spec)
        # cos/sin for every position of the plan's sequence length: not parameters, not
        # checkpointed, the same on every rank. Built on the meta device they stay empty
        # until the runtime has placed them (init_buffers).
        self.spec, self.seq_len = spec, seq_len
        self.register_buffer("cos", torch.empty(seq_len, spec.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(seq_len, spec.head_dim), persistent=False)
        if not self.cos.is_meta:
            self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The tables, computed on the CPU (as transformers does) and copied to the
        buffers' device: the same numbers on every device."""
        positions = torch.arange(self.seq_len, device="cpu").float()[:, None]
        freqs = positions * inverse_frequencies(self.spec)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def rotate(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        t = q.shape[2]
        cos, sin = self.cos[:t].to(q.dtype), self.sin[:t].to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, f = spec.hidden_size, spec.ffn_hidden_size
        self.gate_proj = nn.Linear(h, f, bias=spec.bias)
        self.up_proj = nn.Linear(h, f, bias=spec.bias)
        self.down_proj = nn.Linear(f, h, bias=spec.bias)
        self.act = activation(spec.activation)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return out


class Block(common.Block):
    NAMES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")

    def __init__(self, spec: ModelSpec, seq_len: int) -> None:
        super().__init__(spec, Attention(spec, seq_len), MLP(spec))

    def tp_plan(self) -> dict[str, object]:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
        )

        return {
            **common.attention_tp_plan("self_attn"),
            "mlp": common.shared_input(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }


# --------------------------------------------------------------------- HF names


def hf_sources(spec: ModelSpec) -> dict[str, HFSource]:
    """Our full names -> ``LlamaForCausalLM`` (Mistral, Qwen2, Phi-3) tensor names."""
    h, kv, f = spec.hidden_size, spec.num_kv_heads * spec.head_dim, spec.ffn_hidden_size
    last = spec.num_layers - 1
    embed = "model.embed_tokens.weight"
    out = {
        f"layers.0.{embed.removeprefix('model.')}": HFSource(name=embed, rows=spec.vocab_size),
        f"layers.{last - 1}.norm.weight": HFSource(name="model.norm.weight"),
        f"layers.{last}.lm_head.weight": HFSource(
            name=embed if spec.tied_embeddings else "lm_head.weight", rows=spec.vocab_size
        ),
    }
    fused = spec.family == "phi3"
    for block in range(spec.num_blocks):
        ours, hf = f"layers.{block + 1}", f"model.layers.{block}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{ours}.{norm}.weight"] = HFSource(name=f"{hf}.{norm}.weight")
        projections = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0),
            "self_attn.k_proj": ("self_attn.qkv_proj", h),
            "self_attn.v_proj": ("self_attn.qkv_proj", h + kv),
            "self_attn.o_proj": ("self_attn.o_proj", 0),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0),
            "mlp.up_proj": ("mlp.gate_up_proj", f),
            "mlp.down_proj": ("mlp.down_proj", 0),
        }
        qkv_bias = spec.bias if spec.qkv_bias is None else spec.qkv_bias
        for name, (fused_name, offset) in projections.items():
            is_qkv = name.endswith(("q_proj", "k_proj", "v_proj"))
            params = ["weight", "bias"] if (qkv_bias if is_qkv else spec.bias) else ["weight"]
            for p in params:
                out[f"{ours}.{name}.{p}"] = (
                    HFSource(name=f"{hf}.{fused_name}.{p}", offset=offset)
                    if fused
                    else HFSource(name=f"{hf}.{name}.{p}")
                )
    return out
