"""What every built-in family shares: assembly, per-parameter init, norms, attention, the
block, head, loss.

Initialisation is per parameter: each tensor draws from its own
``torch.Generator`` seeded by (seed, full parameter name), so any rank building
any layer range gets identical weights, and a tied head's copy of the token
embedding equals the embedding's own. Under TP every rank draws the whole tensor
and keeps its block.

Where: the runtime builds the layers on the meta device (``ModelRequest.on_meta``)
and initialises them on the rank's device (``SeededInit``), or not at all when a
checkpoint or ``--init-from`` fills them. The generator is the device's: a CUDA
generator's stream differs from the CPU's, so the same seed gives other weights
on a GPU than on the CPU, identical under every plan on one kind of device. Built
without ``on_meta`` (tests, tools) the layers are initialised on the CPU at once.
Modules holding non-persistent buffers compute them in ``init_buffers()``.

Vocabulary padding: embedding and head have ``spec.padded_vocab_size`` rows (a
multiple of 128, see ``ModelSpec``), so any TP degree up to 8 splits them; the
loss masks the padded logits to -inf, so they take no probability and their head
rows get no gradient. Data never contain the padded ids.

The head's ``loss`` runs head and cross-entropy in chunks of tokens
(``loss.head_loss``); ``lm_loss`` on whole logits stays the ``loss_fn`` for
callers that run the head's forward.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autohet_cli.models import ModelSpec
from autohet_cli.runtime.model_api import ModelParts, ModelRequest, local_block, write_full
from autohet_cli.runtime.models.loss import LmLoss, head_loss

INIT_STD = 0.02


@dataclass(frozen=True, slots=True, kw_only=True)
class HFSource:
    """Where one of our tensors lives in a HuggingFace checkpoint.

    Our row ``r`` (first dimension) is row ``offset + r`` of HF tensor ``name`` —
    its column when ``transposed`` (GPT-2's Conv1D stores weights as (in, out)),
    and then our tensor is that slice transposed. Fused HF tensors (Phi-3's
    ``qkv_proj``, GPT-2's ``c_attn``) are several of ours at different offsets. Our
    rows from ``rows`` on are vocabulary padding: zeros on load, dropped on export.
    """

    name: str
    offset: int = 0
    rows: int | None = None  # None: all of ours
    transposed: bool = False


def assemble(spec: ModelSpec, request: ModelRequest, family: ModuleType) -> ModelParts:
    """Build, check and initialise this rank's layers of ``spec`` with ``family``'s code."""
    problems = common_problems(spec, request) + family.problems(spec, request)
    if problems:
        raise ValueError(
            f"the built-in runtime cannot run model {spec.name!r}: {'; '.join(problems)}; "
            "change the plan or pass your own model with --model-fn package.module:function"
        )
    indices = range(request.layer_start, request.layer_end)
    tied = family.tied_names(spec)
    init = SeededInit(
        spec=spec,
        seed=request.seed,
        canonical={name: group[0] for group in tied for name in group},
        residual=family.RESIDUAL,
    )
    if request.on_meta:
        with torch.device("meta"):
            layers = [family.make_layer(spec, i, request) for i in indices]
    else:
        layers = [family.make_layer(spec, i, request) for i in indices]
        for index, layer in zip(indices, layers, strict=True):
            init(index, layer, params=True)
    hidden = spec.hidden_size
    return ModelParts(
        layers=layers,
        loss_fn=LmLoss(spec.vocab_size),
        vocab_size=spec.vocab_size,
        activation_shape=lambda mbs, seq: (mbs, seq, hidden),
        tied=tied,
        init_layer=init,
    )


def common_problems(spec: ModelSpec, request: ModelRequest) -> list[str]:
    problems = []
    if spec.num_layers != request.num_layers:
        problems.append(f"{spec.num_layers} layers but the plan says {request.num_layers}")
    tp = request.tensor_parallel
    for problem in spec.tensor_parallel_problems(tp):
        problems.append(f"{problem} (the stage's TP degree; pick a plan whose TP divides it)")
    if spec.embed_proj_dim:
        problems.append("an embedding projection")
    if spec.num_positions and spec.num_positions < request.seq_len:
        problems.append(f"{spec.num_positions} learned positions for seq_len {request.seq_len}")
    if spec.sliding_window and spec.sliding_window < request.seq_len:
        # Within the window sliding-window attention is plain causal attention.
        problems.append(
            f"sliding-window attention (window {spec.sliding_window}) is not implemented; "
            f"train with seq_len <= {spec.sliding_window} (plan has {request.seq_len})"
        )
    return problems


def tied_head(spec: ModelSpec, embedding: str) -> tuple[tuple[str, ...], ...]:
    """The head tied to the token embedding (``layers.0.<embedding>``) where the spec
    ties them; a family's ``tied_names``."""
    if not spec.tied_embeddings:
        return ()
    return ((f"layers.0.{embedding}.weight", f"layers.{spec.num_layers - 1}.lm_head.weight"),)


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """``nn.Embedding`` without its default N(0, 1) draw, which ``init_layer`` replaces
    anyway (on the meta device, torch 2.11+ runs that draw through a Python
    decomposition that imports torch._dynamo: a second or two of model build)."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden_size, eps=spec.norm_eps)
    return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, bias=spec.bias)


def activation(name: str) -> Callable[[Tensor], Tensor]:
    fns: dict[str, Callable[[Tensor], Tensor]] = {
        "gelu": F.gelu,
        "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
        "silu": F.silu,
        "relu": F.relu,
    }
    return fns[name]


def shared_input() -> object:
    """TP input style of a module whose projections (q/k/v, gate/up) read one replicated
    input: their input gradients add up as one partial sum, all-reduced once, as
    Megatron's fused projections do, not once per projection."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput

    return PrepareModuleInput(
        input_layouts=(Replicate(),),
        desired_input_layouts=(Replicate(),),
        use_local_output=False,
    )


def vocab_parallel_embedding() -> object:
    """Megatron's vocabulary-parallel embedding: rows split, one all-reduce of the output."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(input_layouts=Replicate())


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections, grouped-query when the
    spec has fewer key/value heads; a family adds positions in ``rotate``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
        qkv_bias = spec.bias if spec.qkv_bias is None else spec.qkv_bias
        self.head_dim = spec.head_dim
        self.q_proj = nn.Linear(h, h, bias=qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.o_proj = nn.Linear(h, h, bias=spec.bias)

    def rotate(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Queries and keys (batch, heads, tokens, head_dim) with their positions in;
        as they are here (learned positions are in the embedding)."""
        return q, k

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # -1 heads: under TP each rank holds num_heads / tp and num_kv_heads / tp.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = self.rotate(q, k)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
        )
        out: Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        return out


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attention(norm(x))``, then ``+ mlp(norm(x))``.

    ``NAMES`` names its four parts (norm, attention, norm, MLP) as the family's
    HuggingFace checkpoints do; our parameter names and checkpoints keep them."""

    NAMES: ClassVar[tuple[str, str, str, str]]

    def __init__(self, spec: ModelSpec, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        parts = (make_norm(spec), attention, make_norm(spec), mlp)
        for name, part in zip(self.NAMES, parts, strict=True):
            self.add_module(name, part)

    def forward(self, x: Tensor) -> Tensor:
        norm_1, attention, norm_2, mlp = [getattr(self, name) for name in self.NAMES]
        x = x + attention(norm_1(x))
        out: Tensor = x + mlp(norm_2(x))
        return out


def attention_tp_plan(name: str) -> dict[str, object]:
    """Megatron's split of the ``Attention`` at ``name``: q/k/v column-parallel (heads
    across TP ranks) reading one replicated input, o row-parallel."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        name: shared_input(),
        f"{name}.q_proj": ColwiseParallel(),
        f"{name}.k_proj": ColwiseParallel(),
        f"{name}.v_proj": ColwiseParallel(),
        f"{name}.o_proj": RowwiseParallel(),
    }


class FinalNorm(nn.Module):
    """The final norm as its own partitionable layer (LLaMA's layer lists keep it so)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = make_norm(spec)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.norm(x)
        return out

    def tp_plan(self) -> dict[str, object]:
        return {}


class Head(nn.Module):
    """LM head over the padded vocabulary, with the final norm folded in when the spec does."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        fold_norm = spec.final_norm and not spec.separate_final_norm
        self.ln_f = make_norm(spec) if fold_norm else nn.Identity()
        self.lm_head = nn.Linear(spec.hidden_size, spec.padded_vocab_size, bias=False)
        self.vocab_size = spec.vocab_size
        self.loss_equals = LmLoss(spec.vocab_size)  # the loss_fn that ``loss`` computes

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.lm_head(self.ln_f(x))
        return out

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        """``lm_loss(self(x), targets)`` in chunks of tokens, never holding the whole
        logits (``loss.head_loss``); the runtime calls it on the last stage."""
        return head_loss(self.ln_f(x), self.lm_head.weight, targets, self.vocab_size, self.lm_head)

    def tp_plan(self) -> dict[str, object]:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel

        # Logits stay sharded over the vocabulary; the loss runs under loss_parallel().
        return {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}


# --------------------------------------------------------------------- init


def param_seed(seed: int, full_name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{full_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class SeededInit:
    """The built-in ``ModelParts.init_layer``: buffers, then (``params``) ``init_layer``."""

    spec: ModelSpec
    seed: int
    canonical: Mapping[str, str]  # tied name -> its group's first name (one seed per group)
    residual: tuple[str, ...]

    @torch.no_grad()
    def __call__(self, index: int, layer: nn.Module, *, params: bool) -> None:
        for module in layer.modules():
            init_buffers = getattr(module, "init_buffers", None)
            if callable(init_buffers):
                init_buffers()
        if params:
            init_layer(layer, index, self.spec, self.seed, self.canonical, self.residual)


@torch.no_grad()
def init_layer(
    layer: nn.Module,
    index: int,
    spec: ModelSpec,
    seed: int,
    canonical: Mapping[str, str],
    residual: tuple[str, ...],
) -> None:
    """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * blocks).

    In place, on each parameter's device; a TP-sharded parameter gets its block of
    the whole tensor drawn there (see the module docstring).
    """
    residual_std = INIT_STD / math.sqrt(2 * spec.num_blocks)
    for module_name, module in layer.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            local = f"{module_name}.{pname}" if module_name else pname
            full = f"layers.{index}.{local}"
            shard = local_block(param)[0]
            if isinstance(module, nn.LayerNorm | nn.RMSNorm):
                shard.fill_(1.0 if pname == "weight" else 0.0)
            elif pname == "bias":
                shard.zero_()
            else:
                device = shard.device
                gen = torch.Generator(device=device)
                gen.manual_seed(param_seed(seed, canonical.get(full, full)))
                std = residual_std if local.endswith(residual) else INIT_STD
                value = torch.randn(param.shape, generator=gen, dtype=param.dtype, device=device)
                write_full(param, value.mul_(std))
