"""A model's architecture as plan artifacts carry it: ``ModelSpec`` <-> mapping (pure).

A plan made from a HuggingFace ``config.json`` must be enough on every host: the
workers rebuild the model from the plan alone, without the config file or the
zoo. So the plan's ``model.architecture`` holds every ``ModelSpec`` field, read
back strictly (unknown keys rejected, types checked) like every artifact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from autohet_cli.errors import ConfigError
from autohet_cli.models import ModelSpec, RopeScaling
from autohet_cli.yamlio import as_mapping, check_keys, coerce

_FIELDS = {f.name: f for f in dataclasses.fields(ModelSpec)}
_REQUIRED = [n for n, f in _FIELDS.items() if f.default is dataclasses.MISSING]
_SPECIAL = ("qkv_bias", "rope_scaling")  # optional values: null allowed
_ROPE_FIELDS = {f.name: f for f in dataclasses.fields(RopeScaling)}
ROPE_KINDS = ("linear", "llama3")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")


def spec_to_dict(spec: ModelSpec) -> dict[str, Any]:
    """Every field, in declaration order; ``rope_scaling`` as a mapping or null."""
    out = {name: getattr(spec, name) for name in _FIELDS}
    if spec.rope_scaling is not None:
        out["rope_scaling"] = dataclasses.asdict(spec.rope_scaling)
    return out


def _typ(name: str, fields: Mapping[str, dataclasses.Field[Any]]) -> type:
    f = fields[name]
    if f.default is dataclasses.MISSING:
        return str if name in ("name", "family", "kind") else int
    return type(f.default)


def spec_from_dict(raw: Any, where: str) -> ModelSpec:
    d = as_mapping(raw, where)
    check_keys(d, where, _REQUIRED, [n for n in _FIELDS if n not in _REQUIRED])
    values: dict[str, Any] = {}
    for name, value in d.items():
        at = f"{where}.{name}"
        if name == "qkv_bias":
            values[name] = None if value is None else coerce(value, bool, at)
        elif name == "rope_scaling":
            values[name] = None if value is None else _rope_from_dict(value, at)
        elif value is None:
            raise ConfigError(f"{at}: missing value")
        else:
            values[name] = coerce(value, _typ(name, _FIELDS), at)
    try:
        spec = ModelSpec(**values)
    except ConfigError as exc:  # a size past the bounds of limits.py
        raise ConfigError(f"{where}: {exc}") from None
    _check(spec, where)
    return spec


def _rope_from_dict(raw: Any, where: str) -> RopeScaling:
    d = as_mapping(raw, where)
    check_keys(
        d, where, ["kind", "factor"], [n for n in _ROPE_FIELDS if n not in ("kind", "factor")]
    )
    rope = RopeScaling(
        **{
            n: coerce(v, _typ(n, _ROPE_FIELDS) if n != "factor" else float, f"{where}.{n}")
            for n, v in d.items()
        }
    )
    if rope.kind not in ROPE_KINDS:
        raise ConfigError(f"{where}.kind: {rope.kind!r} is not one of {', '.join(ROPE_KINDS)}")
    return rope


def _check(spec: ModelSpec, where: str) -> None:
    """What the layer arithmetic and the runtime assume of any architecture."""
    for name in (
        "num_blocks",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "ffn_hidden_size",
        "vocab_size",
        "make_vocab_size_divisible_by",
    ):
        if getattr(spec, name) <= 0:
            raise ConfigError(f"{where}.{name}: must be positive, got {getattr(spec, name)}")
    if spec.hidden_size % spec.num_heads:
        raise ConfigError(
            f"{where}.num_heads: {spec.num_heads} must divide hidden_size {spec.hidden_size}"
        )
    if spec.num_heads % spec.num_kv_heads:
        raise ConfigError(
            f"{where}.num_kv_heads: {spec.num_kv_heads} must divide num_heads {spec.num_heads}"
        )
    if spec.norm not in NORMS:
        raise ConfigError(f"{where}.norm: {spec.norm!r} is not one of {', '.join(NORMS)}")
    if spec.activation not in ACTIVATIONS:
        raise ConfigError(
            f"{where}.activation: {spec.activation!r} is not one of {', '.join(ACTIVATIONS)}"
        )
