"""Read a HuggingFace ``config.json`` into a :class:`ModelSpec` (pure, no transformers).

Users plan for checkpoints that are not in the zoo by pointing at the
``config.json`` that ships with every HuggingFace model. Importing transformers
for that would pull in torch and half a gigabyte of code just to read a dozen
integers, so we read the JSON ourselves and map each family's field names onto
the one architecture description the planner understands.

Defaults for fields a config may omit are the ones of the matching
``transformers`` config class, because published configs rely on them (the
``gpt2`` config has no ``n_inner`` and no ``tie_word_embeddings``). Anything that
``ModelSpec`` cannot represent exactly is rejected rather than approximated: a
wrong parameter count silently yields a plan that does not fit in memory.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from autohet_cli.errors import ConfigError
from autohet_cli.models import ModelSpec, RopeScaling
from autohet_cli.regular_file import read_regular

# Pretraining context of the families we read. Configs of long-context models
# advertise 32k-128k positions reached by later fine-tuning; planning a
# pretraining run at that length by default would mislead. --seq-len overrides.
_MAX_DEFAULT_SEQ_LEN = 8192
# A config.json holds a few dozen fields (~1-10 KB); the bound keeps /dev/zero out.
_MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class _Fields:
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
        return min(self.count(key, 2048), _MAX_DEFAULT_SEQ_LEN)

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
_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu", "relu": "relu"}


@dataclass(frozen=True, slots=True, kw_only=True)
class _Family:
    """Where one ``model_type`` keeps the fields every family has, and what it fixes.

    One reader (``_read``) and one writer (``to_hf_config``) serve every family
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
    extra: Callable[[_Fields], dict[str, object]] | None = None
    architecture: str = ""  # HF class written by export; empty: the runtime cannot train it


def _rotary(f: _Fields) -> dict[str, object]:
    """``rope_theta`` and scaling, from transformers 4 (``rope_theta``, ``rope_scaling``)
    or 5 (``rope_parameters``) configs; rope types whose positions depend on the
    sequence (dynamic, yarn, longrope) are refused, not approximated."""
    params = f.raw.get("rope_parameters")
    key = "rope_parameters" if isinstance(params, Mapping) else "rope_scaling"
    src = params if isinstance(params, Mapping) else f.raw.get("rope_scaling")
    if src is not None and not isinstance(src, Mapping):
        raise f.error(key, f"must be a mapping or null, got {src!r}")
    # One view of both places: the nested mapping wins over top-level keys.
    sub = _Fields(path=f.path, model_type=f.model_type, raw={**f.raw, **(src or {})})
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


def _window(f: _Fields) -> dict[str, object]:
    return {"sliding_window": f.count("sliding_window", 0)}


def _llama_extra(f: _Fields) -> dict[str, object]:
    attn_bias = f.flag("attention_bias", False)
    if f.flag("mlp_bias", False) != attn_bias:
        raise f.error("mlp_bias", "must equal attention_bias (mixed biases are not supported)")
    return {"bias": attn_bias, **_rotary(f)}


def _mistral_extra(f: _Fields) -> dict[str, object]:
    return {**_rotary(f), **_window(f)}


def _qwen2_extra(f: _Fields) -> dict[str, object]:
    return {**_rotary(f), **(_window(f) if f.flag("use_sliding_window", False) else {})}


def _gpt2_extra(f: _Fields) -> dict[str, object]:
    if f.flag("scale_attn_by_inverse_layer_idx", False) or not f.flag("scale_attn_weights", True):
        raise f.error(
            "scale_attn_weights", "other than the standard 1/sqrt(head_dim) is not supported"
        )
    return {}


def _opt_extra(f: _Fields) -> dict[str, object]:
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
    extra: Callable[[_Fields], dict[str, object]], architecture: str, **changes: object
) -> _Family:
    """LLaMA and its kin: pre-RMSNorm, SwiGLU, rotary, grouped-query attention."""
    eps_default = float(changes.pop("eps_default", 1e-6))  # type: ignore[arg-type]
    return _Family(
        kv_heads="num_key_value_heads",
        eps="rms_norm_eps",
        eps_default=eps_default,
        activation_default="silu",
        fixed={**_LLAMA_FIXED, **changes},
        extra=extra,
        architecture=architecture,
    )


_FAMILIES: dict[str, _Family] = {
    "llama": _llama_like(_llama_extra, "LlamaForCausalLM"),
    "mistral": _llama_like(_mistral_extra, "MistralForCausalLM"),
    "qwen2": _llama_like(_qwen2_extra, "Qwen2ForCausalLM", qkv_bias=True),
    # Phi-3's checkpoints fuse q/k/v and gate/up; the runtime maps them.
    "phi3": _llama_like(_mistral_extra, "Phi3ForCausalLM", eps_default=1e-5),
    # GPT-2: pre-LayerNorm, learned positions, biases everywhere, tied head.
    "gpt2": _Family(
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
    "gpt_neox": _Family(),
    # OPT: learned positions offset by 2, ReLU.
    "opt": _Family(
        ffn="ffn_dim",
        learned_offset=2,
        eps=None,
        activation="activation_function",
        activation_default="relu",
        tied_default=True,
        extra=_opt_extra,
    ),
    # GPT-Neo: like GPT-2 but q/k/v projections have no bias.
    "gpt_neo": _Family(
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
_UNSUPPORTED = {
    "mixtral": "mixture-of-experts MLPs (num_local_experts) are not modelled",
    "qwen2_moe": "mixture-of-experts MLPs (num_experts) are not modelled",
    "gemma": "Gemma's GeGLU MLP, (1 + weight) RMSNorm and sqrt(hidden)-scaled embeddings "
    "are not modelled",
    "gemma2": "Gemma-2's logit soft-capping, GeGLU and extra norms are not modelled",
    "gemma3": "Gemma-3's GeGLU, extra norms and local/global attention are not modelled",
}


def _read(f: _Fields, fam: _Family, name: str) -> ModelSpec:
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
        "default_seq_len": min(positions, _MAX_DEFAULT_SEQ_LEN),
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


def to_hf_config(spec: ModelSpec, torch_dtype: str = "float32") -> dict[str, object]:
    """The ``config.json`` of ``spec`` for transformers (what ``autohet export`` writes).

    Rotary settings are written the transformers-4 way (``rope_theta``,
    ``rope_scaling``), which transformers 5 still reads.
    """
    fam = _FAMILIES.get(spec.family)
    if fam is None or not fam.architecture:
        runnable = ", ".join(k for k, v in _FAMILIES.items() if v.architecture)
        raise ConfigError(
            f"model {spec.name!r} of family {spec.family!r}: no HuggingFace export for it "
            f"(families with one: {runnable})"
        )
    out: dict[str, object] = {
        "architectures": [fam.architecture],
        "model_type": spec.family,
        fam.layers: spec.num_blocks,
        fam.hidden: spec.hidden_size,
        fam.heads: spec.num_heads,
        fam.ffn: spec.ffn_hidden_size,
        "vocab_size": spec.vocab_size,
        fam.positions: spec.max_position_embeddings or spec.default_seq_len,
        fam.activation: _HF_ACTIVATION[spec.activation],
        "tie_word_embeddings": spec.tied_embeddings,
        "torch_dtype": torch_dtype,
        # Token ids belong to the tokenizer, which plans do not carry; copy its files and
        # generation_config.json from the source model. Null, not a class default that
        # may lie outside this vocabulary (Phi-3's 32000).
        "pad_token_id": None,
    }
    if fam.eps:
        out[fam.eps] = spec.norm_eps
    if fam.kv_heads:
        out[fam.kv_heads] = spec.num_kv_heads
    if fam.learned_offset is None:
        out["rope_theta"] = spec.rope_theta
        r = spec.rope_scaling
        out["rope_scaling"] = (
            None
            if r is None
            else (
                {"rope_type": "linear", "factor": r.factor}
                if r.kind == "linear"
                else {
                    "rope_type": "llama3",
                    "factor": r.factor,
                    "low_freq_factor": r.low_freq_factor,
                    "high_freq_factor": r.high_freq_factor,
                    "original_max_position_embeddings": r.original_max_position_embeddings,
                }
            )
        )
    if spec.family == "llama":
        out.update(attention_bias=spec.bias, mlp_bias=spec.bias)
    if spec.family in ("mistral", "phi3", "qwen2"):
        out["sliding_window"] = spec.sliding_window or None
    if spec.family == "qwen2":
        out["use_sliding_window"] = bool(spec.sliding_window)
    return out


def runtime_architecture(family: str) -> str:
    """The HF class the built-in runtime trains for ``family``; empty when it trains none."""
    fam = _FAMILIES.get(family)
    return fam.architecture if fam else ""


def _model_name(raw: Mapping[str, object], path: Path) -> str:
    """``_name_or_path`` if the config carries one, else what the directory layout says.

    A checkpoint directory is named after the model (``Llama-2-7b-hf/config.json``);
    in the HuggingFace cache the model is two levels up
    (``models--org--name/snapshots/<hash>/config.json``). A standalone file such as
    ``mistral.json`` is named by its stem.
    """
    given = raw.get("_name_or_path")
    if isinstance(given, str) and given.strip("/ "):
        return given.strip("/ ").rsplit("/", 1)[-1]
    if path.name == "config.json" and path.parent.name:
        if path.parent.parent.name == "snapshots":
            return path.parent.parent.parent.name.rsplit("--", 1)[-1]
        return path.parent.name
    return path.stem


def load_hf_config(path: str) -> ModelSpec:
    """The :class:`ModelSpec` of the HuggingFace ``config.json`` at ``path``.

    Raises :class:`ConfigError` naming the file and the field when the file cannot
    be read, is not a JSON object, has an unsupported ``model_type`` or lacks a
    field the family needs.
    """
    try:
        data = read_regular(path, _MAX_CONFIG_BYTES)  # a FIFO or /dev/zero: refused
    except ConfigError as exc:
        raise ConfigError(
            f"{exc}; pass the path of a HuggingFace config.json or a zoo model name "
            "(see `autohet models list`)"
        ) from None
    return parse_hf_config(data, path)


def parse_hf_config(data: bytes, path: str) -> ModelSpec:
    """``load_hf_config`` of a file's bytes read elsewhere (another host's config.json,
    read there by the launcher's check): ``path`` names it in errors and the model."""
    try:
        raw: object = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); is this a config.json?") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    supported = ", ".join(_FAMILIES)
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError(
            f"{path}: field 'model_type' is missing; a HuggingFace config.json names its "
            f"architecture there (supported: {supported})"
        )
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        why = _UNSUPPORTED.get(str(model_type))
        raise ConfigError(
            f"{path}: model_type {model_type!r} is not supported"
            f"{f': {why}' if why else ''} (supported: {supported})"
        )
    fields = _Fields(path=path, model_type=model_type, raw=raw)
    return _read(fields, _FAMILIES[model_type], _model_name(raw, Path(path)))


# Fields that may differ between a plan's model and the config.json of the weights it
# starts from (``--init-from``): names and context lengths, never a shape.
FREE_FIELDS = ("name", "default_seq_len", "max_position_embeddings")


def differences(plan_model: ModelSpec, config: ModelSpec) -> list[str]:
    """``field: plan X, config Y`` for each architecture field in which a config.json
    differs from the plan's model (the runtime's ``--init-from`` check and the
    launcher's, before any worker starts, say the same)."""
    return [
        f"{f.name}: plan {getattr(plan_model, f.name)!r}, config {getattr(config, f.name)!r}"
        for f in dataclasses.fields(ModelSpec)
        if f.name not in FREE_FIELDS and getattr(plan_model, f.name) != getattr(config, f.name)
    ]
