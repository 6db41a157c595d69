"""Model zoo: transformers as lists of pipeline-partitionable layers (pure).

A model is described by its architecture hyper-parameters; from them we derive
the partitionable layers (embedding, one entry per block, optional final norm,
LM head), each with its exact parameter count, forward FLOPs and activation
sizes. The layer list is what plans index with ``layers: [start, end)`` and what
measured profiles are keyed by, so its shape follows the measured data: LLaMA
keeps the final norm as its own layer, models with tied embeddings fold the
final norm into the head.

Activation sizes are what our runtime keeps (``LayerSpec``), laid out as in
Korthikanti et al. 2022 ("Reducing activation recomputation") for a block with
flash attention and no dropout: the parts outside the tensor-parallel region
are kept whole on every TP rank, the rest is divided by the TP degree. Under
autocast that is more than the paper's 16-bit count (fp32 residual and norms, a
16-bit input copy per projection): the analytic model once said 62 GiB for a run
that peaked at 72 on an H100.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from autohet_cli.errors import ConfigError, UnknownNameError
from autohet_cli.layerspec import CHUNK_LOGIT_BYTES as CHUNK_LOGIT_BYTES
from autohet_cli.layerspec import IGNORE_INDEX as IGNORE_INDEX
from autohet_cli.layerspec import LayerSpec as LayerSpec
from autohet_cli.layerspec import loss_chunk_tokens as loss_chunk_tokens
from autohet_cli.layerspec import model_layers
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


def _gpt(name: str, blocks: int, hidden: int, heads: int, vocab: int = 50257) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="gpt2",
        num_blocks=blocks,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=4 * hidden,
        vocab_size=vocab,
        num_positions=2048,
    )


def _llama(
    name: str, blocks: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int
) -> ModelSpec:
    """Meta's LLaMA-2/3 (``rms_norm_eps`` 1e-5; LLaMA-3 has ``rope_theta`` 500000)."""
    return ModelSpec(
        name=name,
        family="llama",
        num_blocks=blocks,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        gated_mlp=True,
        bias=False,
        norm="rmsnorm",
        tied_embeddings=False,
        separate_final_norm=True,
        default_seq_len=seq,
        activation="silu",
        rope_theta=500000.0 if vocab > 100_000 else 10000.0,
        max_position_embeddings=seq,
    )


def _opt(name: str, blocks: int, hidden: int, heads: int, **kw: int | bool) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="opt",
        num_blocks=blocks,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=4 * hidden,
        vocab_size=50272,
        num_positions=2050,  # OPT offsets learned positions by 2
        **kw,  # type: ignore[arg-type]
    )


ZOO: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # GPT-3 paper (Brown et al. 2020) shapes; 13B uses 5120 so heads divide evenly.
        _gpt("GPT-1.3B", 24, 2048, 16),
        _gpt("GPT-2.7B", 32, 2560, 32),
        _gpt("GPT-6.7B", 32, 4096, 32),
        _gpt("GPT-13B", 40, 5120, 40),
        _gpt("GPT-30B", 48, 7168, 56),
        # Megatron-LM (Narayanan et al. 2021, Table 1) shapes, for the throughput check.
        _gpt("Megatron-1.7B", 24, 2304, 24, vocab=51200),
        _gpt("Megatron-3.6B", 30, 3072, 32, vocab=51200),
        _gpt("Megatron-7.5B", 36, 4096, 32, vocab=51200),
        _gpt("Megatron-18B", 40, 6144, 48, vocab=51200),
        _gpt("Megatron-39B", 48, 8192, 64, vocab=51200),
        _llama("LLaMA-2-7B", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("LLaMA-2-13B", 40, 5120, 40, 40, 13824, 32000, 4096),
        _llama("LLaMA-2-70B", 80, 8192, 64, 8, 28672, 32000, 4096),
        _llama("LLaMA-3-8B", 32, 4096, 32, 8, 14336, 128256, 8192),
        _llama("LLaMA-3-70B", 80, 8192, 64, 8, 28672, 128256, 8192),
        # OPT-350M: post-LN, no final norm, 512-wide embedding projected to 1024.
        _opt("OPT-350M", 24, 1024, 16, embed_proj_dim=512, final_norm=False),
        _opt("OPT-30B", 48, 7168, 56),
        ModelSpec(
            name="GPT-Neo-2.7B",
            family="gpt_neo",
            num_blocks=32,
            hidden_size=2560,
            num_heads=20,
            num_kv_heads=20,
            ffn_hidden_size=10240,
            vocab_size=50257,
            num_positions=2048,
            qkv_bias=False,
        ),
        # Tiny GPTs that train on a CPU in seconds (runtime tests, the localhost demo).
        ModelSpec(
            name="gpt-tiny",
            family="gpt2",
            num_blocks=4,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=4,
            ffn_hidden_size=256,
            vocab_size=256,
            num_positions=64,
            default_seq_len=64,
        ),
        ModelSpec(
            name="gpt-small",
            family="gpt2",
            num_blocks=8,
            hidden_size=256,
            num_heads=8,
            num_kv_heads=8,
            ffn_hidden_size=1024,
            vocab_size=1024,
            num_positions=256,
            default_seq_len=256,
        ),
        # A small LLaMA (RMSNorm, RoPE, SwiGLU, grouped KV) whose 2048-token vocabulary is
        # the shipped sample tokenizer's (autohet_cli/data/sample): the demo's model.
        _llama("llama-tiny", 4, 128, 4, 2, 352, 2048, 128),
    )
}

# Names the measured data and users write, mapped to zoo names.
_ALIASES = {
    "opt350": "OPT-350M",
    "opt30": "OPT-30B",
    "gptneo27": "GPT-Neo-2.7B",
    "llama38": "LLaMA-3-8B",
    "llama370": "LLaMA-3-70B",
    "llama27": "LLaMA-2-7B",
    "llama213": "LLaMA-2-13B",
    "llama270": "LLaMA-2-70B",
}


def _squash(text: str) -> str:
    # Keep the dot: "GPT-1.3B" and "GPT-13B" are different models.
    return "".join(ch for ch in text.lower() if ch.isalnum() or ch == ".")


def canonical_model_name(raw: str) -> str:
    """``OPT-350``, ``opt_350m``, ``LLAMA-3-8`` and the zoo name itself all resolve."""
    key = _squash(raw)
    for name in ZOO:
        if _squash(name) == key:
            return name
    stripped = key.removesuffix("b").removesuffix("m").replace(".", "")
    if stripped in _ALIASES:
        return _ALIASES[stripped]
    by_lower = {name.lower(): name for name in ZOO}
    close = difflib.get_close_matches(raw.lower(), list(by_lower), n=1, cutoff=0.75)
    hint = f"did you mean {' or '.join(by_lower[c] for c in close)}? " if close else ""
    raise UnknownNameError(
        f"unknown model {raw!r}; {hint}zoo models: {', '.join(ZOO)} "
        "(or pass a HuggingFace config.json path)"
    )


def get_model(name_or_path: str) -> ModelSpec:
    """A zoo model by name, or a HuggingFace ``config.json`` by path."""
    if name_or_path.endswith(".json"):
        from autohet_cli.hfconfig import load_hf_config

        return load_hf_config(name_or_path)
    return ZOO[canonical_model_name(name_or_path)]
