"""The runtime side of ``--checkpoint-every``: a trainer hook that saves on the policy's
schedule (``autohet_cli.ckpt.policy``) and once more after the last step."""

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
    """Save on the schedule above (or every ``every`` steps) and once more at the end."""

    def __init__(
        self,
        checkpointer: Saver,
        every: int | None,
        *,
        say: Callable[[str], None] | None = None,
        final: bool = True,
    ) -> None:
        if every is not None and every < 1:
            raise ValueError(f"--checkpoint-every must be >= 1 or auto, got {every}")
        self.checkpointer, self.every, self.final = checkpointer, every, final
        self.say = say or (lambda _message: None)
        self._last_saved: int | None = None
        self._next: int | None = None
        self._step_times: list[float] = []
        self.saved_steps: list[int] = []

    def on_train_start(self, trainer: Trainer) -> None:
        self._last_saved = trainer.step  # a resumed run starts from a saved step
        self._next = trainer.step + 1 if self.every is None else None

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self._step_times.append(result.time_s)
        if self.every is not None:
            if trainer.step % self.every == 0:
                self._save(trainer)
            return
        if self._next is not None and trainer.step >= self._next:
            save_s = self._save(trainer)
            # The first step of a run carries warm-up; leave it out when others exist.
            times = self._step_times[1:] or self._step_times
            step_s = sum(times) / len(times)
            save_s, step_s = self.checkpointer.agree_max([save_s, step_s])
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

    def on_train_end(self, trainer: Trainer) -> None:
        if self.final and self._last_saved is not None and trainer.step != self._last_saved:
            self._save(trainer)
        self.checkpointer.close()
