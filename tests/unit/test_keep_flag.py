"""--keep-checkpoints travels like --checkpoint-every: launch and recover to the worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from autohet_cli.cli import app as app_module
from autohet_cli.cli.trainopts import Training, resolve
from autohet_cli.errors import ConfigError
from autohet_cli.launch.session import LaunchRequest, recover_argv, resume_argv, worker_args
from autohet_cli.runtime.train import parse_args


def _resolve(**kw: Any) -> Training:
    args: dict[str, Any] = {
        "config": None,
        "steps": None,
        "checkpoint_every": None,
        "data": None,
        "data_fn": None,
        "train_arg": None,
    }
    return resolve(**(args | kw))


def test_the_worker_keeps_three_by_default_zero_for_all_and_refuses_the_rest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--plan", "p.yaml", "--steps", "1"]
    assert parse_args(base).keep_checkpoints == 3
    assert parse_args([*base, "--keep-checkpoints", "0"]).keep_checkpoints == 0
    with pytest.raises(SystemExit):
        parse_args([*base, "--keep-checkpoints", "-1"])
    err = capsys.readouterr().err
    assert "--keep-checkpoints '-1': expected how many complete steps to keep" in err
    assert "or 0 to keep every step" in err


def test_the_flag_or_the_run_config_reach_the_worker_and_the_recover_command(
    tmp_path: Path,
) -> None:
    assert _resolve().keep_checkpoints == 3
    config = tmp_path / "run.yaml"
    config.write_text("keep_checkpoints: 5\n")
    assert _resolve(config=config).keep_checkpoints == 5
    assert _resolve(config=config, keep_checkpoints=0).keep_checkpoints == 0
    with pytest.raises(ConfigError, match="--keep-checkpoints"):
        _resolve(keep_checkpoints=-2)
    req = LaunchRequest(plan_file=Path("plans/x.v1.yaml"), keep_checkpoints=2)
    argv = worker_args(req)
    assert argv[:3] == ["--steps=100", "--checkpoint-every=auto", "--keep-checkpoints=2"]
    assert parse_args(["--plan", "p", *argv]).keep_checkpoints == 2
    full = recover_argv(req, ["b"], full=True)
    assert full[full.index("--keep-checkpoints") + 1] == "2"
    assert "--keep-checkpoints" not in recover_argv(req, ["b"])
    again = resume_argv(req)
    assert again[again.index("--keep-checkpoints") + 1] == "2"


@pytest.mark.parametrize("command", ["launch", "recover"])
def test_help_teaches_the_flag(command: str) -> None:
    if not app_module.app.registered_commands:
        app_module._register()
    out = CliRunner().invoke(app_module.app, [command, "--help"], env={"COLUMNS": "200"}).output
    assert "--keep-checkpoints" in out
    for words in ("newest K complete checkpoints", "0: keep every step", "[default: 3]"):
        assert words in out, words
