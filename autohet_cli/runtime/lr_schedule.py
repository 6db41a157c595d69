"""The learning-rate schedule: a pure function of the step (no torch), and what it
becomes when a resumed run trains past the end of its decay (``--lr-extend``).

``LRSchedule`` warms up linearly, then decays (cosine or linear) to ``min_lr`` at
``decay_steps``. A resumed run keeps the decay end of the run it continues, which
is what makes an interrupted run resume bit-identical. Extending a run (resuming
with a ``--steps`` past that end, ``--decay-steps`` not given) is another matter:
kept as is, every new step would train at ``min_lr``, which after a finished run
is the floor of the schedule, silently. So the run re-plans from the resumed step
``s`` to the new end ``E`` as ``--lr-extend`` says, and says so:

- ``redecay`` (default): decay from the rate at ``s`` to ``min_lr`` at ``E``, the
  same curve shape, no jump. Resumed inside the warmup, the warmup goes on and the
  decay just ends at ``E``. After a finished decay the rate at ``s`` is ``min_lr``
  already, so the new steps stay there (the note offers ``rewarm``).
- ``rewarm``: warm up again, linearly from the rate at ``s`` to ``lr`` over
  ``warmup_steps``, then decay to ``min_lr`` at ``E`` (the usual way to train a
  finished model further).
- ``continue``: the old schedule, ``min_lr`` from its end on (the behaviour before
  the flag existed).

A re-planned schedule records where it restarted (``restart_step``, the rate there,
``rewarm``) in the checkpoints it writes, so that interrupting and resuming the
extended run is exact again. Why not ``torch.optim.lr_scheduler``: see
``runtime.optim``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

SCHEDULES = ("cosine", "linear", "constant")
EXTEND_MODES = ("redecay", "rewarm", "continue")
DEFAULT_EXTEND = "redecay"


@dataclass(frozen=True, slots=True, kw_only=True)
class LRSchedule:
    """Learning rate of step ``t`` (0-based)."""

    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int  # the step decay ends at (min_lr from there on)
    style: str = "cosine"  # cosine | linear | constant
    # Re-planned by a resumed run that went past the decay end (--lr-extend); steps
    # before restart_step then ran on the schedule it replaced, which is not kept.
    restart_step: int = 0
    restart_lr: float | None = None  # the rate at restart_step; None: planned at step 0
    rewarm: bool = False  # warm up again from restart_lr (else decay from it)

    def __post_init__(self) -> None:
        if self.style not in SCHEDULES:
            raise ValueError(f"lr schedule {self.style!r}: expected one of {', '.join(SCHEDULES)}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"learning rates need 0 <= min_lr <= lr, lr > 0: got {self}")
        if self.warmup_steps < 0 or self.decay_steps < 0 or self.restart_step < 0:
            raise ValueError("warmup, decay and restart steps must be >= 0")
        if self.restart_lr is not None and not (
            math.isfinite(self.restart_lr) and self.restart_lr >= 0
        ):
            raise ValueError(f"restart_lr must be a finite rate >= 0, got {self.restart_lr}")

    @property
    def decay_start(self) -> int:
        """The step the decay starts at: after the warmup (the second one, re-warmed)."""
        if self.restart_lr is None:
            return self.warmup_steps
        return self.restart_step + (self.warmup_steps if self.rewarm else 0)

    def at(self, step: int) -> float:
        if self.restart_lr is None or step < self.restart_step:
            return self._rate(step, start=0, base=0.0, warm=self.warmup_steps, top=self.lr)
        if self.rewarm:
            warm, top = self.warmup_steps, self.lr
        else:
            warm, top = 0, self.restart_lr
        return self._rate(step, start=self.restart_step, base=self.restart_lr, warm=warm, top=top)

    def _rate(self, step: int, *, start: int, base: float, warm: int, top: float) -> float:
        """Warm up from ``base`` at ``start`` to ``lr`` over ``warm`` steps, then decay
        from ``top`` to ``min_lr`` at ``decay_steps``. A schedule planned at step 0 is
        ``base`` 0 and ``top`` ``lr``: the same operations, so the same bits, as the
        formula before re-planning existed."""
        k = step - start
        if k < warm:
            return base + (self.lr - base) * (k + 1) / warm
        if self.style == "constant":
            return self.lr
        if step >= self.decay_steps:
            return self.min_lr
        begin = start + warm
        ratio = (step - begin) / (self.decay_steps - begin)
        if self.style == "linear":
            return top - ratio * (top - self.min_lr)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (top - self.min_lr)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def goes_past(schedule: LRSchedule, end: int) -> bool:
    """Whether a run to ``end`` trains past the decay ``schedule`` planned (a
    constant schedule has none to go past)."""
    return end > schedule.decay_steps and schedule.style != "constant"


def extended(schedule: LRSchedule, *, step: int, end: int, how: str) -> LRSchedule:
    """The schedule a run continued at ``step`` follows to ``end`` (see the module
    doc); ``schedule`` itself when ``end`` is not past its decay end, so an
    interrupted run resumed to the same end keeps every bit of its schedule."""
    if how not in EXTEND_MODES:
        raise ValueError(f"--lr-extend {how!r}: expected one of {', '.join(EXTEND_MODES)}")
    if not goes_past(schedule, end) or how == "continue":
        return schedule
    if how == "redecay" and step <= schedule.decay_start:
        return replace(schedule, decay_steps=end)  # warmup rates do not depend on the end
    return replace(
        schedule,
        decay_steps=end,
        restart_step=step,
        restart_lr=schedule.at(step),
        rewarm=how == "rewarm",
    )


def describe_extension(schedule: LRSchedule, *, step: int, end: int, how: str) -> str | None:
    """What the rate does from ``step`` to ``end`` when that goes past the decay
    end, and the other choices; None when it does not go past."""
    if not goes_past(schedule, end):
        return None
    old_end, floor, rate = schedule.decay_steps, schedule.min_lr, schedule.at(step)
    head = (
        f"the learning-rate schedule resumed at step {step} ends its decay (min_lr "
        f"{floor:g}) at step {old_end}; --steps {end} goes past that: "
    )
    warm_again = (
        f"warm up to --lr {schedule.lr:g} again over {schedule.warmup_steps} step(s)"
        if schedule.warmup_steps
        else f"jump to --lr {schedule.lr:g} again, as --warmup-steps is 0"
    )
    rewarm = f"rewarm ({warm_again}, then decay to min_lr at step {end})"
    if how == "continue":
        return (
            head + f"--lr-extend continue keeps it: min_lr {floor:g} for "
            f"{_steps(max(step, old_end), end)}. Other choices: --lr-extend redecay (decay "
            f"from the rate at step {step}, {rate:.4g}, to min_lr at step {end}) or "
            "--lr-extend " + rewarm
        )
    if how == "rewarm":
        warm = (
            f"warms up from {rate:.4g} to --lr {schedule.lr:g} over {schedule.warmup_steps} step(s)"
            if schedule.warmup_steps
            else f"jumps from {rate:.4g} to --lr {schedule.lr:g} (--warmup-steps 0)"
        )
        return (
            head + f"--lr-extend rewarm {warm} from step {step}, then decays "
            f"({schedule.style}) to min_lr {floor:g} at step {end}. Other choices: "
            "--lr-extend redecay (decay from the current rate, no warmup) or continue "
            f"(min_lr from step {old_end})"
        )
    if step < schedule.decay_start:
        return (
            head + f"--lr-extend redecay (the default) goes on warming up and decays to "
            f"min_lr {floor:g} at step {end} instead. Other choices: --lr-extend continue "
            f"(min_lr from step {old_end}) or --lr-extend " + rewarm
        )
    if step >= old_end:  # redecay after the decay ended: nothing left to decay
        return (
            head + f"that decay is over, so --lr-extend redecay (the default) keeps min_lr "
            f"{floor:g} for {_steps(step, end)}. For a higher rate, pass "
            "--lr-extend " + rewarm
        )
    return (
        head + f"--lr-extend redecay (the default) re-plans the decay: from {rate:.4g} at "
        f"step {step} to min_lr {floor:g} at step {end}, no jump. Other choices: "
        f"--lr-extend continue (min_lr from step {old_end}) or --lr-extend " + rewarm
    )


def _steps(first: int, end: int) -> str:
    return f"step {first}" if end - first == 1 else f"steps {first}-{end - 1}"
