"""A job is the unit a user follows: its runs link across plan versions, and
``autohet runs show JOB`` plots its whole curve with the breaks marked (issue 46,
item 7)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from autohet_cli.launch import jobs as launch_jobs
from autohet_cli.launch import runfolder
from autohet_cli.runfiles import jobs
from autohet_cli.runfiles.listing import find_runs
from autohet_cli.runfiles.record import RunRecord, write_record
from tests.unit.test_launch_runfolder import _prepared, _specs
from tests.unit.test_runs_listing import record, runs_command

JOB = "20261125T100000Z-ab12"
LOST = "lab.v1/20261125T100000Z"
RECOVERED = "lab.v2/20261125T110000Z"


def _plant(root: Path, rec: RunRecord, steps: range, loss: float) -> Path:
    folder = root / rec.plan / rec.run_id
    folder.mkdir(parents=True)
    write_record(folder, rec)
    lines = [json.dumps({"step": s, "loss": loss - 0.01 * s}) for s in steps]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _job_tree(tmp_path: Path, *, recorded_resume: bool = True) -> Path:
    """A run lost at step 59 under plan v1, recovered from checkpoint step 50 into plan
    v2 (steps 50-79), and another job's run in between."""
    root = tmp_path / "runs"
    lost = record(
        run_id="20261125T100000Z",
        job=JOB,
        status="host_lost",
        detail="b stopped answering",
        started_at="2026-11-25T10:00:00Z",
        ended_at="2026-11-25T10:30:00Z",
    )
    _plant(root, lost, range(60), 7.0)
    other = record(
        run_id="20261125T103000Z",
        job="20261125T103000Z-cd34",
        status="finished",
        started_at="2026-11-25T10:35:00Z",
    )
    _plant(root, other, range(5), 9.0)
    recovered = record(
        run_id="20261125T110000Z",
        plan="lab.v2",
        job=JOB,
        status="finished",
        started_at="2026-11-25T11:00:00Z",
        **({"resumed_from_step": 50} if recorded_resume else {}),
    )
    _plant(root, recovered, range(50, 80), 6.9)
    return root


def test_runs_of_one_job_link_across_plan_versions_when_read(tmp_path: Path) -> None:
    for recorded_resume in (True, False):  # an older record: its metrics say where
        root = _job_tree(tmp_path / str(recorded_resume), recorded_resume=recorded_resume)
        linked = jobs.by_run(find_runs(root))
        lineage = linked[LOST]
        assert [r.name for r in lineage.runs] == [LOST, RECOVERED]
        assert linked[RECOVERED] is lineage and lineage.name == "lab/" + JOB
        lost, recovered = lineage.runs
        assert jobs.continued_by_text(lost, lineage) == (
            f"continued by {RECOVERED} (recovered into plan lab.v2 from checkpoint step 50, "
            "after step 49)"
        )
        assert jobs.continues_text(recovered, lineage) == f"continues {LOST} (host_lost at step 59)"
        assert len(linked["lab.v1/20261125T103000Z"].runs) == 1  # another job


def test_runs_show_job_merges_the_runs_and_marks_the_break(tmp_path: Path) -> None:
    _job_tree(tmp_path)
    out = runs_command(tmp_path, "show", JOB)
    assert "run 20261125T110000Z of plan lab.v2: finished at step 79" in out
    assert f"job {JOB} of plan lab: 2 runs, steps 0-79 logged" in out
    assert f"  {LOST}: host_lost, steps 0-59" in out
    assert f"  {RECOVERED}: finished, steps 50-79" in out
    assert (
        f"break at step 50: {RECOVERED} resumed from checkpoint step 50 (after step 49) "
        f"where {LOST} ended; steps 50-59 logged before were replaced by its values"
    ) in out
    plot = [ln for ln in out.splitlines() if " |" in ln]
    marks = {ln.split("|", 1)[1].find(":") for ln in plot} - {-1}
    assert ", : a run resumed)" in out and len(marks) == 1  # one column: the break
    assert sum(":" in ln for ln in plot) >= len(plot) - 2  # points may cover a row or two
    assert out.splitlines()[-2].strip().endswith("79 step")  # the axis: the whole job
    png = tmp_path / "runs" / "lab.v2" / "20261125T110000Z" / "job-loss.png"
    assert f"plot: {png}" in out and png.read_bytes()[:4] == b"\x89PNG"


def test_runs_show_json_gives_the_merged_series_with_run_ids(tmp_path: Path) -> None:
    _job_tree(tmp_path, recorded_resume=False)  # records of an older autohet link too
    shown = json.loads(runs_command(tmp_path, "show", "latest", "--json"))
    assert shown["name"] == RECOVERED and shown["job"] == JOB
    assert shown["continues"] == LOST and shown["continued_by"] is None
    train = shown["train"]
    assert [p["step"] for p in train] == list(range(80))
    assert {p["run"] for p in train[:50]} == {LOST} and {p["run"] for p in train[50:]} == {
        RECOVERED
    }
    assert train[50]["loss"] == 6.9 - 0.5  # the newest run's value of a redone step
    assert shown["breaks"] == [
        {"step": 50, "ended": LOST, "resumed": RECOVERED, "replaced_steps": [50, 59]}
    ]
    assert [r["name"] for r in shown["job_runs"]] == [LOST, RECOVERED]
    assert shown["job_runs"][0]["continued_by"] == RECOVERED
    only = json.loads(runs_command(tmp_path, "show", "latest", "--run-only", "--json"))
    assert [p["step"] for p in only["train"]][:1] == [50] and "breaks" not in only


def test_the_lost_run_names_the_run_that_continued_it(tmp_path: Path) -> None:
    _job_tree(tmp_path, recorded_resume=False)
    out = runs_command(tmp_path, "show", LOST)
    assert out.startswith("run 20261125T100000Z of plan lab.v1: host_lost at step 59")
    assert (
        f"  continued by {RECOVERED} (recovered into plan lab.v2 from checkpoint step 50"
    ) in out
    listed = runs_command(tmp_path)
    row = next(ln for ln in listed.splitlines() if ln.startswith("20261125T100000Z"))
    assert f"{JOB} (1 of 2)" in row
    as_json = json.loads(runs_command(tmp_path, "--json"))
    lost = next(r for r in as_json if r["name"] == LOST)
    assert (lost["job"], lost["continued_by"]) == (JOB, RECOVERED)


def test_run_json_records_the_checkpoint_step_a_run_resumed_from(tmp_path: Path) -> None:
    p = _prepared(tmp_path, "127.0.0.2")
    recovered = SimpleNamespace(specs=_specs("127.0.0.2", train_args=("--resume=50",)))
    rec = runfolder.start_record(recovered, p, tmp_path)  # type: ignore[arg-type]
    assert (rec.job, rec.resumed_from_step) == ("J", 50)
    newest = SimpleNamespace(specs=_specs("127.0.0.2", train_args=("--resume",)), status=None)
    rec = runfolder.start_record(newest, p, tmp_path)  # type: ignore[arg-type]
    assert rec.resumed_from_step is None  # "the newest": only the workers know which
    (tmp_path / "metrics.jsonl").write_text('{"step": 30, "loss": 5.0}\n')
    ended = runfolder.end_record(rec, None, newest, tmp_path)  # type: ignore[arg-type]
    assert ended.resumed_from_step == 30  # its first logged step says
    fresh = SimpleNamespace(specs=_specs("127.0.0.2"), status=None)
    rec = runfolder.start_record(fresh, p, tmp_path)  # type: ignore[arg-type]
    ended = runfolder.end_record(rec, None, fresh, tmp_path)  # type: ignore[arg-type]
    assert ended.resumed_from_step is None


def test_a_new_job_id_reuses_the_run_ids_second() -> None:
    for run_id in ("20261125T140305Z", "20261125T140305Z-2"):
        job, is_new = launch_jobs.choose_job(
            {},
            resume=False,
            job=None,
            plan_name="lab",
            say=lambda _m: None,
            stamp=launch_jobs.stamp_of(run_id),
        )
        assert is_new and job.startswith("20261125T140305Z-") and len(job) == 21
    assert launch_jobs.stamp_of("my-run") is None


def test_a_job_begun_afresh_shows_its_newest_attempt_and_names_the_earlier(
    tmp_path: Path,
) -> None:
    root = _job_tree(tmp_path)
    again = record(run_id="20261125T120000Z", job=JOB, started_at="2026-11-25T12:00:00Z")
    _plant(root, again, range(10), 8.0)  # `launch --job J` without --resume: step 0 again
    out = runs_command(tmp_path, "show", JOB)
    assert out.startswith("run 20261125T120000Z of plan lab.v1: running at step 9")
    assert "continued by" not in out and "break at" not in out
    assert f"began job {JOB} afresh at step 0 after {RECOVERED}" in out
