"""A model's architecture as the planner and the runtime read it (pure).

A model is described by its architecture hyper-parameters; from them we derive
the partitionable layers (embedding, one entry per block, optional final norm,
LM head), each with its exact parameter count, forward FLOPs and activation
sizes (``layerspec``). The layer list is what plans index with
``layers: [start, end)`` and what measured profiles are keyed by, so its shape
follows the measured data: LLaMA keeps the final norm as its own layer, models
with tied embeddings fold the final norm into the head.

Activation sizes are what our runtime keeps (``LayerSpec``), laid out as in
Korthikanti et al. 2022 ("Reducing activation recomputation") for a block with
flash attention and no dropout: the parts outside the tensor-parallel region
are kept whole on every TP rank, the rest is divided by the TP degree. Under
autocast that is more than the paper's 16-bit count (fp32 residual and norms, a
16-bit input copy per projection): the analytic model once said 62 GiB for a run
that peaked at 72 on an H100.

Split from ``models`` (the zoo and name lookup) so that ``hfconfig``, which builds
specs from a config.json, sits between the two: ``layerspec`` <- ``modelspec`` <-
``hfconfig`` <- ``models``, every arrow pointing down.
"""

from __future__ import annotations

from dataclasses import dataclass

from autohet_cli.errors import ConfigError
from autohet_cli.layerspec import LayerSpec, model_layers
from autohet_cli.limits import MODEL_BOUNDS, at_most, within

VOCAB_MULTIPLE = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeScaling:
    """HF ``rope_scaling``: ``linear`` (positions / factor) or ``llama3`` (LLaMA-3.1)."""

    kind: str  # linear | llama3
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    name: str
    family: str
    num_blocks: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_positions: int = 0  # learned position embeddings (0: rotary/none)
    gated_mlp: bool = False  # SwiGLU: gate, up and down projections
    bias: bool = True
    qkv_bias: bool | None = None  # None: same as bias
    norm: str = "layernorm"  # or "rmsnorm" (no bias)
    tied_embeddings: bool = True
    final_norm: bool = True
    separate_final_norm: bool = False  # final norm as its own partitionable layer
    embed_proj_dim: int = 0  # OPT-350M projects a 512-wide embedding to 1024
    default_seq_len: int = 2048
    # What the runtime needs beyond the shapes (HF config fields; defaults as GPT-2's).
    norm_eps: float = 1e-5
    activation: str = "gelu"  # gelu | gelu_tanh (GPT-2 gelu_new) | silu (SwiGLU gate) | relu
    rope_theta: float = 10000.0  # rotary models (num_positions == 0)
    rope_scaling: RopeScaling | None = None
    sliding_window: int = 0  # 0: full causal attention
    max_position_embeddings: int = 0  # as the HF config says (0: default_seq_len)
    make_vocab_size_divisible_by: int = VOCAB_MULTIPLE

    def __post_init__(self) -> None:
        """Refuse sizes no model has before any layer list is built: every spec,
        from the zoo, a config.json or a plan, passes here (bounds: limits.py)."""
        for name, (bound, why) in MODEL_BOUNDS.items():
            at_most(getattr(self, name), bound, f"model {self.name!r}: {name}", why)
        values = {"norm_eps": self.norm_eps, "rope_theta": self.rope_theta}
        r = self.rope_scaling
        if r is not None:
            values["rope_scaling.factor"] = r.factor
            if r.kind == "llama3":
                values["rope_scaling.low_freq_factor"] = r.low_freq_factor
                values["rope_scaling.high_freq_factor"] = r.high_freq_factor
        for name, value in values.items():
            within(value, name, f"model {self.name!r}")
        if r is not None and r.kind == "llama3" and r.high_freq_factor <= r.low_freq_factor:
            raise ConfigError(  # LLaMA-3.1's smoothing divides by their difference
                f"model {self.name!r}: rope_scaling.high_freq_factor ({r.high_freq_factor}) "
                f"must exceed low_freq_factor ({r.low_freq_factor})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and head as trained: the vocabulary rounded up.

        Megatron's ``--make-vocab-size-divisible-by``, but a fixed multiple (128)
        instead of 128 x TP: every TP degree the planner tries (1, 2, 4, 8) divides
        it, and the padded shape, hence every checkpoint, is the same under any plan.
        """
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    @property
    def num_padding_params(self) -> int:
        """Parameters the padding rows add (embedding, and the head's own copy if untied)."""
        rows = self.padded_vocab_size - self.vocab_size
        return rows * (self.embed_proj_dim or self.hidden_size) * (1 + (not self.tied_embeddings))

    def tensor_parallel_problems(self, tp: int) -> list[str]:
        """Why Megatron-style TP of degree ``tp`` cannot split this model (empty: it can)."""
        return [
            f"{what} {n} is not divisible by tensor_parallel {tp}"
            for what, n in (
                ("num_heads", self.num_heads),
                ("num_kv_heads", self.num_kv_heads),
                ("ffn_hidden_size", self.ffn_hidden_size),
                ("padded vocab_size", self.padded_vocab_size),
            )
            if n % tp
        ]

    @property
    def num_layers(self) -> int:
        """Number of partitionable layers."""
        return len(self.layers())

    def layers(self) -> tuple[LayerSpec, ...]:
        return model_layers(self)

    @property
    def num_params(self) -> int:
        """Parameters of the released model (unpadded vocabulary), tied weights once.

        The layers count the padded vocabulary, which is what GPUs hold.
        """
        layers = self.layers()
        return sum(x.num_params - x.shared_params for x in layers) - self.num_padding_params
