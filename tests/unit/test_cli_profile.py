"""``autohet profile import`` and ``autohet profile show`` through typer's test runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from autohet_cli.cli import profile as profile_cli
from autohet_cli.errors import ConfigError, ProfileError
from autohet_cli.profiling.schema import load_profile


def _run(*args: str | Path) -> Result:
    app = typer.Typer()
    profile_cli.register(app)
    return CliRunner().invoke(app, [str(a) for a in args])


def _import(root: Path, model: str, out: Path, *extra: str | Path) -> Result:
    return _run(
        "profile", "import", "--format", "sailor", root, "--model", model, "--out", out, *extra
    )


@pytest.fixture(scope="module")
def llama_file(sailor_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "llama.yaml"
    result = _import(sailor_root, "LLAMA-3-8", out)
    assert result.exit_code == 0, result.output
    return out


def test_group_without_arguments_teaches(sailor_root: Path) -> None:
    result = _run("profile")
    assert "import" in result.output and "show" in result.output
    assert "autohet.profile/v1" in result.output


def test_import_writes_the_profile_and_summarises(sailor_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "llama.yaml"
    result = _import(sailor_root, "LLAMA-3-8", out)
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    assert profile.models() == ["LLaMA-3-8B"]
    assert set(profile.devices) == {"A100-40", "GH-96", "V100-16"}
    text = result.output
    assert "imported LLaMA-3-8B" in text and "11 entries of 35 layers" in text
    assert "V100-16" in text and "GH-96" in text and "1 2 4" in text
    assert "note: tp 8" in text
    assert f"wrote {out}" in text


@pytest.mark.parametrize("columns", ["40", "80"])
def test_import_prints_long_paths_whole_at_any_width(
    sailor_root: Path, tmp_path: Path, columns: str
) -> None:
    """A checkout or output path longer than the terminal is printed on one line,
    so the output does not depend on where the repository lives or on COLUMNS."""
    deep = tmp_path.joinpath(*(["a-rather-long-directory-name"] * 6))
    deep.mkdir(parents=True)
    out = deep / "llama-imported-with-a-long-file-name.yaml"
    app = typer.Typer()
    profile_cli.register(app)
    args = ["profile", "import", "--format", "sailor", str(sailor_root)]
    result = CliRunner().invoke(
        app, [*args, "--model", "LLAMA-3-8", "--out", str(out)], env={"COLUMNS": columns}
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"wrote {out}: 11 entries" in lines
    assert f"imported LLaMA-3-8B from {sailor_root}: 11 entries of 35 layers" in lines
    shown = CliRunner().invoke(app, ["profile", "show", str(out)], env={"COLUMNS": columns})
    assert f"{out}: 11 entries (sums over layers)" in shown.output.splitlines()


def test_import_refuses_an_existing_out_unless_forced(llama_file: Path, sailor_root: Path) -> None:
    before = llama_file.read_text()
    result = _import(sailor_root, "LLAMA-3-8", llama_file)
    assert result.exit_code == 1
    assert isinstance(result.exception, ConfigError)
    assert "already exists" in str(result.exception) and "--force" in str(result.exception)
    assert llama_file.read_text() == before
    forced = _import(sailor_root, "LLAMA-3-8", llama_file, "--force")
    assert forced.exit_code == 0, forced.output
    assert load_profile(llama_file).models() == ["LLaMA-3-8B"]


def test_import_merges_into_an_existing_profile(
    llama_file: Path, sailor_root: Path, tmp_path: Path
) -> None:
    out = tmp_path / "both.yaml"
    result = _import(
        sailor_root, "GPT-Neo-2.7B", out, "--skip-gpu", "GH-96", "--merge-into", llama_file
    )
    assert result.exit_code == 0, result.output
    merged = load_profile(out)
    assert merged.models() == ["GPT-Neo-2.7B", "LLaMA-3-8B"]
    assert "GH-96" in merged.devices  # from the LLaMA file
    assert [h["model"] for h in merged.meta["history"]] == ["LLaMA-3-8B", "GPT-Neo-2.7B"]


def test_import_rejects_other_formats(sailor_root: Path, tmp_path: Path) -> None:
    result = _run(
        "profile",
        "import",
        "--format",
        "csv",
        sailor_root,
        "--model",
        "OPT-350",
        "--out",
        tmp_path / "x.yaml",
    )
    assert result.exit_code == 2
    assert "sailor" in result.output
    assert not (tmp_path / "x.yaml").exists()


def test_import_of_a_missing_directory(tmp_path: Path) -> None:
    result = _import(tmp_path / "nowhere", "OPT-350", tmp_path / "x.yaml")
    assert result.exit_code == 1
    assert isinstance(result.exception, ConfigError)
    assert str(tmp_path / "nowhere" / "profiles") in str(result.exception)
    assert not (tmp_path / "x.yaml").exists()


def test_import_of_a_mislabelled_file_says_how_to_skip_it(
    sailor_root: Path, tmp_path: Path
) -> None:
    result = _import(sailor_root, "GPT-Neo-2.7", tmp_path / "x.yaml")
    assert isinstance(result.exception, ConfigError)
    assert "--skip-gpu GH-96" in str(result.exception)
    assert not (tmp_path / "x.yaml").exists()


def test_show_prints_totals_per_entry(llama_file: Path) -> None:
    result = _run("profile", "show", llama_file)
    assert result.exit_code == 0, result.output
    assert "11 entries" in result.output
    assert result.output.count("sailor") == 11
    assert "fwd ms" in result.output and "bwd ms" in result.output and "params" in result.output


def test_show_layers_of_one_entry(llama_file: Path) -> None:
    result = _run(
        "profile", "show", llama_file, "--gpu", "v100", "--tp", "8", "--mbs", "1", "--layers"
    )
    assert result.exit_code == 0, result.output
    assert "LLaMA-3-8B on V100-16, tp 8, mbs 1" in result.output
    assert "update ms" in result.output and "act MB" in result.output
    assert "│    34 │" in result.output  # the last of 35 layers


def test_show_json(llama_file: Path, sailor_root: Path) -> None:
    result = _run("profile", "show", llama_file, "--json", "--layers", "--gpu", "GH-96")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["meta"]["source"] == "sailor"
    rows = data["entries"]
    assert {r["gpu_type"] for r in rows} == {"GH-96"} and len(rows) == 6
    source = json.loads(
        (sailor_root / "profiles" / "LLAMA-3-8" / "GH-96" / "profile.json").read_text()
    )
    row = next(r for r in rows if (r["tensor_parallel"], r["micro_batch_size"]) == (2, 1))
    want = sum(v[0] for v in source["1"]["2"].values()) * 1000
    assert row["fwd_ms"] == pytest.approx(want, rel=1e-12)
    assert len(row["layers"]) == 35 and row["layers"][0]["num_params"] > 0


def test_show_with_no_match_says_what_is_there(llama_file: Path) -> None:
    result = _run("profile", "show", llama_file, "--gpu", "T4")
    assert isinstance(result.exception, ProfileError)
    assert "LLaMA-3-8B" in str(result.exception) and "V100-16" in str(result.exception)


def test_show_of_a_missing_file(tmp_path: Path) -> None:
    result = _run("profile", "show", tmp_path / "none.yaml")
    assert isinstance(result.exception, ConfigError)
    assert "file not found" in str(result.exception)
