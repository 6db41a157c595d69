"""``autohet launch --resume --steps N`` when the job's checkpoint is at step N already:
it says so and starts no worker, instead of running workers that train nothing and
printing ``finished: starting`` (issue 45, item 7c)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from autohet_cli.cli import launch as launch_cli
from autohet_cli.launch import jobs, session, ssh_backend
from autohet_cli.launch.hostlines import Status
from autohet_cli.launch.jobs import JobInfo, NothingToTrain

FOUND = {
    "20261125T100000Z-aaaa": JobInfo(
        name="20261125T100000Z-aaaa", newest_step=40, key_hosts=("a",)
    ),
    "20261125T110000Z-bbbb": JobInfo(
        name="20261125T110000Z-bbbb", newest_step=100, key_hosts=("a",)
    ),
}


@pytest.mark.parametrize("job", [None, "20261125T110000Z-bbbb"])
@pytest.mark.parametrize("steps", [100, 60])
def test_resuming_a_job_at_or_past_its_steps_is_nothing_to_train(
    job: str | None, steps: int
) -> None:
    with pytest.raises(NothingToTrain) as caught:
        jobs.choose_job(FOUND, resume=True, job=job, plan_name="lab", say=print, steps=steps)
    message = str(caught.value)
    assert "20261125T110000Z-bbbb" in message and "already at step 100" in message
    assert f"--steps {steps}" in message and "nothing to train" in message
    assert "a --steps above 100" in message
    assert caught.value.step == 100


def test_a_job_short_of_its_steps_or_a_fresh_one_is_chosen_as_before() -> None:
    said: list[str] = []
    assert jobs.choose_job(
        FOUND, resume=True, job=None, plan_name="lab", say=said.append, steps=101
    ) == ("20261125T110000Z-bbbb", False)
    assert jobs.choose_job(
        FOUND, resume=True, job="20261125T100000Z-aaaa", plan_name="lab", say=said.append, steps=50
    ) == ("20261125T100000Z-aaaa", False)
    job, is_new = jobs.choose_job(
        FOUND, resume=False, job=None, plan_name="lab", say=said.append, steps=10
    )
    assert is_new and job not in FOUND


def test_the_steps_workers_get_are_the_last_steps_flag() -> None:
    req = session.LaunchRequest(plan_file=Path("p.yaml"), steps=100)
    assert jobs.steps_of(session.worker_args(req)) == 100
    req = session.LaunchRequest(plan_file=Path("p.yaml"), steps=100, train_args=("--steps", "7"))
    assert jobs.steps_of(session.worker_args(req)) == 7
    assert jobs.steps_of(["--steps=oops"]) is None and jobs.steps_of([]) is None


def test_no_key_is_sent_and_no_worker_started_when_there_is_nothing_to_train(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[Any] = []
    monkeypatch.setattr(jobs, "list_jobs", lambda *_a: dict(FOUND))
    monkeypatch.setattr(jobs, "distribute_key", lambda *a: sent.append(a))
    monkeypatch.setattr(jobs, "fetch_key", lambda *a: sent.append(a))
    p = SimpleNamespace(plan=SimpleNamespace(name="lab"), remote_storage="s3://b", plan_file="p")
    choice = session.JobChoice(resume=True, steps=100)
    with pytest.raises(NothingToTrain):
        ssh_backend.prepare_job(p, object(), ["a"], choice, print)  # type: ignore[arg-type]
    assert sent == []


def _cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    def nothing(req: session.LaunchRequest, _printer: object) -> None:
        assert req.resume and req.steps == 100
        raise NothingToTrain("job J of plan lab is already at step 100 ...", step=100)

    monkeypatch.setattr(session, "launch", nothing)
    app = typer.Typer()
    launch_cli.register(app)
    app.command("noop")(lambda: None)  # a group: `launch` is a subcommand, as in autohet
    return CliRunner().invoke(app, ["launch", "p.yaml", "--resume", "--steps", "100", *args])


def test_the_command_says_nothing_to_train_and_exits_0(monkeypatch: pytest.MonkeyPatch) -> None:
    res = _cli(monkeypatch)
    assert res.exit_code == 0, res.output
    assert res.output.startswith("nothing to train: job J of plan lab is already at step 100")
    assert "starting" not in res.output
    as_json = json.loads(_cli(monkeypatch, "--json").output)
    assert (as_json["status"], as_json["exit_code"], as_json["last_step"]) == (
        "nothing_to_train",
        0,
        100,
    )


def test_an_outcome_without_a_step_does_not_say_starting() -> None:
    assert Status().line() == "starting"  # while the job runs: right
    assert Status().outcome_line() == "no training step reported"
    done = Status(step=12, loss=5.5, tokens_per_s=1000.0)
    assert done.outcome_line() == done.line()
