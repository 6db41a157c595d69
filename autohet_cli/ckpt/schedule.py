"""The runtime side of ``--checkpoint-every``: a trainer hook that saves on the policy's
schedule (``autohet_cli.ckpt.policy``), once more after the last step, and the step a
preemption notice stopped at (``runtime.preempt``; also with ``--checkpoint-every 0``,
unless ``--no-emergency-save``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from autohet_cli.ckpt.policy import auto_interval_steps
from autohet_cli.runtime.trainer import Hook, StepResult, Trainer


class Saver(Protocol):
    def save(self) -> object: ...

    def close(self) -> None: ...

    def agree_max(self, values: Sequence[float]) -> list[float]: ...


class CheckpointHook(Hook):
    """Save on the schedule above (or every ``every`` steps; 0: never periodically),
    at the end (``final``) and at a preemption notice's step (``emergency``)."""

    def __init__(
        self,
        checkpointer: Saver,
        every: int | None,
        *,
        say: Callable[[str], None] | None = None,
        final: bool = True,
        emergency: bool = True,
        notice_budget_s: float | None = None,
    ) -> None:
        if every is not None and every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0 or auto, got {every}")
        self.checkpointer, self.every = checkpointer, every
        self.final = final and every != 0
        self.emergency = emergency
        self.notice_budget_s = notice_budget_s
        self.say = say or (lambda _message: None)
        self._last_saved: int | None = None
        self._next: int | None = None
        self._step_times: list[float] = []
        self._warned = False
        self.saved_steps: list[int] = []
        self.save_times_s: list[float] = []  # each save's time (agreed where a budget is)

    def on_train_start(self, trainer: Trainer) -> None:
        self._last_saved = trainer.step  # a resumed run starts from a saved step
        self._next = trainer.step + 1 if self.every is None else None

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self._step_times.append(result.time_s)
        if self.every is not None:
            if self.every and trainer.step % self.every == 0:
                self._timed(trainer, self._save(trainer))
            return
        if self._next is not None and trainer.step >= self._next:
            save_s = self._save(trainer)
            # The first step of a run carries warm-up; leave it out when others exist.
            times = self._step_times[1:] or self._step_times
            step_s = sum(times) / len(times)
            save_s, step_s = self.checkpointer.agree_max([save_s, step_s])
            self._timed(trainer, save_s, agreed=True)
            k = auto_interval_steps(save_s, step_s)
            self._next = trainer.step + k
            self._step_times = []
            if trainer.runtime.global_rank == 0:
                share = save_s / (k * step_s) if step_s > 0 else 0.0
                self.say(
                    f"checkpoint at step {trainer.step} took {save_s:.2f} s; next in {k} "
                    f"step(s) (~{k * step_s:.0f} s of training, {share:.1%} overhead)"
                )

    def _save(self, trainer: Trainer) -> float:
        start = time.perf_counter()
        self.checkpointer.save()
        self._last_saved = trainer.step
        self.saved_steps.append(trainer.step)
        return time.perf_counter() - start

    def _timed(self, trainer: Trainer, save_s: float, *, agreed: bool = False) -> None:
        """Keep a save's time; warn once when it would not fit a spot host's notice
        (the slowest rank's time: every rank calls this, so the agreement is safe)."""
        budget = self.notice_budget_s
        if budget is not None and not agreed:
            save_s = self.checkpointer.agree_max([save_s])[0]
        self.save_times_s.append(save_s)
        if budget is None or save_s <= budget or self._warned:
            return
        self._warned = True
        if trainer.runtime.global_rank == 0:
            self.say(
                f"warning: a save takes {save_s:.1f} s, longer than the {budget:g} s notice "
                "a spot host of this plan gets: a preemption would lose the steps since the "
                "last save (use faster checkpoint disks, or fewer bytes per host: more "
                "hosts in the plan, or ZeRO-1)"
            )

    def on_train_end(self, trainer: Trainer) -> None:
        preempted = getattr(trainer, "stop_reason", None) == "preempted"
        wanted = self.emergency if preempted else self.final
        if wanted and self._last_saved is not None and trainer.step != self._last_saved:
            self._timed(trainer, self._save(trainer))
        self.checkpointer.close()
