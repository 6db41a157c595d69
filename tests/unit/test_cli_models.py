"""``autohet models list|show`` through typer's runner on a fresh app.

The commands are registered on their own ``typer.Typer()`` so these tests do not
depend on the other subcommand modules; domain errors propagate out of the
command (``main()`` turns them into exit code 1), which the runner records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from autohet_cli.cli.models import register
from autohet_cli.errors import ConfigError, UnknownNameError
from autohet_cli.models import ZOO

GPT2_CONFIG = {
    "model_type": "gpt2",
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "vocab_size": 50257,
}


def _run(*args: str) -> Result:
    app = typer.Typer()
    register(app)
    return CliRunner().invoke(app, ["models", *args])


def test_list_table_names_every_zoo_model() -> None:
    result = _run("list")
    assert result.exit_code == 0, result.output
    for name in ZOO:
        assert name in result.output
    # Issue 46: counts in K/M/B, as models show writes them, not "0.0002205" billion.
    assert "params (B)" not in result.output and "0.000" not in result.output
    assert " 8.03B │" in result.output and " 220.5K │" in result.output


def test_list_json() -> None:
    result = _run("list", "--json")
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.output)}
    assert list(rows) == list(ZOO)
    llama = rows["LLaMA-3-8B"]
    assert (llama["family"], llama["layers"], llama["hidden"], llama["heads"]) == (
        "llama",
        35,
        4096,
        32,
    )
    assert llama["params"] == 8_030_261_248
    assert llama["params_b"] == pytest.approx(8.03, abs=1e-3)


def test_show_json_layers_and_flops() -> None:
    result = _run("show", "OPT-350", "--seq-len", "1024", "--json")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert (shown["name"], shown["seq_len"]) == ("OPT-350M", 1024)
    layers = shown["layer_list"]
    assert len(layers) == 26
    assert [layers[0]["kind"], layers[-1]["kind"]] == ["embedding", "head"]
    block = ZOO["OPT-350M"].layers()[1]
    assert layers[1] == {
        "index": 1,
        "name": "block.0",
        "kind": "block",
        "params": block.num_params,
        "shared_params": 0,
        "fwd_gflops_per_sample": pytest.approx(block.fwd_flops(1024, 1) / 1e9),
    }
    # Layers hold the vocabulary padded to a multiple of 128; the released model has 331.2M.
    padding = ZOO["OPT-350M"].num_padding_params
    assert sum(x["params"] - x["shared_params"] for x in layers) == 331_196_416 + padding


def test_show_table_uses_the_model_default_seq_len() -> None:
    result = _run("show", "llama_3_8b")
    assert result.exit_code == 0, result.output
    assert "LLaMA-3-8B" in result.output
    assert "@ 8192" in result.output
    assert "final_norm" in result.output
    assert "tied copy" not in result.output


def test_show_table_mentions_the_tied_head() -> None:
    result = _run("show", "gpt-tiny")
    assert result.exit_code == 0, result.output
    assert "block.3" in result.output
    assert "tied copy of the embedding (16,384 params" in result.output


def test_show_accepts_a_config_json(tmp_path: Path) -> None:
    path = tmp_path / "gpt2" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(GPT2_CONFIG), encoding="utf-8")
    result = _run("show", str(path), "--json")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert (shown["name"], shown["params"], shown["seq_len"]) == ("gpt2", 124_439_808, 1024)


def test_show_unknown_name_raises_the_domain_error() -> None:
    result = _run("show", "bert-large")
    assert result.exit_code == 1
    assert isinstance(result.exception, UnknownNameError)
    assert "OPT-350M" in str(result.exception)


def test_show_bad_config_raises_the_domain_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GPT2_CONFIG, "model_type": "bert"}), encoding="utf-8")
    result = _run("show", str(path))
    assert isinstance(result.exception, ConfigError)
    assert "model_type 'bert' is not supported" in str(result.exception)


def test_show_rejects_a_non_positive_seq_len() -> None:
    result = _run("show", "gpt-tiny", "--seq-len", "0")
    assert result.exit_code == 2
