"""How each HuggingFace ``model_type`` spells its fields, and their reading (pure).

One table (``FAMILIES``) says per family where a ``config.json`` keeps the fields
every family has, what it fixes and what only it has; ``read_spec`` maps them onto
the one architecture description the planner understands, and ``hfconfig``'s
writer (``to_hf_config``) reads the same table back. Split from ``hfconfig`` (files,
export, comparison) because the table is most of that code and changes alone:
a new family is a new row here.

Defaults for fields a config may omit are the ones of the matching
``transformers`` config class, because published configs rely on them (the
``gpt2`` config has no ``n_inner`` and no ``tie_word_embeddings``). Anything that
``ModelSpec`` cannot represent exactly is rejected rather than approximated: a
wrong parameter count silently yields a plan that does not fit in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from autohet_cli.errors import ConfigError
from autohet_cli.modelspec import ModelSpec, RopeScaling

# Pretraining context of the families we read. Configs of long-context models
# advertise 32k-128k positions reached by later fine-tuning; planning a
# pretraining run at that length by default would mislead. --seq-len overrides.
MAX_DEFAULT_SEQ_LEN = 8192


@dataclass(frozen=True, slots=True, kw_only=True)
class Fields:
    """The parsed JSON object plus the file it came from, for error messages."""

    path: str
    model_type: str
    raw: Mapping[str, object]

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: field '{key}' {problem}")

    def count(self, key: str, default: int | None = None) -> int:
        """A positive integer field; ``default`` applies when it is absent or null."""
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise self.error(
                    key,
                    f"is missing, but {self.model_type} configs need it; "
                    "use the config.json published with the checkpoint",
                )
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(key, f"must be a positive integer, got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def seq_len(self, key: str) -> int:
        return min(self.count(key, 2048), MAX_DEFAULT_SEQ_LEN)

    def heads(self, hidden: int, key: str) -> int:
        """Attention heads; ModelSpec derives head_dim as hidden // heads, so it must divide."""
        heads = self.count(key)
        if hidden % heads:
            raise self.error(key, f"({heads}) must divide the hidden size ({hidden})")
        return heads

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self.error(key, f"must be a positive number, got {value!r}")
        return float(value)

    def activation(self, key: str, default: str) -> str:
        value = self.raw.get(key, default)
        if value not in _ACTIVATIONS:
            raise self.error(
                key, f"{value!r} is not supported (supported: {', '.join(_ACTIVATIONS)})"
            )
        return _ACTIVATIONS[str(value)]


# HF activation names -> ModelSpec.activation (gelu_new is GELU's tanh approximation).
_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
}
HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu", "relu": "relu"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """Where one ``model_type`` keeps the fields every family has, and what it fixes.

    One reader (``read_spec``) and one writer (``to_hf_config``) serve every family
    from this table; ``extra`` reads what only that family has.
    """

    layers: str = "num_hidden_layers"
    hidden: str = "hidden_size"
    heads: str = "num_attention_heads"
    kv_heads: str | None = None  # None: multi-head attention
    ffn: str = "intermediate_size"
    ffn_times_hidden: int = 0  # default when the ffn key is absent (0: required)
    positions: str = "max_position_embeddings"
    learned_offset: int | None = None  # learned positions (+ offset); None: rotary
    eps: str | None = "layer_norm_eps"  # None: the family fixes 1e-5
    eps_default: float = 1e-5
    activation: str = "hidden_act"
    activation_default: str = "gelu"
    tied_default: bool = False
    fixed: Mapping[str, object] = field(default_factory=dict)
    extra: Callable[[Fields], dict[str, object]] | None = None
    architecture: str = ""  # HF class written by export; empty: the runtime cannot train it


def _rotary(f: Fields) -> dict[str, object]:
    """``rope_theta`` and scaling, from transformers 4 (``rope_theta``, ``rope_scaling``)
    or 5 (``rope_parameters``) configs; rope types whose positions depend on the
    sequence (dynamic, yarn, longrope) are refused, not approximated."""
    params = f.raw.get("rope_parameters")
    key = "rope_parameters" if isinstance(params, Mapping) else "rope_scaling"
    src = params if isinstance(params, Mapping) else f.raw.get("rope_scaling")
    if src is not None and not isinstance(src, Mapping):
        raise f.error(key, f"must be a mapping or null, got {src!r}")
    # One view of both places: the nested mapping wins over top-level keys.
    sub = Fields(path=f.path, model_type=f.model_type, raw={**f.raw, **(src or {})})
    partial = sub.number("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise f.error("partial_rotary_factor", f"({partial}) != 1.0 is not supported")
    kind = sub.raw.get("rope_type", sub.raw.get("type", "default"))
    out: dict[str, object] = {"rope_theta": sub.number("rope_theta", 10000.0)}
    if kind == "default":
        return out
    if kind == "linear":
        out["rope_scaling"] = RopeScaling(kind="linear", factor=sub.number("factor", 1.0))
    elif kind == "llama3":
        out["rope_scaling"] = RopeScaling(
            kind="llama3",
            factor=sub.number("factor", 8.0),
            low_freq_factor=sub.number("low_freq_factor", 1.0),
            high_freq_factor=sub.number("high_freq_factor", 4.0),
            original_max_position_embeddings=sub.count("original_max_position_embeddings"),
        )
    else:
        raise f.error(
            key, f"rope type {kind!r} is not supported (supported: default, linear, llama3)"
        )
    return out


def _window(f: Fields) -> dict[str, object]:
    return {"sliding_window": f.count("sliding_window", 0)}


def _llama_extra(f: Fields) -> dict[str, object]:
    attn_bias = f.flag("attention_bias", False)
    if f.flag("mlp_bias", False) != attn_bias:
        raise f.error("mlp_bias", "must equal attention_bias (mixed biases are not supported)")
    return {"bias": attn_bias, **_rotary(f)}


def _mistral_extra(f: Fields) -> dict[str, object]:
    return {**_rotary(f), **_window(f)}


def _qwen2_extra(f: Fields) -> dict[str, object]:
    return {**_rotary(f), **(_window(f) if f.flag("use_sliding_window", False) else {})}


def _gpt2_extra(f: Fields) -> dict[str, object]:
    if f.flag("scale_attn_by_inverse_layer_idx", False) or not f.flag("scale_attn_weights", True):
        raise f.error(
            "scale_attn_weights", "other than the standard 1/sqrt(head_dim) is not supported"
        )
    return {}


def _opt_extra(f: Fields) -> dict[str, object]:
    """OPT: post-LN variants (350M) have no final norm; 350M projects its embedding."""
    hidden = f.count("hidden_size")
    embed_dim = f.count("word_embed_proj_dim", hidden)
    final_norm = f.flag("do_layer_norm_before", True) and not f.flag(
        "_remove_final_layer_norm", False
    )
    return {
        "bias": f.flag("enable_bias", True),
        "final_norm": final_norm,
        "embed_proj_dim": embed_dim if embed_dim != hidden else 0,
    }


_LLAMA_FIXED = {"gated_mlp": True, "bias": False, "norm": "rmsnorm", "separate_final_norm": True}


def _llama_like(
    extra: Callable[[Fields], dict[str, object]], architecture: str, **changes: object
) -> Family:
    """LLaMA and its kin: pre-RMSNorm, SwiGLU, rotary, grouped-query attention."""
    eps_default = float(changes.pop("eps_default", 1e-6))  # type: ignore[arg-type]
    return Family(
        kv_heads="num_key_value_heads",
        eps="rms_norm_eps",
        eps_default=eps_default,
        activation_default="silu",
        fixed={**_LLAMA_FIXED, **changes},
        extra=extra,
        architecture=architecture,
    )


FAMILIES: dict[str, Family] = {
    "llama": _llama_like(_llama_extra, "LlamaForCausalLM"),
    "mistral": _llama_like(_mistral_extra, "MistralForCausalLM"),
    "qwen2": _llama_like(_qwen2_extra, "Qwen2ForCausalLM", qkv_bias=True),
    # Phi-3's checkpoints fuse q/k/v and gate/up; the runtime maps them.
    "phi3": _llama_like(_mistral_extra, "Phi3ForCausalLM", eps_default=1e-5),
    # GPT-2: pre-LayerNorm, learned positions, biases everywhere, tied head.
    "gpt2": Family(
        layers="n_layer",
        hidden="n_embd",
        heads="n_head",
        ffn="n_inner",
        ffn_times_hidden=4,
        positions="n_positions",
        learned_offset=0,
        eps="layer_norm_epsilon",
        activation="activation_function",
        activation_default="gelu_new",
        tied_default=True,
        extra=_gpt2_extra,
        architecture="GPT2LMHeadModel",
    ),
    # GPT-NeoX (Pythia): rotary positions, biases everywhere, untied head.
    "gpt_neox": Family(),
    # OPT: learned positions offset by 2, ReLU.
    "opt": Family(
        ffn="ffn_dim",
        learned_offset=2,
        eps=None,
        activation="activation_function",
        activation_default="relu",
        tied_default=True,
        extra=_opt_extra,
    ),
    # GPT-Neo: like GPT-2 but q/k/v projections have no bias.
    "gpt_neo": Family(
        layers="num_layers",
        heads="num_heads",
        ffn_times_hidden=4,
        learned_offset=0,
        eps="layer_norm_epsilon",
        activation="activation_function",
        activation_default="gelu_new",
        tied_default=True,
        fixed={"qkv_bias": False},
    ),
}

# What a few well-known types need that ModelSpec and the runtime do not have.
UNSUPPORTED = {
    "mixtral": "mixture-of-experts MLPs (num_local_experts) are not modelled",
    "qwen2_moe": "mixture-of-experts MLPs (num_experts) are not modelled",
    "gemma": "Gemma's GeGLU MLP, (1 + weight) RMSNorm and sqrt(hidden)-scaled embeddings "
    "are not modelled",
    "gemma2": "Gemma-2's logit soft-capping, GeGLU and extra norms are not modelled",
    "gemma3": "Gemma-3's GeGLU, extra norms and local/global attention are not modelled",
}


def read_spec(f: Fields, fam: Family, name: str) -> ModelSpec:
    """The spec named ``name`` that ``f`` describes, read as family ``fam`` spells it;
    a field it lacks, or a size ``ModelSpec`` refuses, is a ``ConfigError`` naming the file."""
    hidden = f.count(fam.hidden)
    heads = f.heads(hidden, fam.heads)
    kv_heads = heads if fam.kv_heads is None else f.count(fam.kv_heads, heads)
    if heads % kv_heads:
        raise f.error(str(fam.kv_heads), f"({kv_heads}) must divide {heads} heads")
    head_dim = f.count("head_dim", hidden // heads)
    if head_dim != hidden // heads:
        raise f.error("head_dim", f"({head_dim}) != hidden_size / heads is not supported")
    learned = fam.learned_offset is not None
    positions = f.count(fam.positions, None if learned else 2048)
    values: dict[str, object] = {
        "name": name,
        "family": f.model_type,
        "num_blocks": f.count(fam.layers),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "ffn_hidden_size": f.count(fam.ffn, fam.ffn_times_hidden * hidden or None),
        "vocab_size": f.count("vocab_size"),
        "num_positions": positions + (fam.learned_offset or 0) if learned else 0,
        "tied_embeddings": f.flag("tie_word_embeddings", fam.tied_default),
        "default_seq_len": min(positions, MAX_DEFAULT_SEQ_LEN),
        "max_position_embeddings": positions,
        "norm_eps": f.number(fam.eps, fam.eps_default) if fam.eps else fam.eps_default,
        "activation": f.activation(fam.activation, fam.activation_default),
        **fam.fixed,
    }
    if fam.extra is not None:
        values.update(fam.extra(f))
    try:
        return ModelSpec(**values)  # type: ignore[arg-type]
    except ConfigError as exc:  # a size past the bounds of limits.py, or NaN
        raise ConfigError(f"{f.path}: {exc}") from None
