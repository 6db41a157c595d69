"""Run records and the run listing: find, summarise, name a run (runfiles.record, listing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from autohet_cli.cli.runs import register
from autohet_cli.runfiles import describe
from autohet_cli.runfiles.listing import (
    UNFINISHED,
    RunsError,
    checkpoints_text,
    find_runs,
    resolve,
    summarize,
)
from autohet_cli.runfiles.metricsfile import LossSeries
from autohet_cli.runfiles.record import RunRecord, RunRecordError, read_record, write_record


def record(**kw: Any) -> RunRecord:
    base: dict[str, Any] = {
        "run_id": "20261125T140305Z",
        "plan": "lab.v1",
        "plan_file": "/p/plans/lab.v1.yaml",
        "cluster": "lab",
        "cluster_file": "/p/lab.yaml",
        "backend": "ssh",
        "trainer": "built-in",
        "job": "J1",
        "hosts": ("a", "b"),
        "checkpoints": {"a": "/ck/lab/J1/", "b": "/ck/lab/J1/"},
        "remote_checkpoints": "s3://bucket/lab/J1/",
        "started_at": "2026-11-25T14:03:05Z",
    }
    return RunRecord(**(base | kw))


def plant(root: Path, rec: RunRecord, losses: list[float] | None = None) -> Path:
    """A run folder as a launch leaves it: its record, its metrics, a host log."""
    folder = root / rec.plan / rec.run_id
    folder.mkdir(parents=True)
    write_record(folder, rec)
    (folder / "a.log").write_text("stdout: hello\n")
    if losses is not None:
        lines = [json.dumps({"step": i, "loss": v}) for i, v in enumerate(losses)]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def runs_command(tmp_path: Path, *args: str) -> str:
    """``autohet runs ARGS`` in this process over ``tmp_path/runs``; its output."""
    app = typer.Typer()
    register(app)
    res = CliRunner().invoke(app, ["runs", *args, "--runs-dir", str(tmp_path / "runs")])
    assert res.exit_code == 0, res.output
    return res.output


def test_a_record_round_trips_and_is_written_atomically(tmp_path: Path) -> None:
    rec = record(status="failed", detail="workers failed", exit_code=1, last_step=3)
    write_record(tmp_path, rec)
    assert read_record(tmp_path) == rec
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temp file left
    write_record(tmp_path, record(status="finished"))  # replaced at the end of the run
    again = read_record(tmp_path)
    assert again is not None and again.status == "finished"
    assert read_record(tmp_path / "none") is None


def test_a_record_with_an_unknown_field_or_schema_is_refused_naming_the_file(
    tmp_path: Path,
) -> None:
    raw = record().to_dict()
    (tmp_path / "run.json").write_text(json.dumps(raw | {"colour": "red"}))
    with pytest.raises(RunRecordError, match=r"run\.json: unknown field\(s\) colour"):
        read_record(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps(raw | {"schema": "other/v9"}))
    with pytest.raises(RunRecordError, match="schema 'other/v9'"):
        read_record(tmp_path)


def test_a_nan_loss_is_not_written_as_invalid_json(tmp_path: Path) -> None:
    write_record(tmp_path, record(last_loss=float("nan")))
    assert json.loads((tmp_path / "run.json").read_text())["last_loss"] is None


def test_the_metrics_give_the_last_step_and_loss_over_the_record() -> None:
    rec = record(last_step=2, last_loss=9.0)
    series = LossSeries(train=((0, 7.0), (5, 6.5)), eval=((5, 6.8),))
    run = summarize(Path("runs/lab.v1/R"), rec, series)
    assert (run.last_step, run.last_loss, run.last_eval_loss) == (5, 6.5, 6.8)
    alone = summarize(Path("runs/lab.v1/R"), rec, None)
    assert (alone.last_step, alone.last_loss) == (2, 9.0)


def test_a_running_record_whose_launcher_is_gone_is_unfinished() -> None:
    rec = record()
    assert summarize(Path("f"), rec, None, launcher_alive=False).status == UNFINISHED
    assert summarize(Path("f"), rec, None).status == "running"


def test_a_folder_without_a_record_is_summarised_from_its_events() -> None:
    run = summarize(
        Path("runs/old.v2/20250101T000000Z"),
        None,
        None,
        events={"status": "host_lost", "detail": "b: connection lost"},
        modified_at="2025-01-01T00:01:00Z",
    )
    assert (run.run_id, run.plan, run.status) == ("20250101T000000Z", "old.v2", "host_lost")
    assert run.started_at == "2025-01-01T00:01:00Z" and run.detail == "b: connection lost"


def test_checkpoints_name_hosts_sharing_a_path_together_then_the_remote_copy() -> None:
    run = summarize(Path("f"), record(checkpoints={"a": "/x/", "b": "/x/", "c": "/y/"}), None)
    assert checkpoints_text(run) == "a,b:/x/; c:/y/; remote s3://bucket/lab/J1/"
    bare = summarize(Path("f"), record(checkpoints={}, remote_checkpoints=None), None)
    assert checkpoints_text(bare) == "-"


def _three_runs(root: Path) -> None:
    """Two plans launched in the same second share a run id."""
    plant(
        root,
        record(run_id="20261125T100000Z", status="finished", started_at=_at("10:00:00")),
        [7.0, 6.0],
    )
    plant(
        root,
        record(
            run_id="20261125T110000Z", status="failed", detail="boom", started_at=_at("11:00:00")
        ),
    )
    plant(root, record(run_id="20261125T110000Z", plan="other.v3", started_at=_at("11:00:01")))


def _at(clock: str) -> str:
    return f"2026-11-25T{clock}Z"


def test_runs_are_listed_newest_first_with_their_last_step_and_loss(tmp_path: Path) -> None:
    _three_runs(tmp_path)
    (tmp_path / "lab.v1" / "not-a-run").mkdir()  # an empty folder is no run
    found = find_runs(tmp_path)
    assert [r.name for r in found] == [
        "other.v3/20261125T110000Z",
        "lab.v1/20261125T110000Z",
        "lab.v1/20261125T100000Z",
    ]
    oldest = found[-1]
    assert (oldest.status, oldest.last_step, oldest.last_loss) == ("finished", 1, 6.0)
    text = describe.table(found, tmp_path)
    assert "20261125T100000Z  lab.v1" in text and "6.0000" in text
    assert find_runs(tmp_path / "missing") == []


def test_a_run_is_named_by_id_prefix_plan_path_or_latest(tmp_path: Path) -> None:
    _three_runs(tmp_path)
    assert resolve(tmp_path, "20261125T10").run_id == "20261125T100000Z"
    assert resolve(tmp_path, "other.v3/2026").plan == "other.v3"
    assert resolve(tmp_path, "latest").name == "other.v3/20261125T110000Z"
    by_path = resolve(tmp_path, str(tmp_path / "lab.v1" / "20261125T100000Z"))
    assert by_path.last_loss == 6.0


def test_an_ambiguous_or_unknown_run_is_a_clear_error(tmp_path: Path) -> None:
    _three_runs(tmp_path)
    with pytest.raises(RunsError, match=r"'20261125T11' names 2 runs: .*other\.v3/2026"):
        resolve(tmp_path, "20261125T11")
    with pytest.raises(RunsError, match=r"'20261125T110000Z' names 2 runs"):
        resolve(tmp_path, "20261125T110000Z")  # the same id under two plans
    with pytest.raises(RunsError, match=r"no run 'zzz' in .*newest: other\.v3/"):
        resolve(tmp_path, "zzz")
    with pytest.raises(RunsError, match=r"no runs in .*empty.*--runs-dir"):
        resolve(tmp_path / "empty", "latest")


def test_why_a_run_has_no_curve_names_its_log(tmp_path: Path) -> None:
    _three_runs(tmp_path)
    failed = resolve(tmp_path, "lab.v1/20261125T11")
    text = describe.no_metrics_text(failed)
    assert "failed before its first step (boom)" in text
    assert str(failed.folder / "a.log") in text
    script = plant(tmp_path, record(run_id="S", trainer="script", status="finished"))
    assert "user script" in describe.no_metrics_text(resolve(tmp_path, str(script)))


def test_the_summary_says_how_long_and_where(tmp_path: Path) -> None:
    rec = record(status="finished", ended_at="2026-11-25T14:05:10Z", last_step=1)
    folder = plant(tmp_path, rec, [7.0, 6.5])
    (folder / "prediction-check.json").write_text(
        json.dumps({"step": {"predicted_ms": 36.83, "measured_ms": 419.69}})
    )
    lines = describe.summary_lines(resolve(tmp_path, "latest"))
    assert lines[0] == "run 20261125T140305Z of plan lab.v1: finished at step 1, loss 6.5000"
    assert "started 2026-11-25 14:03:05 UTC, ended 14:05:10 UTC (2 min 5 s)" in lines[1]
    assert f"  folder: {folder}/" in lines
    assert any("36.8 ms predicted, 419.7 ms measured (0.09x)" in ln for ln in lines)


def test_a_record_whose_launcher_process_ended_reads_as_unfinished(tmp_path: Path) -> None:
    """The launcher's pid is checked for real: a process that has exited."""
    import socket

    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    pid = int(done.stdout)
    rec = record(launcher_host=socket.gethostname(), launcher_pid=pid)
    plant(tmp_path, rec)
    assert resolve(tmp_path, "latest").status == UNFINISHED
    rec_alive = record(run_id="B", launcher_host=socket.gethostname(), launcher_pid=os.getpid())
    plant(tmp_path, rec_alive)
    assert resolve(tmp_path, "B").status == "running"


def test_a_long_runs_listing_reads_the_tail_and_show_the_whole_curve(tmp_path: Path) -> None:
    """500k steps are ~130 MB of lines: the list reads the file's end for the last
    step and loss; `runs show` (load_run full) reads the whole series to plot it."""
    from autohet_cli.runfiles.listing import load_run
    from autohet_cli.runfiles.metricsfile import TAIL_BYTES, read_series

    losses = [8.0 - i * 1e-5 for i in range(40_000)]  # ~1 MB of lines, past the tail
    folder = plant(tmp_path / "runs", record(status="finished"), losses)
    assert (folder / "metrics.jsonl").stat().st_size > 3 * TAIL_BYTES
    tail = read_series(folder / "metrics.jsonl", tail_bytes=TAIL_BYTES)
    assert tail is not None and tail.last_step == 39_999
    assert tail.train[0][0] > 0 and len(tail.train) < 40_000  # only the end was read
    assert tail.last_loss == pytest.approx(losses[-1])
    listed = load_run(folder)
    assert listed.last_step == 39_999 and listed.last_loss == pytest.approx(losses[-1])
    full = load_run(folder, full=True)
    assert full.series is not None and len(full.series.train) == 40_000
