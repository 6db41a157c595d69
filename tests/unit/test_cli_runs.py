"""`autohet runs` and `autohet runs show`, run as a user's shell runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cli import ROOT, autohet
from tests.unit.test_runs_listing import plant, record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _runs(tmp: Path) -> None:
    """Two finished runs of one plan, and one that failed before its first step."""
    losses = [7.5 - 0.1 * i for i in range(30)]
    first = record(run_id="20261125T100000Z", status="finished", started_at="2026-11-25T10:00:00Z")
    plant(tmp / "runs", first, losses)
    plant(
        tmp / "runs",
        record(
            run_id="20261125T120000Z",
            status="finished",
            started_at="2026-11-25T12:00:00Z",
            ended_at="2026-11-25T12:01:00Z",
        ),
        [6.0, 5.5, 5.25],
    )
    plant(
        tmp / "runs",
        record(
            run_id="20261125T130000Z",
            plan="other.v1",
            status="failed",
            detail="workers failed (a exit 1); root cause: rank 0 on a: ValueError: bad",
            started_at="2026-11-25T13:00:00Z",
        ),
    )


def test_runs_lists_newest_first_and_json_gives_the_same(tmp_path: Path) -> None:
    _runs(tmp_path)
    out = autohet("runs", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("2026")]
    assert [r.split()[0] for r in rows] == [
        "20261125T130000Z",
        "20261125T120000Z",
        "20261125T100000Z",
    ]
    assert rows[1].split()[2:5] == ["finished", "2", "5.2500"]
    assert "a,b:/ck/lab/J1/; remote s3://bucket/lab/J1/" in rows[1]
    as_json = autohet("runs", "list", "--json", "--runs-dir", str(tmp_path / "runs"), cwd=ROOT)
    listed = json.loads(as_json.stdout)
    assert [(r["name"], r["last_step"]) for r in listed] == [
        ("other.v1/20261125T130000Z", None),
        ("lab.v1/20261125T120000Z", 2),
        ("lab.v1/20261125T100000Z", 29),
    ]


def test_with_no_runs_it_says_where_it_looked(tmp_path: Path) -> None:
    out = autohet("runs", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"no runs in {tmp_path.resolve() / 'runs'}" in out.stdout
    assert "--runs-dir" in out.stdout


def test_runs_show_plots_the_curve_and_writes_a_png(tmp_path: Path) -> None:
    _runs(tmp_path)
    out = autohet("runs", "show", "lab.v1/20261125T10", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "run 20261125T100000Z of plan lab.v1: finished at step 29, loss 4.6000" in text
    plot = [ln for ln in text.splitlines() if " |" in ln]
    assert len(plot) == 14 and plot[0].split("|")[1].startswith("*")
    assert max(len(ln) for ln in plot) <= 72
    png = tmp_path / "runs" / "lab.v1" / "20261125T100000Z" / "loss.png"
    assert f"plot: {png.relative_to(tmp_path)}" in text
    assert png.read_bytes()[:8] == PNG_MAGIC
    series = json.loads(autohet("runs", "show", "latest", "--json", cwd=tmp_path).stdout)
    assert series["ok"] is False and "no metrics" in series["error"]  # latest: the failed one
    again = json.loads(autohet("runs", "show", "20261125T12", "--json", cwd=tmp_path).stdout)
    assert again["train"] == [
        {"step": 0, "loss": 6.0},
        {"step": 1, "loss": 5.5},
        {"step": 2, "loss": 5.25},
    ]
    assert again["eval"] == [] and Path(tmp_path / again["png"]).read_bytes()[:8] == PNG_MAGIC


def test_a_bad_run_name_or_a_run_without_metrics_is_one_clear_error(tmp_path: Path) -> None:
    _runs(tmp_path)
    ambiguous = autohet("runs", "show", "20261125T1", cwd=tmp_path)
    assert ambiguous.returncode == 1
    assert "'20261125T1' names 3 runs" in ambiguous.stderr
    assert "Traceback" not in ambiguous.stderr
    failed = autohet("runs", "show", "other", cwd=tmp_path)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert "failed before its first step (workers failed" in failed.stderr
    assert "runs/other.v1/20261125T130000Z/a.log" in failed.stderr
    assert failed.stdout.startswith("run 20261125T130000Z of plan other.v1: failed")


def test_the_cli_starts_without_matplotlib() -> None:
    """`autohet --help` and `autohet runs` stay fast: matplotlib loads only for a PNG."""
    code = (
        "import sys; from autohet_cli.cli import app; app._register(); "
        "print('matplotlib' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split()[0] == "False", out.stdout


def test_one_odd_folder_is_one_row_with_its_problem_not_a_traceback(tmp_path: Path) -> None:
    _runs(tmp_path)
    dir_metrics = plant(tmp_path / "runs", record(run_id="20261125T140000Z"))
    (dir_metrics / "metrics.jsonl").mkdir()  # not a file
    bad_pid = plant(tmp_path / "runs", record(run_id="20261125T150000Z"))
    raw = json.loads((bad_pid / "run.json").read_text())
    (bad_pid / "run.json").write_text(json.dumps({**raw, "launcher_pid": "1"}))
    out = autohet("runs", "--json", cwd=tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    problems = {r["run_id"]: r.get("problem") or "" for r in json.loads(out.stdout)}
    assert "metrics.jsonl: cannot read" in problems["20261125T140000Z"], problems
    assert "field 'launcher_pid' is '1', expected int" in problems["20261125T150000Z"], problems
    text = autohet("runs", cwd=tmp_path)
    assert text.returncode == 0 and "20261125T100000Z" in text.stdout, text.stderr


def test_a_plot_that_cannot_be_written_still_shows_the_summary_and_curve(tmp_path: Path) -> None:
    _runs(tmp_path)
    (tmp_path / "runs" / "lab.v1" / "20261125T100000Z" / "loss.png").mkdir()  # in the way
    out = autohet("runs", "show", "lab.v1/20261125T10", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "finished at step 29" in out.stdout and " |*" in out.stdout
    assert "plot: not written (" in out.stdout and "cannot write the plot" in out.stdout
    leftovers = list((tmp_path / "runs" / "lab.v1" / "20261125T100000Z").glob(".loss.png*"))
    assert leftovers == []
