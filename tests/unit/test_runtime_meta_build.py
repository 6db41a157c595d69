"""Restarts without random weights: the stage is built on the meta device, allocated
on its device uninitialised, then loaded (``--resume``) or initialised as a fresh run.

The normal build of reference is the model function run on the CPU
(``ModelRequest.on_meta`` False), what every run did before: on the CPU the meta
path must give exactly its numbers (TP: ``tests/dist/test_meta_build.py``).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autohet_cli.ckpt.checkpointer import Checkpointer
from autohet_cli.hfconfig import load_hf_config
from autohet_cli.plan import Plan
from autohet_cli.runtime.model_api import ModelParts, ModelRequest, local_layers
from autohet_cli.runtime.models import build
from autohet_cli.runtime.stage import StageModule, model_request, tie_parameters
from autohet_cli.runtime.trainer import Trainer
from tests.unit.test_purity import PKG, ROOT, _probe
from tests.unit.test_runtime_trainer import CONFIG, PLAN

pytestmark = pytest.mark.usefixtures("alone")

TINY_LLAMA = ROOT / "profiles" / "models" / "tiny-llama" / "config.json"


def cpu_build(request: ModelRequest) -> ModelParts:
    """A model function that knows nothing of the meta device (as user ones may)."""
    return replace(build(replace(request, on_meta=False)), init_layer=None)


def meta_without_init(request: ModelRequest) -> ModelParts:
    return replace(build(request), init_layer=None)


def llama_plan() -> Plan:
    spec = load_hf_config(str(TINY_LLAMA))
    stage = replace(PLAN.pipelines[0].stages[0], layer_start=0, layer_end=spec.num_layers)
    return replace(
        PLAN,
        name="llama",
        model_name=spec.name,
        num_layers=spec.num_layers,
        architecture=spec,
        pipelines=(replace(PLAN.pipelines[0], stages=(stage,)),),
    )


def reference(trainer: Trainer) -> StageModule:
    """The stage the CPU build gives for ``trainer``'s rank."""
    request = model_request(trainer.runtime, trainer.config.seed)
    parts = build(request)
    stage = StageModule(local_layers(parts, request))
    tie_parameters(stage, parts.tied)
    return stage


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def assert_layout(trainer: Trainer) -> None:
    """One Parameter per tied group; GPT-2's key biases frozen, everything else trains."""
    layers = trainer.stage.layers
    assert layers["0"].wte.weight is layers["5"].lm_head.weight
    frozen = [n for n, p in trainer.stage.named_parameters() if not p.requires_grad]
    assert frozen == [f"layers.{i}.attn.k_proj.bias" for i in range(1, 5)]


def test_a_fresh_run_draws_the_weights_of_the_cpu_build() -> None:
    for plan in (PLAN, llama_plan()):
        trainer = Trainer(plan, CONFIG)
        assert_same(state(trainer.stage), state(reference(trainer)))
        trainer.close()
    trainer = Trainer(PLAN, CONFIG)
    assert_layout(trainer)


def test_llama_rope_tables_are_computed_after_the_meta_build() -> None:
    """Non-persistent buffers are in no checkpoint: ``to_empty`` leaves garbage there,
    so the build computes them before any load (here: none yet)."""
    trainer = Trainer(llama_plan(), CONFIG, defer_init=True)
    want = reference(trainer)
    blocks = [i for i, layer in trainer.stage.layers.items() if hasattr(layer, "self_attn")]
    assert blocks == ["1", "2"]
    for i in blocks:
        got, ref = trainer.stage.layers[i].self_attn, want.layers[i].self_attn
        assert got.cos.shape == (trainer.plan.training.seq_len, 16)  # head_dim 64 / 4
        assert torch.equal(got.cos, ref.cos) and torch.equal(got.sin, ref.sin)


def _checkpointer(trainer: Trainer, root: Path) -> Checkpointer:
    return Checkpointer(trainer, root=root, plan_ref="one.v1", plan_sha256="a" * 64, job="j")


def test_resume_that_finds_no_checkpoint_starts_with_the_fresh_weights(tmp_path: Path) -> None:
    fresh = Trainer(PLAN, CONFIG)
    fresh.fit(2)
    want = state(fresh.stage)
    fresh.close()
    resumed = Trainer(PLAN, CONFIG, defer_init=True)
    assert _checkpointer(resumed, tmp_path).resume() is None
    resumed.fit(2)
    assert_same(state(resumed.stage), want)
    assert_layout(resumed)


def test_a_deferred_build_loads_a_checkpoint_exactly(tmp_path: Path) -> None:
    """Nothing drawn, everything loaded: parameters, optimizer state, the step; the
    tied group stays one Parameter and frozen parameters stay frozen."""
    saver = Trainer(PLAN, CONFIG)
    saver.fit(2)
    ckpt = _checkpointer(saver, tmp_path)
    ckpt.save()
    ckpt.close()
    want = state(saver.stage)
    want_optim = copy.deepcopy(saver.state_dict()["optimizer"]["state"])
    saver.fit(1)
    after = state(saver.stage)
    saver.close()

    resumed = Trainer(PLAN, CONFIG, defer_init=True)
    assert _checkpointer(resumed, tmp_path).resume() == 2
    assert_same(state(resumed.stage), want)
    got_optim = resumed.state_dict()["optimizer"]["state"]
    assert got_optim.keys() == want_optim.keys()
    for name, entry in want_optim.items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(got_optim[name][key]), torch.as_tensor(value))
    assert_layout(resumed)
    resumed.fit(1)
    assert_same(state(resumed.stage), after)


def test_a_model_fn_without_meta_support_still_works_and_says_so_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh = Trainer(PLAN, CONFIG)
    want = state(fresh.stage)
    fresh.close()
    capsys.readouterr()
    trainer = Trainer(PLAN, CONFIG, model_fn=cpu_build, defer_init=True)
    assert capsys.readouterr().err.count("builds its layers on the CPU") == 1
    assert _checkpointer(trainer, tmp_path).resume() is None
    assert_same(state(trainer.stage), want)  # its own initialisation, kept
    assert_layout(trainer)
    trainer.fit(1)
    trainer.close()
    quiet = Trainer(PLAN, CONFIG, model_fn=cpu_build)  # nothing replaces its weights
    assert "on the CPU" not in capsys.readouterr().err
    assert_same(state(quiet.stage), want)
    quiet.close()
    with pytest.raises(ValueError, match="meta device but returned no init_layer"):
        Trainer(PLAN, CONFIG, model_fn=meta_without_init)


def test_the_worker_imports_none_of_the_cli_only_packages() -> None:
    """What the worker never uses stays out of its start-up (``runtime.train``)."""
    heavy = [
        *("transformers", "tokenizers", "safetensors", "tensorboard", "pyscipopt"),
        # Not fsspec: torch's own DCP imports it where installed (2.8, not 2.13).
        *("networkx", "typer", "rich", "paramiko", "pandas", "scipy"),
        *("autohet_cli.cli", "autohet_cli.planner", "autohet_cli.costmodel"),
        *("autohet_cli.launch", "autohet_cli.recovery", "autohet_cli.profiling"),
        "autohet_cli.runtime.hf_weights",
    ]
    loaded = _probe("autohet_cli.runtime.train", PKG, heavy, ROOT)
    assert loaded == {}, f"the worker loads {loaded}"
