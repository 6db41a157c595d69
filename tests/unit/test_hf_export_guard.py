"""``autohet export`` trusts only the plan the checkpoint was written under, and never
writes through what ``--out`` already is.

Red-team findings (issue 29): ``export STEP --plan OTHER.yaml`` (or a same-named plan
of another model under plans/) wrote a config.json with 8 heads for a 4-head
checkpoint; ``--out`` as a dangling symlink ended in a traceback.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from autohet_cli.cli.export import register
from autohet_cli.models import ModelSpec, get_model
from autohet_cli.plan import write_plan
from autohet_cli.runtime.hf_export import ExportError, export_hf, open_checkpoint, spec_for
from autohet_cli.yamlio import sha256_file
from tests import planting
from tests.hf_reference import dcp_checkpoint, tiny_model

SPEC = get_model("gpt-tiny")  # 4 heads
EIGHT_HEADS = dataclasses.replace(SPEC, name="gpt-8h", num_heads=8, num_kv_heads=8)


def plan_of(spec: ModelSpec, directory: Path, name: str = "lab") -> Path:
    stages = [planting.stage(0, spec.num_layers, "localhost")]
    plan = planting.plan_of(stages, model=spec, seq_len=16, name=name)
    return write_plan(plan, directory)[1]


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, Path]:
    """(a step written under plans/lab.v1.yaml of gpt-tiny, that plan's file)."""
    ran = plan_of(SPEC, tmp_path / "ran")
    step = dcp_checkpoint(
        tiny_model(), tmp_path / "ckpt" / "job", plan="lab.v1", plan_sha256=sha256_file(ran)
    )
    return step, ran


def test_the_plan_the_job_ran_with_exports(job: tuple[Path, Path], tmp_path: Path) -> None:
    step, ran = job
    ckpt = open_checkpoint(step)
    assert spec_for(ckpt, ran) == SPEC
    files = export_hf(ckpt, spec_for(ckpt, ran), tmp_path / "hf")
    assert [f.name for f in files] == ["config.json", "model.safetensors"]


def test_another_plan_is_refused_naming_both(job: tuple[Path, Path], tmp_path: Path) -> None:
    step, ran = job
    other = plan_of(EIGHT_HEADS, tmp_path / "other")
    with pytest.raises(ExportError) as info:
        spec_for(open_checkpoint(step), other)
    message = str(info.value)
    assert "written under plan lab.v1 with sha256 " + sha256_file(ran)[:12] in message
    assert f"but {other} has sha256 {sha256_file(other)[:12]}" in message
    assert "pass --plan with the plan file the job ran with" in message


def test_a_same_named_plan_under_plans_is_refused(
    job: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --plan, plans/<its plan>.yaml is looked up by name: here another model's."""
    step, _ = job
    monkeypatch.chdir(tmp_path)
    plan_of(EIGHT_HEADS, tmp_path / "plans")  # plans/lab.v1.yaml, 8 heads
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a group, so the command is named as users do
    result = CliRunner().invoke(app, ["export", str(step), "--out", str(tmp_path / "hf")])
    assert isinstance(result.exception, ExportError), result.output
    assert "plans/lab.v1.yaml has sha256" in str(result.exception)
    assert not (tmp_path / "hf").exists()


def test_out_as_a_symlink_is_refused(job: tuple[Path, Path], tmp_path: Path) -> None:
    step, ran = job
    ckpt = open_checkpoint(step)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ExportError, match="is a symlink .* never writes through one"):
        export_hf(ckpt, SPEC, dangling)
    (tmp_path / "target").mkdir()
    to_dir = tmp_path / "to-dir"
    to_dir.symlink_to(tmp_path / "target")
    with pytest.raises(ExportError, match="is a symlink"):
        export_hf(ckpt, SPEC, to_dir)
    assert not (tmp_path / "nowhere").exists() and not any((tmp_path / "target").iterdir())
    parent = tmp_path / "file"
    parent.write_text("")
    with pytest.raises(ExportError, match="cannot create the output there"):
        export_hf(ckpt, SPEC, parent / "hf")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
