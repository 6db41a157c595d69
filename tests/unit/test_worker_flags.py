"""Worker flags are checked by the launcher with the worker's own parser, before anything
starts (issue 31.2): a typo or a value that makes no sense is one line and exit 1 in
seconds, not argparse's usage on every worker and a root cause guessed from a SIGTERM."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autohet_cli.errors import ConfigError
from autohet_cli.launch.session import LaunchRequest, dry_run
from autohet_cli.runtime.train_args import check_flags, parse_args
from tests.cli import ROOT, autohet

# (worker flags, what the refusal must say): each also refused by the worker itself.
REFUSED = [
    (["--lrr=0.1"], "unrecognized arguments: --lrr=0.1 (did you mean --lr?)"),
    (
        ["--warmup_steps", "5"],
        "unrecognized arguments: --warmup_steps 5 (did you mean --warmup-steps?)",
    ),
    (["--lr=abc"], "argument --lr: invalid float value: 'abc'"),
    (["--lr=0"], "--lr must be > 0 (the peak learning rate), got 0"),
    (["--lr=-3e-4"], "--lr must be > 0 (the peak learning rate), got -0.0003"),
    (["--lr=1e-3", "--min-lr=0.01"], "--min-lr must be between 0 and --lr (0.001), got 0.01"),
    (["--beta2=1.5"], "--beta2 must be in [0, 1), got 1.5"),
    (["--weight-decay=-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--decay-steps=-1"], "--decay-steps must be >= 0, got -1"),
    (
        ["--warmup-steps=50", "--decay-steps=20"],
        "--warmup-steps 50 ends after --decay-steps 20: the schedule would decay before "
        "it reached --lr",
    ),
]


@pytest.mark.parametrize(("flags", "said"), REFUSED)
def test_the_launcher_and_the_worker_refuse_the_same_flags_in_the_same_words(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError) as refused:
        check_flags(["--steps=100", *flags])
    assert said in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(SystemExit) as exited:
        parse_args(["--plan", "p.yaml", "--steps=100", *flags])
    assert exited.value.code == 2
    assert f"python -m autohet_cli.runtime.train: error: {said}" in capsys.readouterr().err


def test_sensible_flags_pass_and_a_long_schedule_may_warm_up_past_this_run() -> None:
    check_flags(["--steps=100", "--lr=3e-4", "--min-lr=0", "--warmup-steps=100"])
    # A run in pieces: the schedule is --decay-steps long, this launch stops at 100.
    check_flags(["--steps=100", "--warmup-steps=200", "--decay-steps=2000"])
    check_flags(["--steps=0", "--warmup-steps=10"])  # nothing trains: nothing to judge
    # a quick try of a run config with fewer steps than its warmup (the demo's has 8)
    check_flags(["--steps=5", "--warmup-steps=8"])


def test_help_among_the_worker_flags_is_refused_without_printing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--train-arg=--help`` would make every worker print its help and exit 0: a
    "finished" run that never trained."""
    with pytest.raises(
        ConfigError, match=r"--help: .*python -m autohet_cli\.runtime\.train --help"
    ):
        check_flags(["--steps=1", "--help"])
    assert capsys.readouterr() == ("", "")


def test_a_run_config_the_launcher_cannot_read_is_left_to_the_hosts(tmp_path: Path) -> None:
    """A ``--config`` inside the worker flags names a file on the hosts; one that is here
    is checked like the flags, one that is not is the preflight's to find."""
    check_flags(["--steps=1", f"--config={tmp_path / 'only-on-the-hosts.yaml'}"])
    here = tmp_path / "run.yaml"
    here.write_text("lr: 0\n")
    with pytest.raises(ConfigError, match=r"--lr must be > 0"):
        check_flags(["--steps=1", f"--config={here}"])


def test_the_workers_parser_imports_no_torch() -> None:
    """The launcher checks flags in well under a second: importing torch takes several."""
    code = "import sys, autohet_cli.runtime.train_args; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "False"


def test_a_dry_run_refuses_them_too_but_never_a_scripts_own_arguments(plan: Path) -> None:
    with pytest.raises(ConfigError, match=r"did you mean --lr\?"):
        dry_run(LaunchRequest(plan_file=plan, train_args=("--lrr=0.1",)))
    script = ("my_train.py", "--lrr=0.1", "--epochs", "abc")
    text = dry_run(LaunchRequest(plan_file=plan, train_args=("--lrr=0.1",), script=script))
    assert "my_train.py --lrr=0.1 --epochs abc" in text


# ------------------------------------------------------------------ the CLI


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A localhost plan, made as the issue's user made it."""
    where = tmp_path_factory.mktemp("plan")
    res = autohet(
        "plan", "--model", "llama-tiny", "--global-batch-size", "8", "--precision", "fp32",
        cwd=where,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return next((where / "plans").glob("*.yaml"))


@pytest.mark.parametrize(
    ("command", "flag", "said"),
    [
        ("launch", "--lrr=0.1", "unrecognized arguments: --lrr=0.1 (did you mean --lr?)"),
        ("launch", "--lr=0", "--lr must be > 0 (the peak learning rate), got 0"),
        ("launch", "--lr=abc", "argument --lr: invalid float value: 'abc'"),
        ("recover", "--lrr=0.1", "unrecognized arguments: --lrr=0.1 (did you mean --lr?)"),
    ],
)
def test_a_bad_worker_flag_is_one_line_and_exit_1_in_seconds_with_nothing_started(
    command: str, flag: str, said: str, plan: Path, tmp_path: Path
) -> None:
    started = time.monotonic()
    res = autohet(command, str(plan), "--steps", "5", f"--train-arg={flag}", cwd=tmp_path)
    took = time.monotonic() - started
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: worker flags: "), res.stderr
    assert said in lines[0] and "`python -m autohet_cli.runtime.train --help`" in lines[0]
    assert res.stdout == "" and not (tmp_path / "runs").exists()
    assert took < 15, took  # ~1 s; a launch that gets as far as the workers takes ~25 s here


def test_a_run_config_value_the_worker_would_refuse_names_the_file(
    plan: Path, tmp_path: Path
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("lr: 0.001\nmin_lr: 0.01\n")
    res = autohet("launch", str(plan), "--config", str(config), cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.fullmatch(
        rf"error: {re.escape(str(config))}: --min-lr must be between 0 and --lr \(0\.001\), "
        r"got 0\.01 \(the worker's flags: `python -m autohet_cli\.runtime\.train --help`\)\n",
        res.stderr,
    ), res.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("flag", "full"),
    [("--init=hf", "--init-from"), ("--data-f=m:f", "--data-fn"), ("--conf=r.yaml", "--config")],
)
def test_abbreviated_flags_are_refused_not_read_past_the_path_checks(flag: str, full: str) -> None:
    """argparse took ``--init=hf`` as --init-from, which the launcher's path resolution
    and preflight (full names) never saw: the worker read it from its workdir."""
    with pytest.raises(ConfigError) as refused:
        check_flags(["--steps=10", flag])
    assert f"unrecognized arguments: {flag}" in str(refused.value)
    with pytest.raises(SystemExit):
        parse_args(["--plan", "p.yaml", "--steps=10", flag])


@pytest.mark.parametrize(
    ("arg", "where"),
    [
        ("--checkpoint-dir=/x", "cluster file"),
        ("--run-dir=/tmp/zz", "--run-id"),
        ("--job=j2", "pass --job to autohet launch"),
        ("--remote-storage=none", "cluster file"),
        ("--plan=other.yaml", "PLAN_FILE"),
    ],
)
def test_the_flags_the_launcher_sets_and_watches_are_refused(arg: str, where: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_flags(["--steps=10", arg])
    said = str(refused.value)
    assert f"{arg.split('=')[0]} is the launcher's" in said and where in said


def test_help_is_refused_once_in_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        check_flags(["--help"])
    assert str(refused.value).count("--help") == 2, str(refused.value)  # the flag, the hint
