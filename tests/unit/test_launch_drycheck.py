"""Issue 46.5: ``autohet launch --dry-run`` refuses what the launch would refuse before
any worker starts (exit 1, the launch's message), and the launch refuses an
``--init-from`` of another model, or data beyond the model's vocabulary, in its
preflight instead of 17 s later from every worker (``launch.session.dry_check``,
``launch.inputcheck``). Hosts: this machine (address localhost)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest

from autohet_cli.hfconfig import to_hf_config
from autohet_cli.launch import session
from autohet_cli.launch.preflight import PreflightError
from autohet_cli.launch.session import LaunchRequest
from autohet_cli.models import get_model
from tests.cli import autohet
from tests.unit.test_cli_launch_paths import localhost_plan

SPEC = get_model("gpt-tiny")  # localhost_plan's model: hidden size 64, vocabulary 256


def _hf_dir(where: Path, **changed: int) -> Path:
    where.mkdir()
    config = to_hf_config(dataclasses.replace(SPEC, **changed))  # type: ignore[arg-type]
    (where / "config.json").write_text(json.dumps(config))
    return where


def _weights(where: Path, **changed: tuple[int, ...]) -> Path:
    """``model.safetensors`` with every tensor the model reads, zeros of its shape
    (``changed``: a tensor of another shape); only headers are read before a launch."""
    import torch
    from safetensors.torch import save_file

    from autohet_cli.runtime.hf_match import expected_tensors

    shapes = {**expected_tensors(SPEC).required, **changed}
    save_file({n: torch.zeros(s) for n, s in shapes.items()}, str(where / "model.safetensors"))
    return where


def _tokens(path: Path, ids: np.ndarray) -> Path:
    ids.astype(np.uint16).tofile(path)
    return path


def test_a_dry_run_refuses_an_init_from_of_another_hidden_size_as_the_launch_does(
    tmp_path: Path,
) -> None:
    plan = localhost_plan(tmp_path)
    _hf_dir(tmp_path / "wide", hidden_size=128)
    env = {"HOME": str(tmp_path)}
    res = autohet("launch", str(plan), "--dry-run", "--init-from", "wide", cwd=tmp_path, env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "--init-from=" in res.stdout  # the commands are printed first
    err = res.stderr.strip()
    assert err.startswith(
        "error: host localhost (localhost): --init-from wide: its config.json does not "
        "describe the plan's model 'gpt-tiny' (hidden_size: plan 64, config 128)"
    ), err
    assert f"plan with --model {tmp_path}/wide/config.json" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    # The launch itself: the same line in its preflight, no worker, no run folder.
    started = time.monotonic()
    res = autohet("launch", str(plan), "--init-from", "wide", "--steps", "2", cwd=tmp_path, env=env)
    assert res.returncode == 1 and "rendezvous:" not in res.stdout, res.stdout + res.stderr
    assert "(hidden_size: plan 64, config 128)" in res.stderr
    assert time.monotonic() - started < 30 and not (tmp_path / "runs").exists()


def test_a_dry_run_refuses_missing_data_with_exit_1(tmp_path: Path) -> None:
    plan = localhost_plan(tmp_path)
    env = {"HOME": str(tmp_path)}
    res = autohet("launch", str(plan), "--dry-run", "--data", "build/nosuch", cwd=tmp_path, env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.strip() == (
        f"error: host localhost (localhost): --data build/nosuch: no such file or directory "
        f"(read as {tmp_path}/build/nosuch: relative paths on this machine are read from "
        "the current directory)"
    )


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A localhost plan, run from ``tmp_path`` with it as the home (in this process)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return localhost_plan(tmp_path)


def _check(plan: Path, *train_args: str, init_from: str | None = None) -> list[str]:
    req = LaunchRequest(plan_file=plan, train_args=train_args, init_from=init_from)
    return session.dry_check(req)


def test_data_the_workers_would_refuse_is_refused_before_they_start(
    here: Path, tmp_path: Path
) -> None:
    beyond = _tokens(tmp_path / "beyond.bin", np.full(1000, SPEC.vocab_size + 3))
    with pytest.raises(PreflightError) as exc:
        _check(here, f"--data={beyond}")
    assert str(exc.value) == (
        f"host localhost (localhost): --data {beyond}: the model's vocabulary is 256 but "
        "beyond.bin holds id 259: prepare the data with the model's tokenizer"
    )
    short = _tokens(tmp_path / "short.bin", np.zeros(10))
    with pytest.raises(PreflightError, match="10 tokens is too few for one sample of seq_len 64"):
        _check(here, f"--data={short}")
    # A model function's vocabulary is its own: the file is only opened.
    mine = tmp_path / "mine.py"
    mine.write_text("def build(request): ...\n")
    _check(here, f"--data={beyond}", f"--model-fn={mine}:build")


def test_usable_inputs_pass_and_every_problem_is_named_at_once(here: Path, tmp_path: Path) -> None:
    same = _weights(_hf_dir(tmp_path / "same"))
    ok = _tokens(tmp_path / "ok.bin", np.arange(1000) % SPEC.vocab_size)
    said = _check(here, f"--data={ok}", init_from=str(same))
    assert said[-1].startswith("dry run: checked 1 host(s): interpreter, torch, autohet, paths")
    deep = _hf_dir(tmp_path / "deep", num_blocks=SPEC.num_blocks + 2)
    bad = _tokens(tmp_path / "bad.bin", np.full(1000, 300))
    with pytest.raises(PreflightError) as exc:
        _check(here, f"--data={bad}", init_from=str(deep))
    message = str(exc.value)
    assert f"num_blocks: plan {SPEC.num_blocks}, config {SPEC.num_blocks + 2}" in message
    assert "holds id 300" in message


def test_a_dry_run_refuses_weights_of_other_names_or_shapes_as_every_worker_would(
    here: Path, tmp_path: Path
) -> None:
    """Issue 46 (build 4): the right config.json beside weights of another shape passed
    the dry run; the workers refused it after torchrun's start-up."""
    from autohet_cli.runtime.hf_match import expected_tensors

    name, shape = next(iter(expected_tensors(SPEC).required.items()))
    narrow = _weights(_hf_dir(tmp_path / "narrow"), **{name: (shape[0], shape[1] - 1)})
    with pytest.raises(PreflightError) as exc:
        _check(here, init_from=str(narrow))
    message = str(exc.value)
    assert message.startswith(f"host localhost (localhost): --init-from {narrow}: {narrow}: ")
    assert f"1 tensor of another shape: {name} [{shape[0]}, {shape[1] - 1}]" in message
    bare = _hf_dir(tmp_path / "bare")  # config.json, no weights
    with pytest.raises(PreflightError, match="no model.safetensors or model.safetensors.index"):
        _check(here, init_from=str(bare))
    # A --model-fn names its own parameters: only config.json is compared.
    mine = tmp_path / "mine.py"
    mine.write_text("def build(request): ...\n")
    _check(here, f"--model-fn={mine}:build", init_from=str(bare))
