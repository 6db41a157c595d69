"""Model specs that tests and benchmarks make by their sizes, so that a made-up model
reads as one line of numbers: ``sized`` for any family, ``llama`` for the LLaMA shape
(SwiGLU, RMSNorm, no biases, rotary positions, the final norm its own layer, the head
untied unless told)."""

from __future__ import annotations

from typing import Any

from autohet_cli.models import ModelSpec

# what ``sizes`` holds, in order
SIZES = ("num_blocks", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size")
LLAMA_SHAPE: dict[str, Any] = {
    "gated_mlp": True,
    "bias": False,
    "norm": "rmsnorm",
    "separate_final_norm": True,
    "tied_embeddings": False,
}


def sized(name: str, family: str, sizes: tuple[int, ...], **fields: Any) -> ModelSpec:
    """``sizes``: blocks, hidden size, heads, KV heads, FFN width, vocabulary;
    ``fields``: the spec's others."""
    counts: dict[str, Any] = dict(zip(SIZES, sizes, strict=True))
    return ModelSpec(name=name, family=family, **counts, **fields)


def llama(name: str, sizes: tuple[int, ...], **fields: Any) -> ModelSpec:
    """A LLaMA-shaped spec; ``fields`` add to or override the shape."""
    return sized(name, "llama", sizes, **{**LLAMA_SHAPE, **fields})
