"""The probe's contract with autohet: the spec it reads and the names its result carries.

``autohet_cli.profiling.measure`` writes the spec (``autohet.probe-spec/v1``) and reads
the result (``autohet.probe-result/v1``); this module checks the spec on the host and
fills in its defaults, so a malformed one fails before anything is measured, with a
message naming the field. Standard library only: checking a spec needs no torch.
"""

from __future__ import annotations

from typing import Any

PROBE_VERSION = "1.2"  # 1.1: layers also timed under recomputation; 1.2: fixed costs
SPEC_SCHEMA = "autohet.probe-spec/v1"
RESULT_SCHEMA = "autohet.probe-result/v1"
KINDS = ("embedding", "block", "norm", "head")
DTYPE_NAMES = ("fp32", "bf16", "fp16")  # the training dtypes (``host.DTYPES``)
_SHAPE_KEYS = {
    "embedding": ("vocab_size", "embed_dim", "hidden_size", "num_positions"),
    "block": (
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "ffn_hidden_size",
        "gated_mlp",
        "norm",
        "bias",
        "qkv_bias",
        "rotary",
    ),
    "norm": ("hidden_size", "norm"),
    "head": ("vocab_size", "embed_dim", "hidden_size", "final_norm", "norm"),
}
_SPEC_DEFAULTS: dict[str, Any] = {
    "dtype": "auto",
    "device": "auto",
    "warmup": 2,
    "repeat": 10,
    "time_budget_s": None,  # auto: 600 s on a GPU, 8 s on the CPU
    "cpu_threads": None,
    "comm": "auto",
}


class SpecError(ValueError):
    """The spec file is malformed (the message names the field)."""


def check_spec(raw: Any) -> dict[str, Any]:
    """The spec with defaults filled in; SpecError naming the field when malformed."""
    if not isinstance(raw, dict):
        raise SpecError("spec: expected a JSON object")
    if raw.get("schema") != SPEC_SCHEMA:
        raise SpecError(f"spec.schema: expected {SPEC_SCHEMA!r}, got {raw.get('schema')!r}")
    required = ("model", "seq_len", "tensor_parallel", "micro_batch_sizes", "layers")
    allowed = {"schema", *required, *_SPEC_DEFAULTS}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise SpecError(f"spec: unknown key(s) {unknown} (allowed: {sorted(allowed)})")
    missing = [k for k in required if k not in raw]
    if missing:
        raise SpecError(f"spec: missing key(s) {missing}")
    spec = {**_SPEC_DEFAULTS, **raw}
    _positive_int(spec["seq_len"], "spec.seq_len")
    for key in ("tensor_parallel", "micro_batch_sizes"):
        values = spec[key]
        if not isinstance(values, list) or not values:
            raise SpecError(f"spec.{key}: expected a non-empty list of positive integers")
        for i, v in enumerate(values):
            _positive_int(v, f"spec.{key}[{i}]")
        spec[key] = sorted(set(values))
    if spec["dtype"] not in ("auto", *DTYPE_NAMES):
        raise SpecError(f"spec.dtype: expected auto, fp32, bf16 or fp16, got {spec['dtype']!r}")
    if spec["comm"] not in ("auto", "copy"):
        raise SpecError(f"spec.comm: expected auto or copy, got {spec['comm']!r}")
    _positive_int(spec["warmup"], "spec.warmup", minimum=0)
    _positive_int(spec["repeat"], "spec.repeat")
    if spec["cpu_threads"] is not None:
        _positive_int(spec["cpu_threads"], "spec.cpu_threads")
    budget = spec["time_budget_s"]
    number = isinstance(budget, (int, float)) and not isinstance(budget, bool)  # noqa: UP038
    if budget is not None and (not number or budget <= 0):
        raise SpecError(f"spec.time_budget_s: expected a positive number, got {budget!r}")
    layers = spec["layers"]
    if not isinstance(layers, dict) or not layers:
        raise SpecError("spec.layers: expected an object {kind: shape}")
    for kind, shape in layers.items():
        if kind not in _SHAPE_KEYS:
            raise SpecError(f"spec.layers: unknown layer kind {kind!r} (known: {KINDS})")
        if not isinstance(shape, dict):
            raise SpecError(f"spec.layers.{kind}: expected an object")
        absent = [k for k in _SHAPE_KEYS[kind] if k not in shape]
        if absent:
            raise SpecError(f"spec.layers.{kind}: missing key(s) {absent}")
    return spec


def _positive_int(value: Any, at: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{at}: expected an integer >= {minimum}, got {value!r}")
