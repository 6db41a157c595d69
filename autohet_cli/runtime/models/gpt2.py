"""GPT-2 family: pre-LayerNorm blocks, learned positions, GELU MLP, tied head.

Layers follow ``ModelSpec.layers()``: ``embedding``, ``block.0`` ... ``block.N-1``,
(``final_norm`` when the spec keeps it separate), ``head`` with the final norm
folded in. HF GPT-2 checkpoints (``GPT2LMHeadModel``) map onto it: their Conv1D
weights are stored (in, out) and q/k/v are fused in ``c_attn``.

Tensor parallelism is Megatron's, expressed with DTensor parallel styles: q/k/v
and the MLP's first projection are column-parallel (attention heads split across
TP ranks), the attention output and the MLP's second projection row-parallel
(one all-reduce each in forward and backward), the token embedding and the head
are split over the (padded) vocabulary, and the loss is computed on
vocabulary-sharded logits under ``loss_parallel()``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from autohet_cli.models import ModelSpec
from autohet_cli.runtime.model_api import ModelRequest
from autohet_cli.runtime.models import common
from autohet_cli.runtime.models.common import FinalNorm, Head, HFSource, activation, embedding

RESIDUAL = ("o_proj.weight", "mlp.proj.weight")


def problems(spec: ModelSpec, request: ModelRequest) -> list[str]:
    out = []
    if spec.gated_mlp:
        out.append("a gated MLP (the GPT-2 family has a plain one)")
    if not spec.num_positions:
        out.append("no learned positions (the GPT-2 family has them)")
    if spec.activation not in ("gelu", "gelu_tanh"):
        out.append(f"activation {spec.activation!r} (the GPT-2 family uses GELU)")
    return out


def tied_names(spec: ModelSpec) -> tuple[tuple[str, ...], ...]:
    return common.tied_head(spec, "wte")


def make_layer(spec: ModelSpec, index: int, request: ModelRequest) -> nn.Module:
    kind = spec.layers()[index].kind
    layer: nn.Module = {"embedding": Embedding, "block": Block, "norm": FinalNorm, "head": Head}[
        kind
    ](spec)
    return layer


class Embedding(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.wte = embedding(spec.padded_vocab_size, spec.hidden_size)
        self.wpe = embedding(spec.num_positions, spec.hidden_size)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        out: Tensor = self.wte(idx) + self.wpe(pos)
        return out

    def tp_plan(self) -> dict[str, object]:
        return {"wte": common.vocab_parallel_embedding()}


class Attention(common.Attention):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        if self.k_proj.bias is not None:
            # Kept for GPT-2's parameter layout, but frozen: adding the same q.b_k to a
            # query's every score leaves the softmax unchanged, so its exact gradient
            # is zero and Adam would only random-walk on rounding noise (differently
            # for every plan). Whisper drops this bias for the same reason.
            self.k_proj.bias.requires_grad_(False)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.fc = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=spec.bias)
        self.proj = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=spec.bias)
        self.act = activation(spec.activation)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.proj(self.act(self.fc(x)))
        return out


class Block(common.Block):
    NAMES = ("ln_1", "attn", "ln_2", "mlp")

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec, Attention(spec), MLP(spec))

    def tp_plan(self) -> dict[str, object]:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
        )

        return {
            **common.attention_tp_plan("attn"),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(),
        }


# --------------------------------------------------------------------- HF names


def hf_sources(spec: ModelSpec) -> dict[str, HFSource]:
    """Our full names -> ``GPT2LMHeadModel`` tensors (Conv1D weights are (in, out))."""
    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    last = spec.num_layers - 1
    out = {
        "layers.0.wte.weight": HFSource(name="transformer.wte.weight", rows=spec.vocab_size),
        "layers.0.wpe.weight": HFSource(name="transformer.wpe.weight"),
        f"layers.{last}.lm_head.weight": HFSource(
            name="transformer.wte.weight" if spec.tied_embeddings else "lm_head.weight",
            rows=spec.vocab_size,
        ),
    }
    norm = f"layers.{last - 1}.norm" if spec.separate_final_norm else f"layers.{last}.ln_f"
    for p in ("weight", "bias"):
        out[f"{norm}.{p}"] = HFSource(name=f"transformer.ln_f.{p}")
    for block in range(spec.num_blocks):
        ours, hf = f"layers.{block + 1}", f"transformer.h.{block}"
        fused = {"q_proj": 0, "k_proj": h, "v_proj": h + kv}
        for name, offset in fused.items():
            out[f"{ours}.attn.{name}.weight"] = HFSource(
                name=f"{hf}.attn.c_attn.weight", offset=offset, transposed=True
            )
            out[f"{ours}.attn.{name}.bias"] = HFSource(name=f"{hf}.attn.c_attn.bias", offset=offset)
        pairs = {"attn.o_proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
        for name, hf_name in pairs.items():
            out[f"{ours}.{name}.weight"] = HFSource(name=f"{hf}.{hf_name}.weight", transposed=True)
            out[f"{ours}.{name}.bias"] = HFSource(name=f"{hf}.{hf_name}.bias")
        for ln in ("ln_1", "ln_2"):
            for p in ("weight", "bias"):
                out[f"{ours}.{ln}.{p}"] = HFSource(name=f"{hf}.{ln}.{p}")
    return out
