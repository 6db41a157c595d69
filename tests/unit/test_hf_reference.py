"""Our built-in families against transformers, the implementation users trust.

For tiny random models of each family (LLaMA, LLaMA-3.1 rope scaling, Mistral,
Qwen2, Phi-3, GPT-2), saved with ``save_pretrained``: the config reads into the
same architecture, ``--init-from``'s loader fills our layers, and our logits equal
transformers' (fp32, max relative difference 1e-5) as does the loss on our data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from autohet_cli.hfconfig import load_hf_config, to_hf_config
from autohet_cli.models import ModelSpec
from autohet_cli.runtime.data import SyntheticCorpus
from autohet_cli.runtime.hf_weights import HFWeightsError, load_hf_weights
from autohet_cli.runtime.stage import StageModule
from tests.hf_reference import (
    FAMILIES,
    SEQ_LEN,
    VOCAB,
    dcp_checkpoint,
    save_random_model,
    tiny_model,
    worst_relative,
)

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TOLERANCE = 1e-5


def our_model(spec: ModelSpec, start: int = 0, end: int | None = None) -> StageModule:
    return tiny_model(spec, seq_len=SEQ_LEN, micro_batch_size=2, start=start, end=end)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """family -> (save_pretrained directory, the transformers model); llama sharded."""
    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(family)
        shard = "40KB" if family == "llama" else "5GB"
        out[family] = (d, save_random_model(family, d, max_shard_size=shard))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_loss_equal_transformers(
    family: str, saved: dict[str, tuple[Path, Any]]
) -> None:
    directory, theirs = saved[family]
    spec = load_hf_config(str(directory / "config.json"))
    assert spec.padded_vocab_size == 256 and spec.vocab_size == VOCAB
    ours = our_model(spec)
    load_hf_weights(ours, spec, directory)
    inputs, targets = SyntheticCorpus(vocab_size=VOCAB, seq_len=SEQ_LEN, seed=0).global_batch(0, 4)
    with torch.no_grad():
        logits = ours(inputs)
        reference = theirs(inputs).logits
    worst = worst_relative(logits[..., :VOCAB], reference)
    print(f"{family}: worst relative logit difference {worst:.2e}")
    assert worst <= TOLERANCE
    loss = build_loss(spec)(logits, targets) / 4
    ref_loss = F.cross_entropy(reference.flatten(0, 1), targets.flatten())
    assert float(loss) == pytest.approx(float(ref_loss), rel=TOLERANCE)
    # the head's chunked loss, as the runtime takes it on the last stage
    fused = ours.fused_loss(build_loss(spec))
    assert fused is not None
    with torch.no_grad():
        chunked = fused(ours(inputs, but_last=True), targets) / 4
    assert float(chunked) == pytest.approx(float(ref_loss), rel=TOLERANCE)


def build_loss(spec: ModelSpec) -> Any:
    from autohet_cli.runtime.models.loss import LmLoss

    return LmLoss(spec.vocab_size)


def test_config_reads_what_each_family_needs(saved: dict[str, tuple[Path, Any]]) -> None:
    specs = {f: load_hf_config(str(saved[f][0] / "config.json")) for f in FAMILIES}
    rope = specs["llama3"].rope_scaling
    assert rope is not None and (rope.kind, rope.factor) == ("llama3", 8.0)
    assert specs["llama3"].rope_theta == 500000.0
    assert specs["qwen2"].qkv_bias and not specs["qwen2"].bias and specs["qwen2"].tied_embeddings
    assert specs["mistral"].sliding_window == 64
    assert specs["phi3"].norm_eps == 1e-5 and specs["gpt2"].activation == "gelu_tanh"
    assert all(s.num_kv_heads == 2 for f, s in specs.items() if f != "gpt2")


@pytest.mark.parametrize("family", FAMILIES)
def test_written_config_reads_back_in_transformers_and_here(
    family: str, saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    from transformers import AutoConfig

    spec = load_hf_config(str(saved[family][0] / "config.json"))
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(spec)))
    again = load_hf_config(str(tmp_path / "config.json"))
    assert again.layers() == spec.layers()
    assert {k: v for k, v in _fields(again).items() if k != "name"} == {
        k: v for k, v in _fields(spec).items() if k != "name"
    }
    theirs = AutoConfig.from_pretrained(tmp_path)
    assert theirs.model_type == saved[family][1].config.model_type


def _fields(spec: ModelSpec) -> dict[str, Any]:
    return {k: getattr(spec, k) for k in spec.__slots__}


def test_a_stage_loads_only_its_layers(saved: dict[str, tuple[Path, Any]]) -> None:
    directory, theirs = saved["qwen2"]  # tied: the head alone loads the embedding
    spec = load_hf_config(str(directory / "config.json"))
    head = our_model(spec, spec.num_layers - 1)
    assert load_hf_weights(head, spec, directory) == 1
    want = theirs.model.embed_tokens.weight
    got = head.layers[str(spec.num_layers - 1)].lm_head.weight
    assert torch.equal(got[:VOCAB], want) and not got[VOCAB:].any()


def test_init_from_refuses_another_architecture(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    spec = load_hf_config(str(saved["llama"][0] / "config.json"))
    with pytest.raises(HFWeightsError, match="num_kv_heads: plan 2, config 4"):
        load_hf_weights(our_model(spec), spec, _with_config(saved["llama"][0], tmp_path, 4))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((saved["llama"][0] / "config.json").read_text())
    with pytest.raises(HFWeightsError, match="no model.safetensors"):
        load_hf_weights(our_model(spec), spec, tmp_path / "empty")


def _with_config(src: Path, tmp_path: Path, kv_heads: int) -> Path:
    raw = json.loads((src / "config.json").read_text())
    raw["num_key_value_heads"] = kv_heads
    d = tmp_path / "other"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return d


# --- export ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_the_same_logits(
    family: str, saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from autohet_cli.runtime.hf_export import export_hf, open_checkpoint

    directory, theirs = saved[family]
    spec = load_hf_config(str(directory / "config.json"))
    ours = our_model(spec)
    load_hf_weights(ours, spec, directory)
    step_dir = dcp_checkpoint(ours, tmp_path / "job")
    shard = 30_000 if family in ("phi3", "gpt2") else 5 * 10**9
    files = export_hf(open_checkpoint(step_dir), spec, tmp_path / "hf", max_shard_bytes=shard)
    assert (len(files) > 2) == (shard < 10**6)  # config + one file, or several + index
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    inputs = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        worst = worst_relative(exported(inputs).logits, theirs(inputs).logits)
    assert worst <= TOLERANCE, worst


def test_export_refuses_unfinished_or_unauthentic_checkpoints(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    from autohet_cli.runtime.hf_export import ExportError, export_hf, open_checkpoint

    (tmp_path / "step-00000001").mkdir()
    with pytest.raises(ExportError, match="no COMPLETE marker"):
        open_checkpoint(tmp_path / "step-00000001")
    spec = load_hf_config(str(saved["llama"][0] / "config.json"))
    step_dir = dcp_checkpoint(our_model(spec), tmp_path / "job")
    with pytest.raises(ExportError, match="already exists"):
        export_hf(open_checkpoint(step_dir), spec, tmp_path)
    manifest = step_dir / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 3', '"step": 3 '))
    (step_dir / "__0_0.distcp").write_bytes(b"planted")
    with pytest.raises(ExportError, match="corrupt"):
        open_checkpoint(step_dir)
    manifest.write_text(manifest.read_text().replace('"t.v1"', '"u.v1"'))
    with pytest.raises(ExportError, match="does not authenticate"):
        open_checkpoint(step_dir)
