"""What ``probe.py`` is asked to measure: the spec ``autohet profile run`` sends (pure).

``spec_for(model, ...)`` gives the JSON spec (``autohet.probe-spec/v1``): the
shape of each distinct kind of layer, the TP degrees and micro-batch sizes, the
precision and the timing budget. ``profiling.measure`` checks the result's echo
of the shapes against ``layer_shapes`` before it trusts the times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autohet_cli.errors import ProfileError
from autohet_cli.models import ModelSpec

SPEC_SCHEMA = "autohet.probe-spec/v1"
DTYPES = ("auto", "fp32", "bf16", "fp16")


def layer_shapes(model: ModelSpec) -> dict[str, dict[str, Any]]:
    """The shape of each distinct kind of partitionable layer, as the probe builds it."""
    h = model.hidden_size
    e = model.embed_proj_dim or h
    shapes: dict[str, dict[str, Any]] = {
        "embedding": {
            "vocab_size": model.padded_vocab_size,  # as trained: see ModelSpec
            "embed_dim": e,
            "hidden_size": h,
            "num_positions": model.num_positions,
        },
        "block": {
            "hidden_size": h,
            "num_heads": model.num_heads,
            "num_kv_heads": model.num_kv_heads,
            "ffn_hidden_size": model.ffn_hidden_size,
            "gated_mlp": model.gated_mlp,
            "norm": model.norm,
            "bias": model.bias,
            "qkv_bias": model.bias if model.qkv_bias is None else model.qkv_bias,
            "rotary": model.num_positions == 0,
        },
        "head": {
            "vocab_size": model.padded_vocab_size,  # as trained: see ModelSpec
            "embed_dim": e,
            "hidden_size": h,
            "final_norm": model.final_norm and not model.separate_final_norm,
            "norm": model.norm,
        },
    }
    if model.separate_final_norm:
        shapes["norm"] = {"hidden_size": h, "norm": model.norm}
    return shapes


def spec_for(
    model: ModelSpec,
    seq_len: int,
    tps: Sequence[int],
    mbss: Sequence[int],
    dtype: str = "auto",
    *,
    warmup: int = 2,
    repeat: int = 10,
    time_budget_s: float | None = None,
    cpu_threads: int | None = None,
    comm: str = "auto",
) -> dict[str, Any]:
    """The JSON spec ``probe.py`` takes to measure ``model``.

    ``dtype`` ``auto`` is bf16 on a GPU that supports it (else fp16) and fp32 on
    the CPU. ``time_budget_s`` None lets the probe choose (600 s on a GPU, 8 s on
    the CPU); repeats drop to fit it, never below one. ``cpu_threads`` sets the
    threads of a CPU device (e.g. the host's cores divided by the cluster file's
    ``cpu`` count); ``comm`` ``copy`` skips the real all-reduce and estimates TP
    communication from copy bandwidth.
    """
    if seq_len < 1:
        raise ProfileError(f"seq_len: must be at least 1, got {seq_len}")
    for name, values in (("tensor_parallel", tps), ("micro_batch_sizes", mbss)):
        if not values or any(v < 1 for v in values):
            raise ProfileError(f"{name}: expected positive integers, got {list(values)}")
    if dtype not in DTYPES:
        raise ProfileError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if comm not in ("auto", "copy"):
        raise ProfileError(f"comm: expected auto or copy, got {comm!r}")
    return {
        "schema": SPEC_SCHEMA,
        "model": model.name,
        "seq_len": seq_len,
        "tensor_parallel": sorted(set(tps)),
        "micro_batch_sizes": sorted(set(mbss)),
        "dtype": dtype,
        "warmup": warmup,
        "repeat": repeat,
        "time_budget_s": time_budget_s,
        "cpu_threads": cpu_threads,
        "comm": comm,
        "layers": layer_shapes(model),
    }
