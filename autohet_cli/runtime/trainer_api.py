"""What the trainer's helpers may see of it: ``TrainerView`` and ``TrainerState``.

``runtime.trainer`` is the orchestrator at the top of the runtime: it builds the
stage, the schedule and the optimizers, runs the loop and calls its hooks and its
state seams with itself. Those helpers (``hooks``, ``health``, ``report``,
``preempt``, ``run_state``, ``train_state``) sit below it, so they type against
these protocols instead of importing the class that calls them: the arrows point
down only, and each helper's reach into the trainer is written here.

A member a helper only reads is a property; one it sets is a plain attribute
(``stop_reason``: a preemption notice ends the fit; ``trace_steps``: the run
report picks the steps to trace; ``step``, ``data_shift``, ``schedule_so_far``:
a checkpoint's load places the run). ``Trainer`` meets both protocols
structurally: mypy checks it wherever the trainer hands itself to a hook or a
seam. Importing this module loads nothing: the types are for the checker only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from autohet_cli.plan import Plan
    from autohet_cli.runtime.compiling import CompileClock
    from autohet_cli.runtime.context import Runtime
    from autohet_cli.runtime.data_api import Batches
    from autohet_cli.runtime.lr_schedule import LRSchedule
    from autohet_cli.runtime.optim import LossScaler
    from autohet_cli.runtime.stage import StageModule
    from autohet_cli.runtime.timing import Timings
    from autohet_cli.runtime.train_config import TrainConfig
    from autohet_cli.runtime.zero import ZeroState

__all__ = ["TrainerState", "TrainerView"]


class TrainerView(Protocol):
    """The trainer as hooks and the ``run`` entry of a checkpoint (``run_state``) see
    it: the run's context, where the loop stands, the schedule, the data and the
    stage (a hook may read its weights: ``--dump-state``)."""

    @property
    def plan(self) -> Plan: ...

    @property
    def config(self) -> TrainConfig: ...

    @property
    def runtime(self) -> Runtime: ...

    @property
    def step(self) -> int:
        """The next step to run."""

    @property
    def last_step(self) -> int:
        """The step the current fit ends at."""

    @property
    def data_shift(self) -> int:
        """The data's step is ``step + data_shift`` (``ckpt.lineage``)."""

    @property
    def data(self) -> Batches: ...

    @property
    def lr_schedule(self) -> LRSchedule:
        """The schedule of the current fit."""

    @property
    def schedule_so_far(self) -> LRSchedule | None:
        """The schedule the steps so far followed; None before the first fit."""

    @property
    def stage(self) -> StageModule: ...

    @property
    def timings(self) -> Timings: ...

    @property
    def compile_clock(self) -> CompileClock | None: ...

    # Set by hooks.
    stop_reason: str | None  # not None: fit() ends after the current step's hooks
    trace_steps: set[int]  # the steps whose every op is timed (``--trace``)


class TrainerState(TrainerView, Protocol):
    """The trainer as its checkpoint seam (``train_state``) sees it: besides the
    view, the optimizers whose state it saves and loads with the stage's, and the
    loop position a load sets."""

    step: int
    data_shift: int
    schedule_so_far: LRSchedule | None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """None: ZeRO-1 slices hold every parameter's optimizer state."""

    @property
    def zero(self) -> ZeroState | None: ...

    @property
    def zero_optimizer(self) -> torch.optim.Optimizer | None: ...

    @property
    def zero_groups(self) -> tuple[dict[str, Any], ...]:
        """The hyperparameters a replicated optimizer files per parameter group, for
        ZeRO-1 checkpoints to carry the same entries."""

    @property
    def lr(self) -> float:
        """The rate of the last step taken."""

    @property
    def scaler(self) -> LossScaler | None: ...

    def run_state(self) -> dict[str, Any]:
        """The checkpoint's ``run`` entry (``run_state.describe``)."""
        ...
