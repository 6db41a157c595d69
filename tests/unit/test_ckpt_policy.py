"""Checkpoints on by default: the `auto` schedule, its agreement across ranks, the final save."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from autohet_cli.ckpt.policy import (
    auto_interval_steps,
    checkpoint_every_of,
    describe_every,
    parse_every,
    saves_anything,
)
from autohet_cli.runtime.checkpoint_hook import CheckpointHook


def test_parse_every_accepts_auto_zero_and_counts_and_names_the_flag_on_errors() -> None:
    assert parse_every("auto") is None and parse_every("AUTO") is None
    assert parse_every("0") == 0 and parse_every("25") == 25
    for bad in ("-1", "often", "1.5"):
        with pytest.raises(ValueError, match="--checkpoint-every"):
            parse_every(bad)


def test_the_last_flag_wins_like_argparse() -> None:
    assert checkpoint_every_of(["--steps=5"]) is None
    assert checkpoint_every_of(["--checkpoint-every=auto", "--checkpoint-every", "3"]) == 3
    assert checkpoint_every_of(["--checkpoint-every", "7", "--checkpoint-every=0"]) == 0


def test_auto_interval_keeps_overhead_under_two_percent_and_bounds_lost_work() -> None:
    # 0.1 s saves, 50 ms steps: 100 steps -> 0.1 / 5 s = 2%.
    assert auto_interval_steps(0.1, 0.05) == 100
    # 60 s saves, 1 s steps: 2% would be every 3000 s; 30 min wins.
    assert auto_interval_steps(60.0, 1.0) == 1800
    assert auto_interval_steps(0.0, 1.0) == 1  # free saves: every step
    assert auto_interval_steps(5.0, 0.0) == 1  # no timing yet
    assert "every 3 steps" in describe_every(3)


class FakeSaver:
    def __init__(self, save_s: float, others: Sequence[float]) -> None:
        self.save_s, self.others = save_s, list(others)
        self.saved: list[int] = []
        self.closed = False
        self.trainer: SimpleNamespace | None = None

    def save(self, *, last: bool = False) -> None:
        assert self.trainer is not None
        self.saved.append(self.trainer.step)

    def close(self) -> None:
        self.closed = True

    def agree_max(self, values: Sequence[float]) -> list[float]:
        # Another rank measured a slower save: everyone must use the maximum.
        return [max(a, b) for a, b in zip(values, self.others, strict=True)]


def _run(hook: CheckpointHook, saver: FakeSaver, start: int, steps: int, step_s: float) -> None:
    trainer = SimpleNamespace(step=start, runtime=SimpleNamespace(global_rank=0))
    saver.trainer = trainer
    hook.on_train_start(trainer)  # type: ignore[arg-type]
    for _ in range(steps):
        trainer.step += 1
        hook.on_step_end(trainer, SimpleNamespace(time_s=step_s))  # type: ignore[arg-type]
    hook.on_train_end(trainer)  # type: ignore[arg-type]


def test_auto_saves_after_the_first_step_then_on_the_agreed_interval_then_at_the_end() -> None:
    # Other ranks: 0.1 s blocked, 10 ms steps, no save finished yet -> K = 500.
    saver = FakeSaver(0.0, [0.1, 0.01, 0.0])
    said: list[str] = []
    hook = CheckpointHook(saver, None, say=said.append)
    _run(hook, saver, start=0, steps=1200, step_s=0.005)
    assert saver.saved == [1, 501, 1001, 1200] and saver.closed
    assert "next in 500 step(s)" in said[0]


def test_a_save_in_flight_bounds_the_interval_from_below() -> None:
    """Asynchronous saves: training loses only the blocked time, but the next save
    must not come before the last one is durable (one in flight)."""
    assert auto_interval_steps(0.001, 0.01) == 5  # 1 ms blocked per 10 ms steps: 2% at 5
    assert auto_interval_steps(0.001, 0.01, persist_s=2.0) == 200  # 2 s to be durable
    assert auto_interval_steps(0.001, 0.01, persist_s=float("inf")) == 5
    saver = FakeSaver(0.0, [0.001, 0.01, 2.0])  # another rank's last save took 2 s
    _run(CheckpointHook(saver, None), saver, start=0, steps=450, step_s=0.01)
    assert saver.saved == [1, 201, 401, 450]


class ResumedSaver(FakeSaver):
    def __init__(self, record: dict[str, float] | None, others: Sequence[float]) -> None:
        super().__init__(0.0, others)
        self.record = record

    def previous_record(self) -> dict[str, float] | None:
        return self.record


def test_a_resumed_run_saves_after_the_policys_interval_not_right_away() -> None:
    """Issue 28: no save right after a resume unless the interval has passed."""
    last = {"ckpt_blocked_s": 0.1, "ckpt_persist_s": 1.0}
    saver = ResumedSaver(last, [-1.0, -1.0, 0.01])  # 10 ms steps -> K = 500 after step 100
    said: list[str] = []
    _run(CheckpointHook(saver, None, say=said.append), saver, start=100, steps=700, step_s=0.01)
    assert saver.saved[0] == 600  # nothing between the resumed step and its interval
    assert "first save at step 600, 500 step(s) after the resumed step" in said[0]
    # No figures on any host (a job saved before they were kept): save at once.
    unknown = ResumedSaver(None, [-1.0, -1.0, 0.01])
    _run(CheckpointHook(unknown, None), unknown, start=100, steps=3, step_s=0.01)
    assert unknown.saved[0] == 101


def test_fixed_interval_and_final_save_and_resumed_runs_do_not_resave_their_start() -> None:
    saver = FakeSaver(0.0, [0.0, 0.0])
    _run(CheckpointHook(saver, 3), saver, start=0, steps=10, step_s=0.01)
    assert saver.saved == [3, 6, 9, 10]
    resumed = FakeSaver(0.0, [0.0, 0.0])
    _run(CheckpointHook(resumed, 3), resumed, start=9, steps=0, step_s=0.01)
    assert resumed.saved == []  # nothing trained: step 9 is already saved


def test_checkpoint_every_0_turns_off_periodic_saves_not_the_last_step() -> None:
    """Issue 46: ``--checkpoint-every 0`` ended a 60-step resumed run with its newest
    checkpoint 60 steps back: the last step must be saved, and the launch must say so."""
    saver = FakeSaver(0.0, [0.0, 0.0])
    _run(CheckpointHook(saver, 0), saver, start=60, steps=60, step_s=0.01)
    assert saver.saved == [120] and saver.closed
    said = describe_every(0)
    assert said.startswith("no periodic saves") and "the last step is saved" in said
    assert "a preemption notice saves its step" in said
    # With --no-emergency-save too, nothing at all, said as such.
    assert saves_anything(0, emergency=True) and not saves_anything(0, emergency=False)
    assert saves_anything(None, emergency=False) and saves_anything(5, emergency=False)
    off = describe_every(0, emergency=False)
    assert off.startswith("none") and "neither the last step" in off
