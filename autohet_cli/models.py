"""Model zoo: the shipped models by name, and the lookup every command uses (pure).

``get_model`` takes a zoo name (spelled as the measured data and users write it)
or the path of a HuggingFace ``config.json`` (``hfconfig``). The spec itself
(``ModelSpec``) lives in ``modelspec`` and its layers in ``layerspec``; both are
re-exported here, where most callers import them from.
"""

from __future__ import annotations

import difflib

from autohet_cli.errors import UnknownNameError
from autohet_cli.hfconfig import load_hf_config
from autohet_cli.layerspec import CHUNK_LOGIT_BYTES as CHUNK_LOGIT_BYTES
from autohet_cli.layerspec import IGNORE_INDEX as IGNORE_INDEX
from autohet_cli.layerspec import LayerSpec as LayerSpec
from autohet_cli.layerspec import loss_chunk_tokens as loss_chunk_tokens
from autohet_cli.modelspec import VOCAB_MULTIPLE as VOCAB_MULTIPLE
from autohet_cli.modelspec import ModelSpec as ModelSpec
from autohet_cli.modelspec import RopeScaling as RopeScaling


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
        return load_hf_config(name_or_path)
    return ZOO[canonical_model_name(name_or_path)]
