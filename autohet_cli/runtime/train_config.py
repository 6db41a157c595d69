"""What a run is told beyond its plan: seed, optimiser hyper-parameters, schedule,
device, model and data functions (the worker's flags, ``runtime.train``)."""

from __future__ import annotations

from dataclasses import dataclass

from autohet_cli.runtime.lr_schedule import DEFAULT_EXTEND, LRSchedule
from autohet_cli.runtime.worker_defaults import DEFAULT_MODEL_FN


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    seed: int = 0
    lr: float = 1e-3
    min_lr: float | None = None  # default lr / 10
    warmup_steps: int = 0
    decay_steps: int | None = None  # default: the run's last step (--steps); resumed: the saved
    lr_schedule: str = "cosine"  # cosine | linear | constant
    lr_extend: str = DEFAULT_EXTEND  # resumed past the decay end: redecay | rewarm | continue
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.9  # SGD
    grad_clip: float = 1.0  # max global gradient norm; 0: off
    device: str = "auto"  # auto | cpu | cuda
    compile: str = "auto"  # torch.compile per block: auto (on CUDA) | on | off (compiling.py)
    model_fn: str = DEFAULT_MODEL_FN
    init_from: str | None = None  # HF model directory: initial weights (runtime.hf_weights)
    data: str | None = None  # token file or directory (dataset.formats); None: synthetic
    data_dtype: str | None = None  # flat token files without a header: uint16 | uint32
    data_fn: str | None = None  # package.module:function (runtime.data_api)
    val_fraction: float = 0.005
    eval_every: int = 0  # steps between validation losses; 0: never
    eval_batches: int = 4  # global batches per validation loss
    max_nonfinite_steps: int = 3  # a non-finite loss this many steps in a row stops the run
    trace_steps: tuple[int, ...] = ()  # steps whose every op is kept for a trace

    def schedule(self, last_step: int) -> LRSchedule:
        return LRSchedule(
            lr=self.lr,
            min_lr=self.lr / 10 if self.min_lr is None else self.min_lr,
            warmup_steps=self.warmup_steps,
            decay_steps=last_step if self.decay_steps is None else self.decay_steps,
            style=self.lr_schedule,
        )
