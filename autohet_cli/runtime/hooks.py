"""Seams of the step loop: ``Hook`` and the metrics hook every worker runs.

Hooks sit below the trainer that calls them: they are handed it as
``runtime.trainer_api.TrainerView`` and never import ``runtime.trainer``, so a
hook asks for the trainer's interface, not its class.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autohet_cli.runtime.metrics import MetricsWriter, StepResult
from autohet_cli.runtime.spikes import SpikeWatch
from autohet_cli.runtime.trainer_api import TrainerView


class Hook:
    """Override what you need; every rank calls every hook.

    An override may ask for less than ``TrainerView`` (a protocol of only what
    it reads), never for more: the trainer promises its hooks that view alone."""

    def on_train_start(self, trainer: TrainerView) -> None:
        pass

    def on_step_start(self, trainer: TrainerView, step: int) -> None:
        pass

    def on_step_end(self, trainer: TrainerView, result: StepResult) -> None:
        pass

    def on_eval(self, trainer: TrainerView, step: int, loss: float) -> None:
        """After step ``step`` (and its ``on_step_end``): the validation loss."""

    def on_train_end(self, trainer: TrainerView) -> None:
        pass


class MetricsHook(Hook):
    """Rank 0 appends one JSON line per step to ``path``, writes TensorBoard scalars
    under ``tensorboard_dir`` when tensorboard is installed, and prints a short line;
    ``copy_to`` and ``stream`` bring the lines to the launcher's run folder
    (``MetricsWriter``)."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        tensorboard_dir: Path | None = None,
        echo: bool = True,
        copy_to: Path | None = None,
        stream: bool = False,
    ) -> None:
        self.path = Path(path) if path else None
        self.tensorboard_dir, self.echo = tensorboard_dir, echo
        self.copies: dict[str, Any] = {"copy_to": copy_to, "stream": stream}
        self.writer: MetricsWriter | None = None
        self.spikes: SpikeWatch | None = None

    def on_train_start(self, trainer: TrainerView) -> None:
        if trainer.runtime.global_rank == 0 and self.writer is None:
            self.spikes = SpikeWatch(grad_clip=trainer.config.grad_clip)
            self.writer = MetricsWriter(
                self.path, tensorboard_dir=self.tensorboard_dir, echo=self.echo, **self.copies
            )
            if self.writer.tb_missing:
                print(
                    "note: tensorboard is not installed, metrics go to JSON lines only "
                    "(pip install 'autohet-cli[tensorboard]')",
                    flush=True,
                )

    def on_step_end(self, trainer: TrainerView, result: StepResult) -> None:
        if self.writer is not None:
            self.writer.write(result)
        if self.echo and self.spikes is not None:
            remark = self.spikes.observe(result.step, result.grad_norm)
            if remark is not None:
                print(f"note: {remark}", flush=True)

    def on_eval(self, trainer: TrainerView, step: int, loss: float) -> None:
        if self.writer is not None:
            self.writer.write_eval(step, loss)

    def write_checkpoint(self, record: dict[str, Any]) -> None:
        """A save's record (rank 0; from the save's thread, also after training ended)."""
        late = MetricsWriter(self.path, echo=False, **self.copies)  # training ended
        writer = self.writer or (late if self.path or self.copies["copy_to"] else None)
        if writer is not None:
            writer.write_checkpoint(record)

    def on_train_end(self, trainer: TrainerView) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
