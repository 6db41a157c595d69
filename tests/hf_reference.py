"""Tiny random HuggingFace models of every built-in family, for the reference tests.

transformers is a test-only dependency (the ``dev`` extra); nothing here touches
the hub: configs are built locally and saved with ``save_pretrained``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from autohet_cli.models import ModelSpec
    from autohet_cli.runtime.model_api import ModelRequest
    from autohet_cli.runtime.stage import StageModule

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


def dcp_checkpoint(
    stage: torch.nn.Module, job_dir: Path, *, plan: str = "t.v1", plan_sha256: str = "0" * 64
) -> Path:
    """A step as the runtime writes it: DCP keyed by full names, a manifest signed with
    the job key listing every file's sha256, COMPLETE last (docs/checkpoint-format.md)."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    from autohet_cli.ckpt.files import sha256_file
    from autohet_cli.ckpt.format import (
        KEY_FILE,
        Manifest,
        ManifestFile,
        new_key,
        signed_manifest_text,
    )

    step_dir = job_dir / "step-00000003"
    save({"model": stage.state_dict()}, storage_writer=FileSystemWriter(step_dir), no_dist=True)
    job_dir.chmod(0o700)
    key = new_key()
    (job_dir / KEY_FILE).write_bytes(key)
    (job_dir / KEY_FILE).chmod(0o600)
    files = tuple(
        ManifestFile(path=p.name, sha256=sha256_file(p), num_bytes=p.stat().st_size,
                     host="localhost", rank=0)
        for p in sorted(step_dir.iterdir())
    )  # fmt: skip
    manifest = Manifest(step=3, plan=plan, plan_sha256=plan_sha256, world_size=1, files=files)
    (step_dir / "manifest.json").write_text(signed_manifest_text(manifest, key))
    (step_dir / "COMPLETE").write_text("")
    return step_dir


def model_request(
    spec: ModelSpec,
    *,
    seq_len: int,
    micro_batch_size: int = 1,
    start: int = 0,
    end: int | None = None,
    **fields: Any,
) -> ModelRequest:
    """What the runtime asks the built-in families for: layers ``[start, end)`` (default:
    all) of ``spec``, seed 0; ``fields``: the request's others (``tensor_parallel``)."""
    from autohet_cli.runtime.model_api import ModelRequest

    return ModelRequest(
        model_name=spec.name,
        num_layers=spec.num_layers,
        layer_start=start,
        layer_end=spec.num_layers if end is None else end,
        seed=0,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        architecture=spec,
        **fields,
    )


def tiny_model(
    spec: ModelSpec | None = None,
    *,
    seq_len: int = 16,
    micro_batch_size: int = 1,
    start: int = 0,
    end: int | None = None,
) -> StageModule:
    """Layers ``[start, end)`` (default: all) of ``spec`` (default: the zoo's gpt-tiny) as
    one seeded stage, tied parameters tied."""
    from autohet_cli.models import get_model
    from autohet_cli.runtime.model_api import local_layers
    from autohet_cli.runtime.models import build
    from autohet_cli.runtime.stage import StageModule, tie_parameters

    spec = spec or get_model("gpt-tiny")
    request = model_request(
        spec, seq_len=seq_len, micro_batch_size=micro_batch_size, start=start, end=end
    )
    parts = build(request)
    stage = StageModule(local_layers(parts, request))
    tie_parameters(stage, parts.tied)
    return stage


def hf_state(spec: ModelSpec | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under their HuggingFace names (as export writes them)."""
    from autohet_cli.models import get_model
    from autohet_cli.runtime.hf_export import Checkpoint, _assemble, hf_tensors

    spec = spec or get_model("gpt-tiny")
    ours = {n: p.detach() for n, p in tiny_model(spec).named_parameters(remove_duplicate=False)}
    ckpt = Checkpoint(
        step_dir=Path("."),
        shapes={n: tuple(t.shape) for n, t in ours.items()},
        dtypes={n: t.dtype for n, t in ours.items()},
        plan_ref=None,
    )
    return {t.name: _assemble(t, ours, torch.float32) for t in hf_tensors(spec, ckpt)}
