"""``autohet data prepare`` as a user runs it: typer's runner on a fresh app, and the
real command in a fresh interpreter for what ``main()`` adds (``error: ...``, exit 1)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer
from tokenizers import Tokenizer
from typer.testing import CliRunner, Result

from autohet_cli.cli import data as data_cli
from autohet_cli.cli.data import register
from autohet_cli.dataset.prepare import PrepareOptions, partial_dir, sample_dir
from tests.cli import ROOT, autohet

CORPUS = sample_dir() / "corpus.txt"


def _run(*args: str, columns: str = "200") -> Result:
    app = typer.Typer()
    register(app)
    return CliRunner().invoke(app, ["data", *args], env={"COLUMNS": columns})


def test_the_sample_corpus_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "x"
    result = _run("prepare", str(CORPUS), "--tokenizer", "sample", "--out", str(out))
    assert result.exit_code == 0, result.output
    tokenizer = Tokenizer.from_file(str(sample_dir() / "tokenizer.json"))
    tokens = np.fromfile(out / "tokens.bin", dtype="<u2").tolist()
    # One document (the whole file) and its end; decoding is the cheap check of the ids
    # (test_data_prepare compares ids with encode() on small inputs).
    assert tokens.count(0) == 1 and tokens[-1] == 0
    assert tokenizer.decode(tokens[:-1]) == CORPUS.read_text(encoding="utf-8")
    summary = result.output.strip()
    assert f"1 document, {len(tokens):,} tokens (uint16, vocab 2,048) from 1 input," in summary
    assert f"{CORPUS.stat().st_size:,} bytes" in summary
    assert "tokens/s" in summary and summary.endswith(f"-> {out}")


def test_json_output_is_one_parseable_object(tmp_path: Path) -> None:
    src = tmp_path / "a.jsonl"
    src.write_text('{"body": "one"}\n{"body": "two"}\n')
    out = tmp_path / "out"
    args = ("prepare", str(src), "--tokenizer", "sample", "--out", str(out), "--text-key", "body")
    result = _run(*args, "--workers", "2", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] is True
    assert (report["out"], report["num_documents"]) == (str(out), 2)
    assert report["meta"] == json.loads((out / "meta.json").read_text())
    assert report["num_tokens"] == report["meta"]["num_tokens"] > 2


def test_blank_line_documents_and_an_eod_token(tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("one\n\ntwo\n")
    out = tmp_path / "out"
    result = _run(
        "prepare", str(src), "--tokenizer", str(sample_dir()), "--out", str(out),
        "--doc-separator", "blank-line", "--eod-token", "!",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["num_documents"], meta["eod_id"]) == (2, 1)
    assert np.fromfile(out / "tokens.bin", dtype="<u2").tolist().count(1) == 2


def test_help_at_80_columns_has_an_example() -> None:
    result = _run("prepare", "--help", columns="80")
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    assert "autohet data prepare autohet_cli/data/sample/corpus.txt --tokenizer sample" in (
        result.output
    )
    for option in ("--tokenizer", "--out", "--text-key", "--doc-separator", "--eod-token"):
        assert option in result.output
    assert "--workers" in result.output and "--json" in result.output


def test_no_inputs_is_a_usage_error() -> None:
    result = _run("prepare", "--tokenizer", "sample", "--out", "x")
    assert result.exit_code == 2
    assert "Missing argument" in result.output


def test_ctrl_c_keeps_the_partial_dir_and_says_how_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(options: PrepareOptions, _report: object) -> None:
        partial_dir(options.out_dir).mkdir()  # as the real one leaves it
        raise KeyboardInterrupt

    monkeypatch.setattr(data_cli, "prepare", interrupted)
    out = tmp_path / "out"
    result = _run("prepare", str(CORPUS), "--tokenizer", "sample", "--out", str(out))
    assert result.exit_code == 130
    assert f"run the same command again to resume from {partial_dir(out)}" in result.output


def test_a_user_error_prints_error_and_exits_1(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    proc = autohet(
        "data", "prepare", str(CORPUS), "--tokenizer", "sample", "--out", "out", cwd=tmp_path
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error: --out out already exists"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert list((tmp_path / "out").iterdir()) == []
    assert ROOT.is_dir()
