"""Tiny random HuggingFace models of every built-in family, for the reference tests.

transformers is a test-only dependency (the ``dev`` extra); nothing here touches
the hub: configs are built locally and saved with ``save_pretrained``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

VOCAB = 250  # not a multiple of 128: every model trains with 6 padding rows
SEQ_LEN = 32
_SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "phi3", "gpt2")


def hf_config(family: str) -> Any:
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(**_SMALL, rms_norm_eps=1e-5)
    if family == "llama3":
        return tf.LlamaConfig(**_SMALL, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)
    if family == "mistral":
        return tf.MistralConfig(**_SMALL, sliding_window=64)
    if family == "qwen2":
        return tf.Qwen2Config(**_SMALL, tie_word_embeddings=True)
    if family == "phi3":
        return tf.Phi3Config(**_SMALL, pad_token_id=0)
    if family == "gpt2":
        return tf.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
            eos_token_id=2,
        )  # fmt: skip
    raise ValueError(family)


def random_model(family: str, seed: int = 0) -> Any:
    """A transformers model with every parameter random (biases and norms too)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(family)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


def save_random_model(family: str, directory: Path, *, max_shard_size: str = "5GB") -> Any:
    model = random_model(family)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return model


def worst_relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| / max |theirs|."""
    return float((ours - theirs).abs().max() / theirs.abs().max())
