"""The runtime side of ``--checkpoint-every``: a trainer hook that saves on the policy's
schedule (``autohet_cli.ckpt.policy``), once more after the last step, and the step a
preemption notice stopped at (``runtime.preempt``). ``--checkpoint-every 0`` only
turns the schedule off: the last step and a notice's step are still saved, since
losing the work of a whole run to a flag that reads "no periodic saves" is worse
than one save (``--no-emergency-save`` with it: the worker builds no hook at all).

Saves are asynchronous: ``save()`` returns once training may go on, and the hook
waits for durability only at the end of training (``close``), which is what an
emergency save needs before the process exits.

A hook of the runtime's (``runtime.hooks.Hook``) over the checkpointer it drives,
typed as ``Saver`` (what the hook calls of ``ckpt.checkpointer``); the trainer it is
handed is typed as ``HookTrainer``, what the hook reads of it, as the hooks below the
trainer do (``runtime.trainer_api``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from autohet_cli.ckpt.persist import SaveRecord
from autohet_cli.ckpt.policy import auto_interval_steps
from autohet_cli.ckpt.steptext import after
from autohet_cli.runtime.hooks import Hook
from autohet_cli.runtime.metrics import StepResult


class _Ranked(Protocol):
    @property
    def global_rank(self) -> int: ...


class HookTrainer(Protocol):
    """The trainer as the hook reads it: the step, and whether this is global rank 0
    (which says the schedule); ``stop_reason`` is read with ``getattr``."""

    @property
    def step(self) -> int: ...

    @property
    def runtime(self) -> _Ranked: ...


class Saver(Protocol):
    def save(self, *, last: bool = False) -> object: ...

    def close(self) -> None: ...

    def agree_max(self, values: Sequence[float]) -> list[float]: ...


class CheckpointHook(Hook):
    """Save on the schedule above (or every ``every`` steps; 0: never periodically),
    at the end (``final``, whatever ``every``) and at a preemption notice's step
    (``emergency``)."""

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
        self.final = final
        self.emergency = emergency
        self.notice_budget_s = notice_budget_s
        self.say = say or (lambda _message: None)
        self._last_saved: int | None = None
        self._next: int | None = None
        self._resumed_costs: list[float] | None = None  # a resumed run's first interval
        self._step_times: list[float] = []
        self._warned = False
        self.saved_steps: list[int] = []
        self.records: list[SaveRecord] = []  # finished saves (rank 0)
        listeners = getattr(checkpointer, "listeners", None)
        if listeners is not None:
            listeners.append(self._on_record)

    def on_train_start(self, trainer: HookTrainer) -> None:
        self._last_saved = trainer.step  # a resumed run starts from a saved step
        self._next = None
        if self.every is None:
            if trainer.step > 0:
                previous: Any = getattr(self.checkpointer, "previous_record", lambda: None)()
                # Every rank takes part in the agreement at the first step, record or not.
                self._resumed_costs = (
                    [previous["ckpt_blocked_s"], previous["ckpt_persist_s"]]
                    if previous
                    else [-1.0, -1.0]
                )
            else:
                self._next = trainer.step + 1

    def on_step_end(self, trainer: HookTrainer, result: StepResult) -> None:
        poll = getattr(self.checkpointer, "poll", None)
        if poll is not None:
            poll()  # a failed background save is reported now (training goes on)
        self._step_times.append(result.time_s)
        if self.every is not None:
            if self.every and trainer.step % self.every == 0:
                self._save(trainer)
            return
        if self._resumed_costs is not None:
            self._first_interval_after_resume(trainer, result.time_s)
        if self._next is not None and trainer.step >= self._next:
            # What a save costs once the snapshot buffers exist: the first save of a
            # run also allocates them (10.7 s for an H100 host's 14.8 GB), once.
            blocked_s = self._save(trainer)
            alloc_s = float(getattr(self.checkpointer, "last_alloc_s", 0.0) or 0.0)
            blocked_s = max(0.0, blocked_s - alloc_s)
            # The first step of a run carries warm-up; leave it out when others exist.
            times = self._step_times[1:] or self._step_times
            step_s = sum(times) / len(times)
            last = getattr(self.checkpointer, "last_record", None)
            persist_s = last.persist_s if last is not None else 0.0
            blocked_s, step_s, persist_s = self.checkpointer.agree_max(
                [blocked_s, step_s, persist_s]
            )
            k = auto_interval_steps(blocked_s, step_s, persist_s=persist_s)
            self._next = trainer.step + k
            self._step_times = []
            if trainer.runtime.global_rank == 0:
                share = blocked_s / (k * step_s) if step_s > 0 else 0.0
                self.say(
                    f"checkpoint at step {trainer.step} ({after(trainer.step)}) blocked "
                    f"training {blocked_s:.2f} s; "
                    f"next in {k} step(s) (~{k * step_s:.0f} s of training, {share:.1%} overhead)"
                )

    def _first_interval_after_resume(self, trainer: HookTrainer, step_s: float) -> None:
        """No save right after a resume: the first one comes the policy's interval
        after the resumed step, from the job's last save figures (every rank's
        maximum); with none on any host, save now, as a fresh run does."""
        assert self._resumed_costs is not None and self._last_saved is not None
        blocked_s, persist_s, step_s = self.checkpointer.agree_max([*self._resumed_costs, step_s])
        self._resumed_costs = None
        if blocked_s < 0:
            self._next = trainer.step
            return
        k = auto_interval_steps(blocked_s, step_s, persist_s=max(persist_s, 0.0))
        self._next = self._last_saved + k
        if trainer.runtime.global_rank == 0:
            self.say(
                f"checkpoints: first save at step {self._next}, {k} step(s) after the resumed "
                f"step (the job's last save blocked training {blocked_s:.2f} s)"
            )

    def _save(self, trainer: HookTrainer, *, last: bool = False) -> float:
        """Save now; returns how long training stood still for it (this rank).
        ``last``: training is over, nothing overlaps the write."""
        start = time.perf_counter()
        self.checkpointer.save(last=last)
        self._last_saved = trainer.step
        self.saved_steps.append(trainer.step)
        return time.perf_counter() - start

    def _on_record(self, record: SaveRecord) -> None:
        """A save finished (rank 0, the save's thread): keep it; warn once when the
        time to a durable step would not fit a spot host's notice (an emergency save
        must be durable before the host goes)."""
        self.records.append(record)
        budget = self.notice_budget_s
        if budget is None or record.persist_s <= budget or self._warned:
            return
        self._warned = True
        self.say(
            f"warning: a save takes {record.persist_s:.1f} s to be durable, longer than the "
            f"{budget:g} s notice a spot host of this plan gets: a preemption would lose the "
            "steps since the last save (use faster checkpoint disks, or fewer bytes per host: "
            "more hosts in the plan, or ZeRO-1)"
        )

    def on_train_end(self, trainer: HookTrainer) -> None:
        preempted = getattr(trainer, "stop_reason", None) == "preempted"
        wanted = self.emergency if preempted else self.final
        poll = getattr(self.checkpointer, "poll", None)
        if poll is not None:
            poll(block=True)  # a save of this very step that failed is tried again below
        failed = set(getattr(self.checkpointer, "failed_steps", ()))
        self.saved_steps = [s for s in self.saved_steps if s not in failed]
        unsaved = trainer.step != self._last_saved or self._last_saved in failed
        if wanted and self._last_saved is not None and unsaved:
            self._save(trainer, last=True)
        # The last save is durable here, or its failure raised: with no next save to
        # try again, a save that ends training fails the run.
        self.checkpointer.close()
