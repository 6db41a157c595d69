"""The model zoo and the HuggingFace config reader against published checkpoints.

Parameter counts are compared with the exact totals of the released weights
(``sum(p.numel() for p in model.parameters())``), so an off-by-a-bias mistake in
the layer arithmetic fails here rather than as a plan that does not fit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from autohet_cli.errors import ConfigError, UnknownNameError
from autohet_cli.hfconfig import load_hf_config
from autohet_cli.models import ZOO, ModelSpec, canonical_model_name, get_model

# --- (a) parameter counts ----------------------------------------------------

RELEASED_PARAMS = {
    "LLaMA-2-7B": 6_738_415_616,
    "LLaMA-2-13B": 13_015_864_320,
    "LLaMA-2-70B": 68_976_648_192,
    "LLaMA-3-8B": 8_030_261_248,
    "LLaMA-3-70B": 70_553_706_496,
    "OPT-350M": 331_196_416,
    "GPT-Neo-2.7B": 2_651_307_520,
}

# Nominal sizes: GPT-3 paper labels and Narayanan et al. 2021, Table 1.
NOMINAL_PARAMS = {
    "GPT-1.3B": 1.3e9,
    "GPT-2.7B": 2.7e9,
    "GPT-6.7B": 6.7e9,
    "GPT-13B": 13e9,
    "GPT-30B": 30e9,
    "Megatron-1.7B": 1.7e9,
    "Megatron-3.6B": 3.6e9,
    "Megatron-7.5B": 7.5e9,
    "Megatron-18B": 18.4e9,
    "Megatron-39B": 39.1e9,
}


@pytest.mark.parametrize(("name", "expected"), RELEASED_PARAMS.items())
def test_zoo_params_equal_released_checkpoints(name: str, expected: int) -> None:
    assert ZOO[name].num_params == expected


def _narayanan_params(m: ModelSpec) -> float:
    """P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)), Narayanan et al. 2021, eq. (2)."""
    n, h, v, s = m.num_blocks, m.hidden_size, m.vocab_size, m.num_positions
    return 12 * n * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * n * h))


@pytest.mark.parametrize(("name", "nominal"), NOMINAL_PARAMS.items())
def test_gpt_params_match_closed_form_and_label(name: str, nominal: float) -> None:
    m = ZOO[name]
    assert m.num_params == pytest.approx(_narayanan_params(m), rel=0.01)
    assert m.num_params == pytest.approx(nominal, rel=0.03)


def test_tied_head_holds_the_embedding_but_totals_count_it_once() -> None:
    for m in ZOO.values():
        layers = m.layers()
        held = sum(x.num_params - x.shared_params for x in layers)
        assert m.num_params == held - m.num_padding_params  # totals: the released model
        head = layers[-1]
        width = m.embed_proj_dim or m.hidden_size
        tied = m.padded_vocab_size * width if m.tied_embeddings else 0
        assert head.shared_params == tied
        assert head.num_params >= tied  # the last stage pays memory for its copy


# --- (b) layer lists -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "num_layers"),
    [("OPT-350M", 26), ("GPT-Neo-2.7B", 34), ("LLaMA-3-8B", 35), ("OPT-30B", 50)],
)
def test_layer_list_shape_matches_measured_data(name: str, num_layers: int) -> None:
    layers = ZOO[name].layers()
    assert len(layers) == ZOO[name].num_layers == num_layers
    assert [layer.index for layer in layers] == list(range(num_layers))
    assert layers[0].kind == "embedding"
    assert layers[-1].kind == "head"
    blocks = [layer for layer in layers if layer.kind == "block"]
    assert len(blocks) == ZOO[name].num_blocks
    assert [b.name for b in blocks] == [f"block.{i}" for i in range(len(blocks))]


def test_llama_keeps_final_norm_as_its_own_layer() -> None:
    layers = ZOO["LLaMA-3-8B"].layers()
    assert [layer.kind for layer in layers[-2:]] == ["norm", "head"]
    assert layers[-2].num_params == 4096


# --- (c) names ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "name"),
    [
        ("OPT-350", "OPT-350M"),
        ("opt_350m", "OPT-350M"),
        ("LLAMA-3-8", "LLaMA-3-8B"),
        ("GPT-Neo-2.7", "GPT-Neo-2.7B"),
        ("OPT-30", "OPT-30B"),
        ("LLaMA-2-70B", "LLaMA-2-70B"),
        ("llama-2-7b", "LLaMA-2-7B"),
    ],
)
def test_canonical_model_name(raw: str, name: str) -> None:
    assert canonical_model_name(raw) == name
    assert get_model(raw) is ZOO[name]


def test_unknown_model_name_lists_the_zoo() -> None:
    with pytest.raises(UnknownNameError) as err:
        canonical_model_name("BERT-large")
    message = str(err.value)
    assert "BERT-large" in message
    assert all(name in message for name in ZOO)


# --- (d) FLOPs ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["GPT-2.7B", "LLaMA-2-7B", "LLaMA-3-8B", "OPT-350M"])
def test_block_fwd_flops_are_two_per_param_plus_attention(name: str) -> None:
    m = ZOO[name]
    block = next(layer for layer in m.layers() if layer.kind == "block")
    seq = 2048
    per_token = block.fwd_flops(seq, micro_batch_size=1) / seq
    expected = 2 * block.num_params + 4 * m.hidden_size * seq
    # Biases and norms add parameters but no matmul FLOPs: a fraction of a percent.
    assert per_token == pytest.approx(expected, rel=0.005)
    assert block.fwd_flops(seq, micro_batch_size=4) == pytest.approx(4 * per_token * seq)


def test_head_flops_cover_the_tied_vocabulary_projection() -> None:
    m = ZOO["GPT-2.7B"]
    head = m.layers()[-1]
    assert head.matmul_flops_per_token == 2 * m.padded_vocab_size * m.hidden_size


@pytest.mark.parametrize("name", ["GPT-1.3B", "OPT-350M", "LLaMA-3-8B", "GPT-Neo-2.7B"])
def test_layers_count_the_padded_vocabulary(name: str) -> None:
    """Megatron-style padding to a multiple of 128: every TP degree of 1-8 splits it."""
    m = ZOO[name]
    assert m.padded_vocab_size % 128 == 0
    assert 0 <= m.padded_vocab_size - m.vocab_size < 128
    assert m.layers()[0].num_params == m.padded_vocab_size * (m.embed_proj_dim or m.hidden_size) + (
        m.num_positions * m.hidden_size
        + (m.embed_proj_dim * m.hidden_size if m.embed_proj_dim else 0)
    )
    problems = [p for tp in (1, 2, 4, 8) for p in m.tensor_parallel_problems(tp)]
    assert not [p for p in problems if "vocab" in p]
    assert ZOO["GPT-1.3B"].padded_vocab_size == 50304  # 50257 rounded up: TP 2 works


# --- (e) HuggingFace config.json ---------------------------------------------
# Verbatim contents of the config.json files published on the HuggingFace Hub.

HF_CONFIGS: dict[str, str] = {
    "meta-llama/Llama-2-7b-hf": """{
  "_name_or_path": "meta-llama/Llama-2-7b-hf",
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 11008,
  "max_position_embeddings": 4096,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "transformers_version": "4.31.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
}""",
    "mistralai/Mistral-7B-v0.1": """{
  "architectures": ["MistralForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.34.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
}""",
    "gpt2": """{
  "activation_function": "gelu_new",
  "architectures": ["GPT2LMHeadModel"],
  "attn_pdrop": 0.1,
  "bos_token_id": 50256,
  "embd_pdrop": 0.1,
  "eos_token_id": 50256,
  "initializer_range": 0.02,
  "layer_norm_epsilon": 1e-05,
  "model_type": "gpt2",
  "n_ctx": 1024,
  "n_embd": 768,
  "n_head": 12,
  "n_layer": 12,
  "n_positions": 1024,
  "resid_pdrop": 0.1,
  "summary_activation": null,
  "summary_first_dropout": 0.1,
  "summary_proj_to_labels": true,
  "summary_type": "cls_index",
  "summary_use_proj": true,
  "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}},
  "vocab_size": 50257
}""",
    "gpt2-medium": """{
  "activation_function": "gelu_new",
  "architectures": ["GPT2LMHeadModel"],
  "attn_pdrop": 0.1,
  "bos_token_id": 50256,
  "embd_pdrop": 0.1,
  "eos_token_id": 50256,
  "initializer_range": 0.02,
  "layer_norm_epsilon": 1e-05,
  "model_type": "gpt2",
  "n_ctx": 1024,
  "n_embd": 1024,
  "n_head": 16,
  "n_layer": 24,
  "n_positions": 1024,
  "n_special": 0,
  "predict_special_tokens": true,
  "resid_pdrop": 0.1,
  "summary_activation": null,
  "summary_first_dropout": 0.1,
  "summary_proj_to_labels": true,
  "summary_type": "cls_index",
  "summary_use_proj": true,
  "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}},
  "vocab_size": 50257
}""",
    "EleutherAI/pythia-1b": """{
  "architectures": ["GPTNeoXForCausalLM"],
  "bos_token_id": 0,
  "eos_token_id": 0,
  "hidden_act": "gelu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "layer_norm_eps": 1e-05,
  "max_position_embeddings": 2048,
  "model_type": "gpt_neox",
  "num_attention_heads": 8,
  "num_hidden_layers": 16,
  "rotary_emb_base": 10000,
  "rotary_pct": 0.25,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "transformers_version": "4.24.0",
  "use_cache": true,
  "use_parallel_residual": true,
  "vocab_size": 50304
}""",
    "facebook/opt-350m": """{
  "_name_or_path": "opt-350m",
  "activation_dropout": 0.0,
  "activation_function": "relu",
  "architectures": ["OPTForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 2,
  "do_layer_norm_before": false,
  "dropout": 0.1,
  "eos_token_id": 2,
  "ffn_dim": 4096,
  "hidden_size": 1024,
  "init_std": 0.02,
  "layerdrop": 0.0,
  "max_position_embeddings": 2048,
  "model_type": "opt",
  "num_attention_heads": 16,
  "num_hidden_layers": 24,
  "pad_token_id": 1,
  "prefix": "</s>",
  "torch_dtype": "float16",
  "transformers_version": "4.20.0.dev0",
  "use_cache": true,
  "vocab_size": 50272,
  "word_embed_proj_dim": 512
}""",
    "facebook/opt-1.3b": """{
  "_name_or_path": "facebook/opt-1.3b",
  "activation_dropout": 0.0,
  "activation_function": "relu",
  "architectures": ["OPTForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 2,
  "do_layer_norm_before": true,
  "dropout": 0.1,
  "eos_token_id": 2,
  "ffn_dim": 8192,
  "hidden_size": 2048,
  "init_std": 0.02,
  "layerdrop": 0.0,
  "max_position_embeddings": 2048,
  "model_type": "opt",
  "num_attention_heads": 32,
  "num_hidden_layers": 24,
  "pad_token_id": 1,
  "prefix": "</s>",
  "torch_dtype": "float16",
  "transformers_version": "4.21.0.dev0",
  "use_cache": true,
  "vocab_size": 50272,
  "word_embed_proj_dim": 2048
}""",
    "EleutherAI/gpt-neo-125M": """{
  "activation_function": "gelu_new",
  "architectures": ["GPTNeoForCausalLM"],
  "attention_dropout": 0,
  "attention_layers": ["global", "local", "global", "local", "global", "local",
                       "global", "local", "global", "local", "global", "local"],
  "attention_types": [[["global", "local"], 6]],
  "bos_token_id": 50256,
  "embed_dropout": 0,
  "eos_token_id": 50256,
  "gradient_checkpointing": false,
  "hidden_size": 768,
  "initializer_range": 0.02,
  "intermediate_size": null,
  "layer_norm_epsilon": 1e-05,
  "max_position_embeddings": 2048,
  "model_type": "gpt_neo",
  "num_heads": 12,
  "num_layers": 12,
  "resid_dropout": 0,
  "summary_activation": null,
  "summary_first_dropout": 0.1,
  "summary_proj_to_labels": true,
  "summary_type": "cls_index",
  "summary_use_proj": true,
  "transformers_version": "4.9.0.dev0",
  "use_cache": true,
  "vocab_size": 50257,
  "window_size": 256
}""",
}

HF_PARAMS = {
    "meta-llama/Llama-2-7b-hf": 6_738_415_616,
    "mistralai/Mistral-7B-v0.1": 7_241_732_096,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "EleutherAI/pythia-1b": 1_011_781_632,
    "facebook/opt-350m": 331_196_416,
    "facebook/opt-1.3b": 1_315_758_080,
    "EleutherAI/gpt-neo-125M": 125_198_592,
}


# Qwen2 (q/k/v biases, tied head) and Phi-3 (fused weights, read like LLaMA).
HF_CONFIGS["Qwen/Qwen2-0.5B"] = """{
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 896,
  "initializer_range": 0.02,
  "intermediate_size": 4864,
  "max_position_embeddings": 131072,
  "max_window_layers": 24,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}"""
HF_CONFIGS["microsoft/Phi-3-mini-4k-instruct"] = """{
  "_name_or_path": "Phi-3-mini-4k-instruct",
  "architectures": ["Phi3ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "embd_pdrop": 0.0,
  "eos_token_id": 32000,
  "hidden_act": "silu",
  "hidden_size": 3072,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 4096,
  "model_type": "phi3",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "original_max_position_embeddings": 4096,
  "pad_token_id": 32000,
  "resid_pdrop": 0.0,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 10000.0,
  "sliding_window": 2047,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.2",
  "use_cache": true,
  "vocab_size": 32064
}"""
HF_PARAMS.update(
    {"Qwen/Qwen2-0.5B": 494_032_768, "microsoft/Phi-3-mini-4k-instruct": 3_821_079_552}
)


def _write_config(tmp_path: Path, repo: str, text: str | None = None) -> str:
    """Lay the file out as a checkpoint directory named after the repository."""
    folder = tmp_path / repo.rsplit("/", 1)[-1]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(HF_CONFIGS[repo] if text is None else text, encoding="utf-8")
    return str(path)


def _edited(repo: str, **changes: object) -> str:
    raw = json.loads(HF_CONFIGS[repo])
    for key, value in changes.items():
        if value is ...:
            del raw[key]
        else:
            raw[key] = value
    return json.dumps(raw)


@pytest.mark.parametrize(("repo", "expected"), HF_PARAMS.items())
def test_hf_config_param_counts_are_exact(tmp_path: Path, repo: str, expected: int) -> None:
    spec = load_hf_config(_write_config(tmp_path, repo))
    assert spec.num_params == expected
    assert spec.name == repo.rsplit("/", 1)[-1]
    assert spec.family == json.loads(HF_CONFIGS[repo])["model_type"]


def test_hf_llama_config_equals_the_zoo_entry(tmp_path: Path) -> None:
    spec = load_hf_config(_write_config(tmp_path, "meta-llama/Llama-2-7b-hf"))
    assert spec.layers() == ZOO["LLaMA-2-7B"].layers()
    assert spec.default_seq_len == 4096


def test_hf_opt_350m_config_equals_the_zoo_entry(tmp_path: Path) -> None:
    spec = load_hf_config(_write_config(tmp_path, "facebook/opt-350m"))
    assert spec.layers() == ZOO["OPT-350M"].layers()
    assert not spec.final_norm
    assert spec.embed_proj_dim == 512


def test_hf_mistral_reads_grouped_query_heads(tmp_path: Path) -> None:
    spec = load_hf_config(_write_config(tmp_path, "mistralai/Mistral-7B-v0.1"))
    assert (spec.num_heads, spec.num_kv_heads) == (32, 8)
    assert spec.default_seq_len == 8192  # capped: 32k positions are not the training length


def test_hf_gpt_neox_has_no_learned_positions_and_untied_head(tmp_path: Path) -> None:
    spec = load_hf_config(_write_config(tmp_path, "EleutherAI/pythia-1b"))
    assert spec.num_positions == 0
    assert not spec.tied_embeddings
    assert spec.layers()[-1].num_params == 50304 * 2048 + 2 * 2048


def test_hf_gpt2_with_explicit_n_inner(tmp_path: Path) -> None:
    path = _write_config(tmp_path, "gpt2", _edited("gpt2", n_inner=1024))
    assert load_hf_config(path).ffn_hidden_size == 1024


def test_hf_model_name_falls_back_to_the_file(tmp_path: Path) -> None:
    by_file = tmp_path / "my-gpt.json"
    by_file.write_text(HF_CONFIGS["gpt2"], encoding="utf-8")
    assert load_hf_config(str(by_file)).name == "my-gpt"
    cache = tmp_path / "models--EleutherAI--pythia-1b" / "snapshots" / "0123abc"
    cache.mkdir(parents=True)
    (cache / "config.json").write_text(HF_CONFIGS["EleutherAI/pythia-1b"], encoding="utf-8")
    assert load_hf_config(str(cache / "config.json")).name == "pythia-1b"


def test_get_model_accepts_a_config_path(tmp_path: Path) -> None:
    assert get_model(_write_config(tmp_path, "gpt2")).num_params == 124_439_808


def test_hf_unsupported_model_type(tmp_path: Path) -> None:
    path = _write_config(tmp_path, "gpt2", _edited("gpt2", model_type="bert"))
    with pytest.raises(ConfigError, match="model_type 'bert' is not supported") as err:
        load_hf_config(path)
    assert path in str(err.value)
    assert "llama, mistral, qwen2, phi3, gpt2, gpt_neox, opt, gpt_neo" in str(err.value)


@pytest.mark.parametrize(
    ("repo", "field"),
    [
        ("gpt2", "model_type"),
        ("gpt2", "n_embd"),
        ("meta-llama/Llama-2-7b-hf", "intermediate_size"),
        ("EleutherAI/pythia-1b", "num_hidden_layers"),
        ("facebook/opt-1.3b", "ffn_dim"),
        ("EleutherAI/gpt-neo-125M", "num_heads"),
    ],
)
def test_hf_missing_field_is_named(tmp_path: Path, repo: str, field: str) -> None:
    path = _write_config(tmp_path, repo, _edited(repo, **{field: ...}))
    with pytest.raises(ConfigError, match=f"'{field}' is missing") as err:
        load_hf_config(path)
    assert str(err.value).startswith(path)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hidden_size": "4096"}, "hidden_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_attention_heads": 3}, "num_attention_heads"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings"),
        ({"head_dim": 64}, "head_dim"),
    ],
)
def test_hf_bad_field_is_named(tmp_path: Path, changes: dict[str, object], field: str) -> None:
    repo = "meta-llama/Llama-2-7b-hf"
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        load_hf_config(_write_config(tmp_path, repo, _edited(repo, **changes)))


def test_hf_unreadable_or_malformed_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_hf_config(str(tmp_path / "absent" / "config.json"))
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf_config(_write_config(tmp_path, "gpt2", "{not json"))
    with pytest.raises(ConfigError, match="expected a JSON object"):
        load_hf_config(_write_config(tmp_path, "gpt2", "[1, 2]"))


def test_hf_qwen2_and_phi3_read_as_the_llama_family(tmp_path: Path) -> None:
    qwen = load_hf_config(_write_config(tmp_path, "Qwen/Qwen2-0.5B"))
    assert (qwen.qkv_bias, qwen.bias, qwen.tied_embeddings) == (True, False, True)
    assert qwen.sliding_window == 0  # use_sliding_window is false
    assert qwen.rope_theta == 1e6 and qwen.norm_eps == 1e-6
    phi = load_hf_config(_write_config(tmp_path, "microsoft/Phi-3-mini-4k-instruct"))
    assert phi.sliding_window == 2047 and phi.default_seq_len == 4096
    assert (phi.num_kv_heads, phi.ffn_hidden_size, phi.padded_vocab_size) == (32, 8192, 32128)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "mixtral"}, "mixtral' is not supported: mixture-of-experts"),
        ({"model_type": "gemma"}, "gemma' is not supported: Gemma's GeGLU"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor' (0.5) != 1.0"),
        ({"hidden_act": "gelu_fast"}, "'hidden_act' 'gelu_fast' is not supported"),
    ],
)
def test_hf_unsupported_features_name_what_is_missing(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    repo = "microsoft/Phi-3-mini-4k-instruct"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_hf_config(_write_config(tmp_path, repo, _edited(repo, **changes)))
