"""The family registry: what the built-in runtime trains, and the errors when it cannot."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autohet_cli.hfconfig import load_hf_config
from autohet_cli.models import ZOO, ModelSpec
from autohet_cli.runtime.model_api import ModelRequest
from autohet_cli.runtime.models import build, unsupported_reason
from autohet_cli.runtime.models.common import common_problems
from tests.cli import run
from tests.hf_reference import model_request

ROOT = Path(__file__).resolve().parents[2]
TINY = {m: ROOT / "profiles" / "models" / m / "config.json" for m in ("tiny-llama", "tiny-qwen2")}


def request(spec: ModelSpec, *, tp: int = 1, seq_len: int = 32, end: int = 1) -> ModelRequest:
    return model_request(spec, seq_len=seq_len, end=end, tensor_parallel=tp)


def test_registry_knows_what_it_trains() -> None:
    for name in ("LLaMA-3-8B", "GPT-1.3B", "gpt-tiny"):
        assert unsupported_reason(ZOO[name]) is None
    for name in ("OPT-350M", "GPT-Neo-2.7B"):
        reason = unsupported_reason(ZOO[name])
        assert reason is not None and "--model-fn" in reason and ZOO[name].family in reason


def test_gpt_1_3b_splits_over_tp_2_thanks_to_vocabulary_padding() -> None:
    spec = ZOO["GPT-1.3B"]  # vocabulary 50257: odd
    assert common_problems(spec, request(spec, tp=2, seq_len=2048)) == []


def test_plan_architecture_wins_over_the_zoo() -> None:
    spec = load_hf_config(str(TINY["tiny-qwen2"]))
    parts = build(request(spec, end=spec.num_layers))
    assert parts.tied == (("layers.0.embed_tokens.weight", "layers.4.lm_head.weight"),)
    attn = parts.layers[1].self_attn  # type: ignore[union-attr]
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None


def test_errors_name_what_cannot_be_built() -> None:
    spec = load_hf_config(str(TINY["tiny-llama"]))
    with pytest.raises(ValueError, match="num_kv_heads 2 is not divisible by tensor_parallel 4"):
        build(request(spec, tp=4))
    windowed = replace(spec, sliding_window=16)
    with pytest.raises(ValueError, match="window 16.*seq_len <= 16"):
        build(request(windowed, seq_len=32))
    with pytest.raises(ValueError, match="not 'opt'.*--model-fn"):
        build(request(ZOO["OPT-350M"]))


def test_planning_a_model_the_runtime_cannot_train_says_so(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    argv = [sys.executable, "-m", "autohet_cli", "plan", "--model", "OPT-350M", "--seq-len", "128"]
    argv += ["--global-batch-size", "8", "--time-limit", "2", "--json"]
    res = run(argv, cwd=tmp_path, env=env, timeout=240)
    assert res.returncode == 0, res.stderr
    assert "not 'opt'" in res.stderr and "--model-fn" in res.stderr
    plan_text = (tmp_path / json.loads(res.stdout)["plan_path"]).read_text()
    assert "--model-fn" in plan_text  # in the plan's notes too
