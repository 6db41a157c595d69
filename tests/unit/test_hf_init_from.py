"""``--init-from`` says what it loaded and refuses a checkpoint that is not the model.

Issue 31.4: weights loaded silently, with no line naming the files, the number of
tensors, their dtype or what was missing or unused; a tensor the model had no
place for was dropped without a word. Checkpoints here are tiny transformers
models saved with ``save_pretrained`` (LLaMA sharded in bfloat16, GPT-2 in one
float32 file: fused and transposed tensors) and edited with safetensors.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from autohet_cli.hfconfig import load_hf_config
from autohet_cli.plan import Device
from autohet_cli.runtime.hf_files import HFWeightsError
from autohet_cli.runtime.hf_init import Outcome, init_from, lines
from autohet_cli.runtime.hf_weights import load_stage
from autohet_cli.runtime.topology import RankInfo
from tests.hf_reference import hf_config, random_model
from tests.unit.test_hf_reference import our_model

pytest.importorskip("transformers")

FAMILIES = ("llama", "gpt2")
STAGE_1_TENSOR = {"llama": "model.norm.weight", "gpt2": "transformer.ln_f.weight"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> save_pretrained directory: LLaMA in bfloat16 over several files."""
    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(family)
        model = random_model(family)
        if family == "llama":
            model.to(torch.bfloat16).save_pretrained(d, max_shard_size="40KB")
        else:
            model.save_pretrained(d)
        out[family] = d
    return out


def headers(directory: Path) -> dict[str, tuple[str, int]]:
    """tensor -> (file, bytes), read with safetensors itself."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = fh.get_tensor(name)
                out[name] = (f.name, t.numel() * t.element_size())
    return out


def info(spec: Any, start: int = 0, end: int | None = None) -> RankInfo:
    end = spec.num_layers if end is None else end
    return RankInfo(
        rank=0, pipeline=0, stage=0, tp_rank=0, num_stages=1, tp_size=1, layer_start=start,
        layer_end=end, num_microbatches=1, device=Device(host="localhost", gpu=0),
    )  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_the_load_lines_name_the_files_tensors_bytes_and_dtypes(
    family: str, saved: dict[str, Path]
) -> None:
    directory = saved[family]
    spec = load_hf_config(str(directory / "config.json"))
    said: list[str] = []
    init_from(our_model(spec), spec, directory, info=info(spec), global_rank=0, say=said.append)
    assert len(said) == 2, said
    checkpoint, stages = said
    tensors = headers(directory)
    files = sorted({f for f, _ in tensors.values()})
    total = sum(n for _, n in tensors.values())
    stored = "bfloat16" if family == "llama" else "float32"
    assert checkpoint.startswith(f"--init-from {directory}: {len(tensors)} tensors, ")
    assert f" of {stored} in {len(files)} file" in checkpoint
    assert ("(via model.safetensors.index.json)" in checkpoint) == (len(files) > 1)
    assert files[0] in checkpoint and "none missing, none unused" in checkpoint
    size = re.search(r"tensors, ([\d.]+) KB of", checkpoint)
    assert size and float(size.group(1)) == pytest.approx(total / 1e3, abs=0.01)
    assert f"loaded {stored} as float32" in stages
    assert f"layers 0-{spec.num_layers - 1}: {len(tensors)} tensors" in stages


def test_each_stage_says_what_it_read(saved: dict[str, Path]) -> None:
    directory = saved["llama"]
    spec = load_hf_config(str(directory / "config.json"))
    n = spec.num_layers
    outcomes = [
        Outcome(rank=r, host="a", layers=(a, b), pipeline=0, problem=None,
                load=load_stage(our_model(spec, a, b), spec, directory))
        for r, (a, b) in enumerate([(0, 2), (2, n)])
    ]  # fmt: skip
    stage_line = lines(outcomes)[1]
    first, second = (o.load for o in outcomes)
    assert first is not None and second is not None
    # embedding + block 0 (9 tensors); block 1 (9), the final norm and the head
    assert (first.num_tensors, second.num_tensors) == (10, 11)
    assert first.num_bytes + second.num_bytes == sum(n for _, n in headers(directory).values())
    assert f"layers 0-1: 10 tensors ({first.num_bytes / 1e3:.2f} KB)" in stage_line
    assert f"layers 2-{n - 1}: 11 tensors" in stage_line
    # TP shards of one stage add up; another pipeline's copy of the same layers does not.
    shards = [
        Outcome(rank=r, host="a", layers=(0, 2), pipeline=p, load=first, problem=None)
        for r, p in enumerate([0, 0, 1])
    ]
    assert lines(shards)[1].endswith(
        f"layers 0-1: 10 tensors ({2 * first.num_bytes / 1e3:.2f} KB over 2 TP ranks)"
    )


def copy_with(src: Path, dest: Path, edit: Any, *, config: Path | None = None) -> Path:
    """``src``'s weights as one file, edited by ``edit(state)``; its config.json (or ``config``)."""
    state: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        state.update(load_file(str(f)))
    edit(state)
    dest.mkdir(parents=True)
    shutil.copy(config or src / "config.json", dest / "config.json")
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def refusal(directory: Path, stage: tuple[int, int] | None = None) -> str:
    """The error of loading ``stage`` (the first layer alone by default): every stage
    checks the whole model, so it need not hold the tensor that is wrong."""
    spec = load_hf_config(str(directory / "config.json"))
    a, b = stage or (0, 1)
    with pytest.raises(HFWeightsError) as caught:
        init_from(our_model(spec, a, b), spec, directory, info=info(spec, a, b), global_rank=0,
                  say=lambda _: None)  # fmt: skip
    message = str(caught.value)
    assert len(message) <= 500 or "more" in message[:500], message  # the root cause's cut
    return message


@pytest.mark.parametrize("family", FAMILIES)
def test_an_unused_tensor_is_refused_by_name(
    family: str, saved: dict[str, Path], tmp_path: Path
) -> None:
    def extra(state: dict[str, torch.Tensor]) -> None:
        state["model.layers.7.mlp.extra.weight"] = torch.ones(4, 4)
        state["vision_tower.patch_embed.weight"] = torch.ones(2)

    message = refusal(copy_with(saved[family], tmp_path / "d", extra))
    assert "2 tensors the model has no place for: model.layers.7.mlp.extra.weight, " in message
    assert "vision_tower.patch_embed.weight" in message and "another model's weights" in message


@pytest.mark.parametrize("family", FAMILIES)
def test_a_missing_tensor_of_another_stage_is_refused_by_name(
    family: str, saved: dict[str, Path], tmp_path: Path
) -> None:
    name = STAGE_1_TENSOR[family]
    directory = copy_with(saved[family], tmp_path / "d", lambda s: s.pop(name))
    message = refusal(directory)
    assert f"1 tensor missing: {name};" in message
    assert "config.json describes (2 blocks, hidden size 64)" in message


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_of_another_size_are_refused_with_both_shapes(
    family: str, saved: dict[str, Path], tmp_path: Path
) -> None:
    """A model of hidden size 128 beside the hidden-64 config.json its plan was made from."""
    config = hf_config(family)
    config.update({"n_embd": 128} if family == "gpt2" else {"hidden_size": 128})
    bigger = tmp_path / "bigger"
    import transformers as tf

    tf.AutoModelForCausalLM.from_config(config).save_pretrained(bigger)
    message = refusal(copy_with(bigger, tmp_path / "d", lambda s: None,
                                config=saved[family] / "config.json"))  # fmt: skip
    first = {  # GPT-2's Conv1D stores (in, out): c_attn holds q, k and v side by side
        "llama": "21 tensors of another shape: lm_head.weight [250, 128], model [250, 64], ",
        "gpt2": "28 tensors of another shape: transformer.h.0.attn.c_attn.bias [384], model [192]",
    }[family]
    assert first in message, message
    if family == "gpt2":
        assert "transformer.h.0.attn.c_attn.weight [128, 384], model [64, 192]" in message
    assert "is config.json another model's (or another size's)?" in message


def test_known_buffers_and_a_tied_heads_copy_are_not_refused(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    def buffers(state: dict[str, torch.Tensor]) -> None:
        state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    said: list[str] = []
    directory = copy_with(saved["llama"], tmp_path / "llama", buffers)
    spec = load_hf_config(str(directory / "config.json"))
    init_from(our_model(spec), spec, directory, info=info(spec), global_rank=0, say=said.append)
    assert "ignored: model.layers.0.self_attn.rotary_emb.inv_freq" in said[0]
    raw = json.loads((saved["llama"] / "config.json").read_text())
    tied = tmp_path / "tied.json"
    tied.write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    directory = copy_with(saved["llama"], tmp_path / "tied", lambda s: None, config=tied)
    spec = load_hf_config(str(directory / "config.json"))
    init_from(our_model(spec), spec, directory, info=info(spec), global_rank=0, say=said.append)
    assert "ignored: lm_head.weight" in said[-2]


def test_an_untied_head_missing_hints_at_tie_word_embeddings(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    directory = copy_with(saved["llama"], tmp_path / "d", lambda s: s.pop("lm_head.weight"))
    message = refusal(directory)
    assert "1 tensor missing: lm_head.weight" in message
    assert '"tie_word_embeddings": true' in message


def test_a_rank_that_failed_is_named_when_the_others_did_not() -> None:
    """What every rank raises after the gather: the first failure, with its rank."""
    from autohet_cli.runtime import hf_init

    ok = Outcome(rank=0, host="a", layers=(0, 2), pipeline=0, load=None, problem=None)
    bad = Outcome(rank=1, host="b", layers=(2, 4), pipeline=0, load=None, problem="x: NaN")
    assert hf_init.first_failure([ok, bad]) == "rank 1 on b: x: NaN"
    assert hf_init.first_failure([bad, bad]) == "x: NaN"
    assert hf_init.first_failure([ok]) is None


def test_a_base_model_save_like_the_hubs_gpt2_loads_the_same_weights(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """The hub's original ``gpt2`` was saved from ``GPT2Model``: no ``transformer.``
    prefix and no head. transformers loads it into GPT2LMHeadModel; so do we."""
    import transformers as tf

    directory = saved["gpt2"]
    base = tmp_path / "gpt2-base"
    tf.AutoModelForCausalLM.from_pretrained(directory).transformer.save_pretrained(base)
    assert not any(n.startswith(("transformer.", "lm_head.")) for n in headers(base))
    spec = load_hf_config(str(base / "config.json"))
    said: list[str] = []
    ours = our_model(spec)
    init_from(ours, spec, base, info=info(spec), global_rank=0, say=said.append)
    reference = our_model(spec)
    init_from(reference, spec, directory, info=info(spec), global_rank=0, say=lambda _: None)
    got, want = ours.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert "saved from the base model: names read with 'transformer.' before them" in said[0]
    assert "none missing, none unused" in said[0]


def test_a_long_refusal_keeps_its_likely_cause_in_the_record() -> None:
    from autohet_cli.workerbase.records import MAX_MESSAGE_CHARS, clip

    said = "/a/long/snapshot/path/" * 30 + ": 9 tensors missing: x; another model's weights?"
    kept = clip(said)
    assert len(kept) <= MAX_MESSAGE_CHARS and kept.startswith("/a/long/snapshot/path/")
    assert kept.endswith("another model's weights?") and " ... " in kept
    assert clip("short") == "short"


def test_a_deliberate_rope_change_loads_and_says_so_and_heads_do_not(
    saved: dict[str, Path],
) -> None:
    """Issue 45: another rope (a longer context) from the same weights goes through
    --init-from, said out loud; other heads of the same shapes are another model."""
    directory = saved["llama"]
    theirs = load_hf_config(str(directory / "config.json"))
    spec = dataclasses.replace(theirs, rope_theta=theirs.rope_theta * 50)
    said: list[str] = []
    init_from(our_model(spec), spec, directory, info=info(spec), global_rank=0, say=said.append)
    assert len(said) == 3, said
    assert said[2] == (
        f"note: --init-from: the plan's model changes the weights' (rope_theta: plan "
        f"{spec.rope_theta!r}, config {theirs.rope_theta!r}): a deliberate change of model, "
        "weights only; it trains from step 0"
    )
    heads = dataclasses.replace(theirs, num_heads=theirs.num_heads * 2)
    with pytest.raises(HFWeightsError, match=r"does not describe the plan's model.*num_heads"):
        load_stage(our_model(theirs), heads, directory)
