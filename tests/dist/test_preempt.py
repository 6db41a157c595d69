"""Preemption notices in the worker: SIGTERM or the host's check -> save the finished
step on every rank, exit 0, resume there with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from realdata import data_flags
from test_runtime_exact import ROOT, _env, _free_port, make_plan

from autohet_cli.plan import write_plan
from autohet_cli.preemption import CHECK_ENV, CheckSpec
from autohet_cli.workerbase.records import PREEMPT_PREFIX
from tests.cli import run

pytestmark = pytest.mark.dist

TIMEOUT_S = 180
MANY = 400  # steps the interrupted run asks for: the notice comes long before


def _args(plan_path: Path, steps: int, *extra: str) -> list[str]:
    return [
        *("-m", "autohet_cli.runtime.train", "--plan", str(plan_path), "--steps", str(steps)),
        *("--seed", "7", "--lr", "0.001", "--device", "cpu"),
        *data_flags(),
        # After data_flags' cosine: a run that asks for MANY steps and one that asks
        # for a few then follow the same learning rates (warmup, clipping as there).
        *("--lr-schedule", "constant"),
        *extra,
    ]


def _losses(metrics: Path) -> dict[int, float]:
    lines = map(json.loads, metrics.read_text().splitlines())
    return {m["step"]: m["loss"] for m in lines if "loss" in m}  # not the save records


def _start_two(
    tmp: Path, env_extra: dict[str, str], *, sharded: bool = False
) -> list[subprocess.Popen[str]]:
    """Two workers of a two-stage pipeline, as torchrun would start them (one host);
    ``sharded``: of two one-stage pipelines whose weights are sharded over them (FSDP,
    issue 48), the same 4 micro-batches in all."""
    if sharded:
        plan = make_plan("pre", [(2, [(0, 6)]), (2, [(0, 6)])], optimizer="adam")
        plan = replace(
            plan,
            pipelines=tuple(
                replace(p, stages=tuple(replace(s, shard="weights") for s in p.stages))
                for p in plan.pipelines
            ),
        )
    else:
        plan = make_plan("pre", [(4, [(0, 3), (3, 6)])], optimizer="adam")
    _, path = write_plan(plan, tmp)
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = (
            _env()
            | env_extra
            | {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "AUTOHET_HOST": "localhost",
            }
        )
        args = _args(
            path,
            MANY,
            *("--metrics", str(tmp / "metrics.jsonl"), "--checkpoint-every", "1000"),
            *("--checkpoint-dir", str(tmp / "disk"), "--remote-storage", "none"),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def _wait_for_step(metrics: Path, step: int, procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if metrics.is_file() and step in _losses_partial(metrics):
            return
        assert all(p.poll() is None for p in procs), "a worker ended early"
        time.sleep(0.1)
    raise AssertionError(f"step {step} never came")


def _losses_partial(metrics: Path) -> set[int]:
    steps = set()
    for line in metrics.read_text().splitlines():
        try:
            steps.add(json.loads(line)["step"])
        except ValueError:
            pass
    return steps


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[str, str]]:
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            assert p.returncode == 0, f"worker exit {p.returncode}:\n{err[-4000:]}"
            outs.append((out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def _events(stdout: str) -> list[dict[str, object]]:
    return [
        json.loads(line[len(PREEMPT_PREFIX) :])
        for line in stdout.splitlines()
        if line.startswith(PREEMPT_PREFIX)
    ]


_REFERENCE: dict[int, float] = {}  # the uninterrupted run's losses, shared by the tests


def _reference(tmp: Path, end: int) -> dict[int, float]:
    """One uninterrupted single-process run to step ``end`` (at least 12), run once
    for the module unless a test needs more steps."""
    if _REFERENCE and max(_REFERENCE) >= end - 1:
        return _REFERENCE
    _, ref_path = write_plan(make_plan("ref", [(4, [(0, 6)])], optimizer="adam"), tmp / "ref")
    argv = [sys.executable, *_args(ref_path, max(end, 12), "--metrics", str(tmp / "ref.jsonl"))]
    ref = run([*argv, "--checkpoint-every", "0"], cwd=ROOT, env=_env(), timeout=TIMEOUT_S)
    assert ref.returncode == 0, ref.stderr[-4000:]
    _REFERENCE.update(_losses(tmp / "ref.jsonl"))
    return _REFERENCE


def _check_resumes_exactly(tmp: Path, saved_step: int) -> None:
    """The interrupted run's steps and the resumed run's continue one uninterrupted run."""
    one = make_plan("pre", [(4, [(0, 6)])], optimizer="adam")
    _, one_path = write_plan(one, tmp / "one")
    end = saved_step + 2
    argv = [
        sys.executable,
        *_args(one_path, end, "--resume", "--checkpoint-dir", str(tmp / "disk")),
    ]
    argv += ["--metrics", str(tmp / "resumed.jsonl"), "--remote-storage", "none"]
    resumed = run(argv, cwd=ROOT, env=_env(), timeout=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"at step {saved_step}" in resumed.stderr
    reference = _reference(tmp, end)
    before, after = _losses(tmp / "metrics.jsonl"), _losses(tmp / "resumed.jsonl")
    assert max(before) == saved_step - 1  # the last finished step is the one saved
    assert min(after) == saved_step  # ... and the resumed run starts right after it
    for step, loss in {**before, **after}.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step


def test_sigterm_to_one_rank_saves_the_finished_step_on_every_rank(tmp_path: Path) -> None:
    procs = _start_two(tmp_path, {})
    _wait_for_step(tmp_path / "metrics.jsonl", 2, procs)
    procs[1].send_signal(signal.SIGTERM)  # the last stage's rank only
    (out0, err0), _ = _finish(procs)
    notice, saved = _events(out0)
    assert notice["event"] == "notice" and notice["hosts"] == {"localhost": "SIGTERM"}
    assert saved["event"] == "saved" and saved["step"] == notice["step"]
    step = int(saved["step"])  # type: ignore[call-overload]
    assert 3 <= step < MANY
    assert (tmp_path / "disk" / "pre" / "default" / f"step-{step:08d}" / "COMPLETE").is_file()
    assert "preempted: step" in err0
    _check_resumes_exactly(tmp_path, step)


def test_the_hosts_preemption_check_stops_training_at_a_saved_step(tmp_path: Path) -> None:
    """On a weight-sharded plan (issue 48: two holders, each with half of the state):
    the notice comes to every rank at once, they save the finished step's shards
    within it and exit 0, and one process resumes them with the uninterrupted losses."""
    flag = tmp_path / "reclaim-notice"
    check = CheckSpec(command=f"test -e {flag}", interval_s=0.2)
    procs = _start_two(tmp_path, {CHECK_ENV: check.to_env()}, sharded=True)
    _wait_for_step(tmp_path / "metrics.jsonl", 1, procs)
    flag.touch()
    (out0, _), _ = _finish(procs)
    notice, saved = _events(out0)
    assert "preemption check: command" in str(notice["hosts"])
    assert saved["event"] == "saved"
    step = int(saved["step"])  # type: ignore[call-overload]
    assert 2 <= step < MANY
    assert (tmp_path / "disk" / "pre" / "default" / f"step-{step:08d}" / "COMPLETE").is_file()
    _check_resumes_exactly(tmp_path, step)


def test_a_sigterm_past_the_repeat_window_ends_the_worker_at_once(tmp_path: Path) -> None:
    """The first is a notice and repeats within the window are the same notice; one
    later (a person or a deadline that will not wait) is obeyed."""
    from autohet_cli.runtime.agent import REPEAT_WINDOW_S

    procs = _start_two(tmp_path, {})
    _wait_for_step(tmp_path / "metrics.jsonl", 1, procs)
    # Stop rank 0 so no step boundary comes, then SIGTERMs to rank 1.
    procs[0].send_signal(signal.SIGSTOP)
    try:
        procs[1].send_signal(signal.SIGTERM)
        time.sleep(0.5)
        procs[1].send_signal(signal.SIGTERM)  # the shutdown again: still alive
        time.sleep(REPEAT_WINDOW_S + 0.5)
        assert procs[1].poll() is None
        procs[1].send_signal(signal.SIGTERM)
        procs[1].wait(timeout=30)
        assert procs[1].returncode == 128 + signal.SIGTERM
    finally:
        procs[0].send_signal(signal.SIGCONT)
        for p in procs:
            p.kill()
            p.wait()


def test_sigterm_to_the_agent_and_every_worker_at_once_is_one_notice(tmp_path: Path) -> None:
    """A shutdown as it happens: SIGTERM to torchrun's agent (ours, runtime.agent) and to
    each worker, shuffled, twice within a second; with --checkpoint-every 0."""
    import random

    from autohet_cli.runtime.agent import child_pids

    _, path = write_plan(make_plan("pre", [(4, [(0, 3), (3, 6)])], optimizer="adam"), tmp_path)
    args = _args(
        path,
        MANY,
        *("--metrics", str(tmp_path / "metrics.jsonl"), "--checkpoint-every", "0"),
        *("--checkpoint-dir", str(tmp_path / "disk"), "--remote-storage", "none"),
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "autohet_cli.runtime.agent", "--standalone"]
        + ["--nproc-per-node", "2", *args],
        cwd=ROOT,
        env=_env() | {"AUTOHET_HOST": "localhost"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for_step(tmp_path / "metrics.jsonl", 2, [agent])
        pids = [agent.pid, *child_pids(agent.pid)]
        assert len(pids) == 3, pids  # the agent and its two workers
        rng = random.Random(5)
        for _ in range(2):
            rng.shuffle(pids)
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            time.sleep(0.3)
        out, err = agent.communicate(timeout=TIMEOUT_S)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    assert agent.returncode == 0, err[-4000:]
    assert "SignalException" not in err and "forwarded to 2 worker(s)" in err
    notice, saved = _events(out)
    assert notice["hosts"] == {"localhost": "SIGTERM"}
    step = int(saved["step"])  # type: ignore[call-overload]
    assert saved["step"] == notice["step"] and isinstance(saved["notice_to_complete_s"], float)
    assert (tmp_path / "disk" / "pre" / "default" / f"step-{step:08d}" / "COMPLETE").is_file()
    _check_resumes_exactly(tmp_path, step)


_LATE = """
import json, sys, time, types
import torch.distributed as dist
from autohet_cli.runtime.preempt import Notices, PreemptionHook
rank, port, skip = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "skip"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
src = Notices()
lines = []
hook = PreemptionHook(
    host=f"h{rank}", rank=rank, install_signal=False, source=src, emit=lines.append
)
trainer = types.SimpleNamespace(step=5, stop_reason=None)
if rank == 1:
    src.notify("SIGTERM")  # before the step end: agreed on
hook.on_step_end(trainer, None)
assert trainer.stop_reason == "preempted"
if rank == 0:
    src.notify("SIGTERM")  # during the save: after the agreement
start = time.monotonic()
if not (skip and rank == 1):
    hook.on_train_end(trainer)
else:  # a rank whose save hangs never asks again
    time.sleep(float(sys.argv[4]) + 3)
print(json.dumps({"lines": lines, "took": time.monotonic() - start}), flush=True)
dist.destroy_process_group()  # as the trainer ends (Trainer.close)
"""


@pytest.mark.parametrize("mode", ["both", "skip"])
def test_a_notice_that_comes_during_the_save_is_named_by_the_saved_line(
    tmp_path: Path, mode: str
) -> None:
    """The shutdown reaches the second host a moment after the step end that agreed on
    the first host's notice: both hosts save and leave, so the saved line (what the
    launcher's verdict and recover line use) names both. When a rank never comes (its
    save raised), the others wait a bounded time and keep the agreed hosts."""
    from autohet_cli.runtime.preempt import LATE_NOTICE_WAIT_S

    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _LATE, str(rank), port, mode, str(LATE_NOTICE_WAIT_S)],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for _, e in outs]
    said = json.loads(outs[0][0].strip().splitlines()[-1])
    lines, took = said["lines"], said["took"]
    events = [json.loads(line[len(PREEMPT_PREFIX) :]) for line in lines]
    assert events[0]["event"] == "notice" and events[0]["hosts"] == {"h1": "SIGTERM"}
    assert events[1]["event"] == "saved"
    if mode == "both":
        assert events[1]["hosts"] == {"h1": "SIGTERM", "h0": "SIGTERM"}
    else:
        assert events[1]["hosts"] == {"h1": "SIGTERM"}
        # It waited its bound for the hung rank, then went on (the rank still sleeps).
        assert LATE_NOTICE_WAIT_S - 0.5 <= took < LATE_NOTICE_WAIT_S + 2.5
