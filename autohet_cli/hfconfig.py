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

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from autohet_cli.errors import ConfigError
from autohet_cli.models import ModelSpec

# Pretraining context of the families we read. Configs of long-context models
# advertise 32k-128k positions reached by later fine-tuning; planning a
# pretraining run at that length by default would mislead. --seq-len overrides.
_MAX_DEFAULT_SEQ_LEN = 8192


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


def _llama(f: _Fields, name: str) -> ModelSpec:
    """LLaMA and Mistral: pre-RMSNorm, SwiGLU, rotary, grouped-query attention."""
    hidden = f.count("hidden_size")
    heads = f.heads(hidden, "num_attention_heads")
    kv_heads = f.count("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.error("num_key_value_heads", f"({kv_heads}) must divide {heads} heads")
    head_dim = f.count("head_dim", hidden // heads)
    if head_dim != hidden // heads:
        raise f.error("head_dim", f"({head_dim}) != hidden_size / heads is not supported")
    attn_bias = f.flag("attention_bias", False)
    if f.flag("mlp_bias", False) != attn_bias:
        raise f.error("mlp_bias", "must equal attention_bias (mixed biases are not supported)")
    return ModelSpec(
        name=name,
        family=f.model_type,
        num_blocks=f.count("num_hidden_layers"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=f.count("intermediate_size"),
        vocab_size=f.count("vocab_size"),
        gated_mlp=True,
        bias=attn_bias,
        norm="rmsnorm",
        tied_embeddings=f.flag("tie_word_embeddings", False),
        separate_final_norm=True,  # as the zoo's LLaMA entries and their profiles
        default_seq_len=f.seq_len("max_position_embeddings"),
    )


def _gpt2(f: _Fields, name: str) -> ModelSpec:
    """GPT-2: pre-LayerNorm, learned positions, biases everywhere, tied head."""
    hidden = f.count("n_embd")
    heads = f.heads(hidden, "n_head")
    positions = f.count("n_positions")
    return ModelSpec(
        name=name,
        family=f.model_type,
        num_blocks=f.count("n_layer"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=f.count("n_inner", 4 * hidden),
        vocab_size=f.count("vocab_size"),
        num_positions=positions,
        tied_embeddings=f.flag("tie_word_embeddings", True),
        default_seq_len=min(positions, _MAX_DEFAULT_SEQ_LEN),
    )


def _gpt_neox(f: _Fields, name: str) -> ModelSpec:
    """GPT-NeoX (Pythia): rotary positions, biases everywhere, untied head by default."""
    hidden = f.count("hidden_size")
    heads = f.heads(hidden, "num_attention_heads")
    return ModelSpec(
        name=name,
        family=f.model_type,
        num_blocks=f.count("num_hidden_layers"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=f.count("intermediate_size"),
        vocab_size=f.count("vocab_size"),
        tied_embeddings=f.flag("tie_word_embeddings", False),
        default_seq_len=f.seq_len("max_position_embeddings"),
    )


def _opt(f: _Fields, name: str) -> ModelSpec:
    """OPT: learned positions offset by 2; post-LN variants (350M) have no final norm."""
    hidden = f.count("hidden_size")
    heads = f.heads(hidden, "num_attention_heads")
    embed_dim = f.count("word_embed_proj_dim", hidden)
    final_norm = f.flag("do_layer_norm_before", True) and not f.flag(
        "_remove_final_layer_norm", False
    )
    return ModelSpec(
        name=name,
        family=f.model_type,
        num_blocks=f.count("num_hidden_layers"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=f.count("ffn_dim"),
        vocab_size=f.count("vocab_size"),
        num_positions=f.count("max_position_embeddings") + 2,
        bias=f.flag("enable_bias", True),
        tied_embeddings=f.flag("tie_word_embeddings", True),
        final_norm=final_norm,
        embed_proj_dim=embed_dim if embed_dim != hidden else 0,
        default_seq_len=f.seq_len("max_position_embeddings"),
    )


def _gpt_neo(f: _Fields, name: str) -> ModelSpec:
    """GPT-Neo: like GPT-2 but q/k/v projections have no bias."""
    hidden = f.count("hidden_size")
    heads = f.heads(hidden, "num_heads")
    return ModelSpec(
        name=name,
        family=f.model_type,
        num_blocks=f.count("num_layers"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=f.count("intermediate_size", 4 * hidden),
        vocab_size=f.count("vocab_size"),
        num_positions=f.count("max_position_embeddings"),
        qkv_bias=False,
        tied_embeddings=f.flag("tie_word_embeddings", True),
        default_seq_len=f.seq_len("max_position_embeddings"),
    )


_READERS: dict[str, Callable[[_Fields, str], ModelSpec]] = {
    "llama": _llama,
    "mistral": _llama,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "opt": _opt,
    "gpt_neo": _gpt_neo,
}


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
        raw: object = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot read ({exc.strerror or exc}); pass the path of a "
            "HuggingFace config.json or a zoo model name (see `autohet models list`)"
        ) from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); is this a config.json?") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    supported = ", ".join(_READERS)
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError(
            f"{path}: field 'model_type' is missing; a HuggingFace config.json names its "
            f"architecture there (supported: {supported})"
        )
    if not isinstance(model_type, str) or model_type not in _READERS:
        raise ConfigError(
            f"{path}: model_type {model_type!r} is not supported (supported: {supported})"
        )
    fields = _Fields(path=path, model_type=model_type, raw=raw)
    return _READERS[model_type](fields, _model_name(raw, Path(path)))
