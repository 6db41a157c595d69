"""Read a HuggingFace ``config.json`` into a :class:`ModelSpec` (pure, no transformers).

Users plan for checkpoints that are not in the zoo by pointing at the
``config.json`` that ships with every HuggingFace model. Importing transformers
for that would pull in torch and half a gigabyte of code just to read a dozen
integers, so we read the JSON ourselves and map each family's field names onto
the one architecture description the planner understands.

Each family's field names and defaults are one table in ``hffamilies``; this
module reads and checks the file, writes a spec back as a ``config.json``
(``autohet export``) and compares a config with a plan's model (``--init-from``).
It sits above ``modelspec`` and below ``models``, whose ``get_model`` reads paths
through it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from autohet_cli.errors import ConfigError
from autohet_cli.hffamilies import FAMILIES, HF_ACTIVATION, UNSUPPORTED, Fields, read_spec
from autohet_cli.modelspec import ModelSpec
from autohet_cli.regular_file import read_regular

# A config.json holds a few dozen fields (~1-10 KB); the bound keeps /dev/zero out.
_MAX_CONFIG_BYTES = 16 << 20


def to_hf_config(spec: ModelSpec, torch_dtype: str = "float32") -> dict[str, object]:
    """The ``config.json`` of ``spec`` for transformers (what ``autohet export`` writes).

    Rotary settings are written the transformers-4 way (``rope_theta``,
    ``rope_scaling``), which transformers 5 still reads.
    """
    fam = FAMILIES.get(spec.family)
    if fam is None or not fam.architecture:
        runnable = ", ".join(k for k, v in FAMILIES.items() if v.architecture)
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
        fam.activation: HF_ACTIVATION[spec.activation],
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
    fam = FAMILIES.get(family)
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
    supported = ", ".join(FAMILIES)
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError(
            f"{path}: field 'model_type' is missing; a HuggingFace config.json names its "
            f"architecture there (supported: {supported})"
        )
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        why = UNSUPPORTED.get(str(model_type))
        raise ConfigError(
            f"{path}: model_type {model_type!r} is not supported"
            f"{f': {why}' if why else ''} (supported: {supported})"
        )
    fields = Fields(path=path, model_type=model_type, raw=raw)
    return read_spec(fields, FAMILIES[model_type], _model_name(raw, Path(path)))


# Fields that may differ between a plan's model and the config.json of the weights it
# starts from (``--init-from``): names and context lengths, never a shape.
FREE_FIELDS = ("name", "default_seq_len", "max_position_embeddings")
# A deliberate change of model from the same weights (a longer context, another rope):
# ``--init-from`` allows these and says so (``context_changes``); a resume refuses them
# (``ckpt.lineage``), since the checkpoint's run trained another model.
CONTEXT_FIELDS = ("rope_theta", "rope_scaling", "sliding_window")


def _differ(plan_model: ModelSpec, config: ModelSpec, names: Iterable[str]) -> list[str]:
    return [
        f"{name}: plan {getattr(plan_model, name)!r}, config {getattr(config, name)!r}"
        for name in names
        if getattr(plan_model, name) != getattr(config, name)
    ]


def differences(plan_model: ModelSpec, config: ModelSpec) -> list[str]:
    """``field: plan X, config Y`` for each architecture field in which a config.json
    differs from the plan's model (the runtime's ``--init-from`` check and the
    launcher's, before any worker starts, say the same); the context fields are
    ``context_changes``, allowed."""
    free = (*FREE_FIELDS, *CONTEXT_FIELDS)
    return _differ(
        plan_model, config, (f.name for f in dataclasses.fields(ModelSpec) if f.name not in free)
    )


def context_changes(plan_model: ModelSpec, config: ModelSpec) -> list[str]:
    """The deliberate changes ``--init-from`` makes to the weights' model (said out loud)."""
    return _differ(plan_model, config, CONTEXT_FIELDS)
