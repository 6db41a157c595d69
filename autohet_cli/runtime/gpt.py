"""The built-in GPT: nanoGPT-like, one ``nn.Module`` per partitionable layer.

Pre-norm blocks (LayerNorm or RMSNorm, causal self-attention, GELU MLP), learned
positions, an LM head tied to the token embedding or not. The layers follow
``ModelSpec.layers()`` one to one: ``embedding``, ``block.0`` ... ``block.N-1``,
``final_norm`` when the spec keeps it separate, ``head`` (with the final norm
folded in otherwise).

Initialisation is per parameter: each tensor draws from its own
``torch.Generator`` seeded by (seed, full parameter name), so any rank building
any layer range gets identical weights, and the head's tied copy of the token
embedding equals the embedding's own.

Tensor parallelism is Megatron's, expressed with DTensor parallel styles: q/k/v
and the MLP's first projection are column-parallel (attention heads split across
TP ranks), the attention output and the MLP's second projection row-parallel
(one all-reduce each in forward and backward), the token embedding and the head
are split over the vocabulary, and the loss is computed on vocabulary-sharded
logits under ``loss_parallel()``.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autohet_cli.models import ModelSpec, get_model
from autohet_cli.runtime.model_api import ModelParts, ModelRequest

INIT_STD = 0.02


def build(request: ModelRequest) -> ModelParts:
    """Model function of the built-in GPT for the zoo model named by the plan."""
    spec = get_model(request.model_name)
    check_supported(spec, request)
    layers = [make_layer(spec, i) for i in range(request.layer_start, request.layer_end)]
    tied = tied_names(spec)
    canonical = {name: group[0] for group in tied for name in group}
    for index, layer in zip(range(request.layer_start, request.layer_end), layers, strict=True):
        init_layer(layer, index, spec, request.seed, canonical)
    hidden = spec.hidden_size
    return ModelParts(
        layers=layers,
        loss_fn=lm_loss,
        vocab_size=spec.vocab_size,
        activation_shape=lambda mbs, seq: (mbs, seq, hidden),
        tied=tied,
    )


def check_supported(spec: ModelSpec, request: ModelRequest) -> None:
    """What the built-in GPT can build; anything else needs ``--model-fn``."""
    problems = []
    if spec.family != "gpt2":
        problems.append(f"family {spec.family!r} (the built-in GPT builds family 'gpt2')")
    if spec.gated_mlp:
        problems.append("a gated MLP")
    if spec.embed_proj_dim:
        problems.append("an embedding projection")
    if spec.num_positions < request.seq_len:
        problems.append(f"{spec.num_positions} learned positions for seq_len {request.seq_len}")
    tp = request.tensor_parallel
    for what, n in (
        ("num_heads", spec.num_heads),
        ("num_kv_heads", spec.num_kv_heads),
        ("ffn_hidden_size", spec.ffn_hidden_size),
        ("vocab_size", spec.vocab_size),
    ):
        if n % tp:
            problems.append(f"{what} {n} not divisible by tensor_parallel {tp}")
    if spec.num_layers != request.num_layers:
        problems.append(f"{spec.num_layers} layers but the plan says {request.num_layers}")
    if problems:
        raise ValueError(
            f"built-in GPT cannot run model {spec.name!r}: {'; '.join(problems)}; "
            "pass your own model with --model-fn package.module:function"
        )


def tied_names(spec: ModelSpec) -> tuple[tuple[str, ...], ...]:
    if not spec.tied_embeddings:
        return ()
    return (("layers.0.wte.weight", f"layers.{spec.num_layers - 1}.lm_head.weight"),)


def make_layer(spec: ModelSpec, index: int) -> nn.Module:
    kind = spec.layers()[index].kind
    if kind == "embedding":
        return Embedding(spec)
    if kind == "block":
        return Block(spec)
    if kind == "norm":
        return FinalNorm(spec)
    if kind == "head":
        return Head(spec)
    raise ValueError(f"layer {index} of {spec.name}: unknown kind {kind!r}")


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden_size, eps=1e-5)
    return nn.LayerNorm(spec.hidden_size, eps=1e-5, bias=spec.bias)


class Embedding(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.wpe = nn.Embedding(spec.num_positions, spec.hidden_size)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        out: Tensor = self.wte(idx) + self.wpe(pos)
        return out

    def tp_plan(self) -> dict[str, object]:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import RowwiseParallel

        return {"wte": RowwiseParallel(input_layouts=Replicate())}


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
        qkv_bias = spec.bias if spec.qkv_bias is None else spec.qkv_bias
        self.head_dim = spec.head_dim
        self.kv_repeat = spec.num_heads // spec.num_kv_heads
        self.q_proj = nn.Linear(h, h, bias=qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.o_proj = nn.Linear(h, h, bias=spec.bias)
        if self.k_proj.bias is not None:
            # Kept for GPT-2's parameter layout, but frozen: adding the same q.b_k to a
            # query's every score leaves the softmax unchanged, so its exact gradient
            # is zero and Adam would only random-walk on rounding noise (differently
            # for every plan). Whisper drops this bias for the same reason.
            self.k_proj.bias.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # -1 heads: under TP each rank holds num_heads / tp of them.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.kv_repeat > 1:
            k = k.repeat_interleave(self.kv_repeat, dim=1)
            v = v.repeat_interleave(self.kv_repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        return out


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.fc = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=spec.bias)
        self.proj = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=spec.bias)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.ln_1 = _norm(spec)
        self.attn = Attention(spec)
        self.ln_2 = _norm(spec)
        self.mlp = MLP(spec)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        out: Tensor = x + self.mlp(self.ln_2(x))
        return out

    def tp_plan(self) -> dict[str, object]:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
        )

        return {
            # q, k and v share one replicated input: their input gradients add up as
            # one partial sum, all-reduced once (Megatron's fused QKV), not three times.
            "attn": PrepareModuleInput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Replicate(),),
                use_local_output=False,
            ),
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(),
        }


class FinalNorm(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = _norm(spec)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.norm(x)
        return out

    def tp_plan(self) -> dict[str, object]:
        return {}


class Head(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        fold_norm = spec.final_norm and not spec.separate_final_norm
        self.ln_f = _norm(spec) if fold_norm else nn.Identity()
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.lm_head(self.ln_f(x))
        return out

    def tp_plan(self) -> dict[str, object]:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel

        # Logits stay sharded over the vocabulary; the loss runs under loss_parallel().
        return {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Sum over the micro-batch's samples of each sample's mean token cross-entropy."""
    flat = logits.flatten(0, 1).float()
    return F.cross_entropy(flat, targets.flatten(), reduction="sum") / targets.shape[-1]


# --------------------------------------------------------------------- init


def param_seed(seed: int, full_name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{full_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def init_layer(
    layer: nn.Module, index: int, spec: ModelSpec, seed: int, canonical: dict[str, str]
) -> None:
    """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * blocks)."""
    residual_std = INIT_STD / math.sqrt(2 * spec.num_blocks)
    for module_name, module in layer.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            local = f"{module_name}.{pname}" if module_name else pname
            full = f"layers.{index}.{local}"
            gen = torch.Generator().manual_seed(param_seed(seed, canonical.get(full, full)))
            if isinstance(module, nn.LayerNorm | nn.RMSNorm):
                param.fill_(1.0 if pname == "weight" else 0.0)
            elif pname == "bias":
                param.zero_()
            else:
                residual = local.endswith(("o_proj.weight", "mlp.proj.weight"))
                std = residual_std if residual else INIT_STD
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * std)
