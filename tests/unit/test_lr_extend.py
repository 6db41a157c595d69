"""Issue 46: a resumed run whose --steps goes past its checkpoint's decay end trained
every new step at min_lr without a word. ``--lr-extend`` (runtime.lr_schedule)
re-plans the schedule from the resumed step, and the worker says how; a resume to
the same end keeps every bit of the schedule."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from autohet_cli.cli import trainopts
from autohet_cli.runconfig import BY_KEY
from autohet_cli.runtime import run_state
from autohet_cli.runtime.lr_schedule import (
    EXTEND_MODES,
    LRSchedule,
    describe_extension,
    extended,
)
from autohet_cli.runtime.train_args import parse_args, train_config
from autohet_cli.runtime.train_config import TrainConfig

LR, MIN_LR = 1e-3, 1e-4


def _schedule(style: str = "cosine", warmup: int = 10, end: int = 120) -> LRSchedule:
    return LRSchedule(lr=LR, min_lr=MIN_LR, warmup_steps=warmup, decay_steps=end, style=style)


def _before(s: LRSchedule, step: int) -> float:
    """``LRSchedule.at`` as it was before re-planning existed (issue 46)."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.style == "constant":
        return s.lr
    if step >= s.decay_steps:
        return s.min_lr
    ratio = (step - s.warmup_steps) / (s.decay_steps - s.warmup_steps)
    if s.style == "linear":
        return s.lr - ratio * (s.lr - s.min_lr)
    return s.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (s.lr - s.min_lr)


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_a_schedule_to_the_same_end_is_bit_identical_to_before(style: str) -> None:
    """The exactness of a resumed run (tests/dist) rests on this."""
    for warmup in (0, 7):
        s = _schedule(style, warmup)
        assert all(s.at(t) == _before(s, t) for t in range(200))
        for how in EXTEND_MODES:
            for step in (0, 5, 60, 119, 120):
                for end in (60, 120):  # the same end, or a shorter run
                    assert extended(s, step=step, end=end, how=how) is s
                    assert describe_extension(s, step=step, end=end, how=how) is None


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_redecay_goes_on_from_the_current_rate_to_min_lr_at_the_new_end(style: str) -> None:
    s = _schedule(style)
    new = extended(s, step=60, end=400, how="redecay")
    assert new.at(60) == pytest.approx(s.at(60), rel=1e-12)  # no jump
    rates = [new.at(t) for t in range(60, 401)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))  # decays throughout
    assert rates[-2] > MIN_LR and new.at(400) == MIN_LR and new.at(10_000) == MIN_LR
    assert new.at(61) > s.at(61)  # slower than the old decay: the new end is later
    # Resumed inside the warmup: the warmup goes on, the decay ends later.
    early = extended(s, step=4, end=400, how="redecay")
    assert [early.at(t) for t in range(4, 11)] == [s.at(t) for t in range(4, 11)]
    assert early.decay_steps == 400 and early.restart_lr is None


def test_after_a_finished_decay_redecay_and_continue_stay_at_min_lr_and_rewarm_climbs() -> None:
    s = _schedule(end=60)  # a 60-step run, extended to 120
    for how in ("redecay", "continue"):
        new = extended(s, step=60, end=120, how=how)
        assert {new.at(t) for t in range(60, 130)} == {MIN_LR}
    warm = extended(s, step=60, end=120, how="rewarm")
    assert warm.at(60) == pytest.approx(MIN_LR + (LR - MIN_LR) / 10)  # from the current rate
    assert warm.at(69) == pytest.approx(LR) and warm.at(70) == pytest.approx(LR)
    rates = [warm.at(t) for t in range(70, 121)]
    assert all(a > b for a, b in zip(rates, rates[1:], strict=False))
    assert warm.at(119) > MIN_LR and warm.at(120) == MIN_LR
    jump = extended(replace(s, warmup_steps=0), step=60, end=120, how="rewarm")
    assert jump.at(60) == pytest.approx(LR)  # no warmup: straight back to --lr


def test_an_unfinished_run_extended_with_continue_keeps_its_old_end() -> None:
    s = _schedule()
    assert extended(s, step=60, end=400, how="continue") is s
    with pytest.raises(ValueError, match="--lr-extend 'rewind'"):
        extended(s, step=60, end=400, how="rewind")


def test_the_worker_says_what_the_rate_will_do_and_offers_the_choices() -> None:
    finished = _schedule(end=60)
    said = describe_extension(finished, step=60, end=120, how="redecay")
    assert said is not None
    assert "ends its decay (min_lr 0.0001) at step 60; --steps 120 goes past that" in said
    assert "keeps min_lr 0.0001 for steps 60-119" in said and "--lr-extend rewarm" in said
    said = describe_extension(_schedule(), step=60, end=400, how="redecay")
    assert said is not None and "re-plans the decay: from 0.000" in said
    assert "to min_lr 0.0001 at step 400, no jump" in said and "--lr-extend continue" in said
    said = describe_extension(finished, step=60, end=120, how="continue")
    assert said is not None and "min_lr 0.0001 for steps 60-119" in said
    assert "--lr-extend redecay" in said and "--lr-extend rewarm" in said
    said = describe_extension(finished, step=60, end=120, how="rewarm")
    assert said is not None and "warms up from 0.0001 to --lr 0.001 over 10 step(s)" in said


def _trainer(step: int, last_step: int, **config: Any) -> Any:
    """What the schedule functions read of a Trainer."""
    return SimpleNamespace(
        config=TrainConfig(lr=LR, min_lr=MIN_LR, warmup_steps=10, **config),
        runtime=SimpleNamespace(global_rank=0),
        step=step,
        last_step=last_step,
        schedule_so_far=None,
    )


def test_a_replanned_schedule_travels_in_the_checkpoint_and_resumes_exactly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    first = _trainer(0, 60)
    first.schedule_so_far = run_state.fit_schedule(first)
    assert first.schedule_so_far == _schedule(end=60)  # a fresh run: to --steps
    saved = {"lr_schedule": first.schedule_so_far.to_json()}

    extend = _trainer(60, 120, lr_extend="rewarm")  # launch --resume --steps 120
    extend.schedule_so_far = run_state.resumed_schedule(extend, saved)
    plan = run_state.fit_schedule(extend)
    assert "note: the learning-rate schedule resumed at step 60" in capsys.readouterr().err
    assert (plan.restart_step, plan.rewarm, plan.decay_steps) == (60, True, 120)

    again = _trainer(90, 120)  # preempted at 90, resumed to the same end (default flag)
    again.schedule_so_far = run_state.resumed_schedule(again, {"lr_schedule": plan.to_json()})
    resumed = run_state.fit_schedule(again)
    assert resumed == plan and capsys.readouterr().err == ""  # exact, and nothing to say
    # A checkpoint from before the re-plan fields: a schedule planned at step 0.
    fields = ("restart_step", "restart_lr", "rewarm")
    old = {"lr_schedule": {k: v for k, v in saved["lr_schedule"].items() if k not in fields}}
    assert run_state.resumed_schedule(again, old) == _schedule(end=60)


def test_lr_extend_reaches_the_worker_from_launch_recover_and_run_configs() -> None:
    training = trainopts.resolve(
        config=None,
        steps=120,
        checkpoint_every=None,
        data=None,
        data_fn=None,
        train_arg=None,
        lr_extend=trainopts.LrExtend.rewarm,
    )
    assert "--lr-extend=rewarm" in training.train_args
    args = parse_args(["--plan", "p.yaml", "--steps", "120", *training.train_args])
    assert train_config(args).lr_extend == "rewarm"
    assert train_config(parse_args(["--plan", "p.yaml", "--steps", "1"])).lr_extend == "redecay"
    assert {m.value for m in trainopts.LrExtend} == set(EXTEND_MODES)
    assert set(BY_KEY["lr_extend"].choices) == set(EXTEND_MODES)
    with pytest.raises(SystemExit):
        parse_args(["--plan", "p.yaml", "--steps", "1", "--lr-extend", "rewind"])
