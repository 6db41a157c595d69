"""The step loop: schedule, gradient sync, clipping, optimizer step, metrics, hooks.

One iteration on every rank:

1. each pipeline runs 1F1B over its own micro-batches (``pipeline``), leaving on
   its ranks the gradients of its share of the mean loss over the global batch;
2. the segment groups sum those gradients across pipelines (``gradsync``);
3. fp16 only: gradients are unscaled and a step with an inf/nan anywhere is skipped;
4. gradients are clipped by their global norm over every stage and TP shard
   (``optim.clip_grad_norm``), the learning rate is set from the step
   (``lr_schedule.LRSchedule``) and the optimizer steps (AdamW or SGD, as the plan says);
5. the loss shares and every rank's peak memory are summed over the world for
   rank 0's metrics; every ``eval_every`` steps the validation loss is measured.

The data depend only on (seed, step) (``data_api``), and so does the learning
rate, so ``load_state_dict`` of a ``state_dict()`` (model and optimizer keyed by
full parameter names, ready for torch.distributed.checkpoint) resumes exactly
under any plan. ``Hook`` objects see the start and end of training and of every
step (a checkpoint hook saves every N steps, a health hook beats a heart).

The trainer is the top of the runtime: it imports its helpers, and they see it
through ``trainer_api`` (``TrainerView``, ``TrainerState``), never this module.
Building the stage (``stage_setup``) and the validation loss (``evaluation``)
live beside it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from autohet_cli.ckpt.lineage import DataOrder, ModelRecord
from autohet_cli.errors import ConfigError
from autohet_cli.plan import Plan
from autohet_cli.runtime import run_state, train_state
from autohet_cli.runtime.batchcheck import NonFiniteGuard, check_token_ids
from autohet_cli.runtime.compiling import CompileClock
from autohet_cli.runtime.context import Runtime, init_runtime
from autohet_cli.runtime.data_api import (
    Batches,
    DataRequest,
    build_batches,
    can_evaluate,
)
from autohet_cli.runtime.evaluation import eval_due, evaluate
from autohet_cli.runtime.fsdp_stage import attach_sharding, padded_microbatches, sharded_parameters
from autohet_cli.runtime.gradsync import GradSync
from autohet_cli.runtime.hooks import Hook, MetricsHook
from autohet_cli.runtime.lr_schedule import LRSchedule
from autohet_cli.runtime.metrics import (
    StepResult,
    flops_per_token,
    peak_flops,
    peak_memory_bytes,
)
from autohet_cli.runtime.model_api import ModelFn, layer_of, load_model_fn
from autohet_cli.runtime.optim import (
    LossScaler,
    build_optimizer,
    clip_grad_norm,
    counted_parameters,
    optimizer_for,
    set_lr,
)
from autohet_cli.runtime.pipeline import PipelineSchedule, autocast_contexts
from autohet_cli.runtime.stage import init_params, normalize_grads, trainable_parameters
from autohet_cli.runtime.stage_setup import build_model, compute_dtype, stage_p2p
from autohet_cli.runtime.timing import Clock, StepMarks, Timings
from autohet_cli.runtime.train_config import TrainConfig

__all__ = ["Hook", "MetricsHook", "StepResult", "TrainConfig", "Trainer"]


class Trainer:
    def __init__(
        self,
        plan: Plan,
        config: TrainConfig,
        *,
        model_fn: ModelFn | None = None,
        hooks: Sequence[Hook] = (),
        defer_init: bool = False,
    ) -> None:
        """``defer_init``: a checkpoint is about to be loaded (``--resume``), so the
        parameters of a meta build stay uninitialised: ``load_state_dict`` fills
        them, or ``init_weights`` (``fit`` calls it) as a fresh run would."""
        self.plan, self.config, self.hooks = plan, config, list(hooks)
        fn = model_fn or load_model_fn(config.model_fn)
        self.runtime: Runtime = init_runtime(plan, device=config.device)
        built = build_model(fn, self.runtime, plan, config, defer_init=defer_init)
        self.stage, self.parts = built.stage, built.parts
        self.compile_clock: CompileClock | None = built.compile_clock
        self._uninitialised = built.uninitialised  # parameters allocated, no values yet
        self.tied = [tuple(names) for names in self.parts.tied]
        self.runtime.build_sync_groups([(g[0], tuple(layer_of(n) for n in g)) for g in self.tied])
        # shard: weights (FSDP2): after the sync groups (its mesh is one group).
        self.fsdp = attach_sharding(
            self.stage,
            self.runtime,
            self.tied,
            self.init_weights,
            self._uninitialised,
            self._precision(),
        )
        kind = plan.training.optimizer
        self.grad_sync = GradSync(
            self.stage,
            self.runtime,
            self.tied,
            zero=plan.training.zero1,
            optimizer=kind if kind == "adam" or config.momentum else "plain-sgd",
            skip=self.fsdp.params if self.fsdp else frozenset(),
        )
        self.zero = self.grad_sync.zero
        hyper: dict[str, Any] = {
            "kind": kind,
            "lr": config.lr,
            "weight_decay": config.weight_decay,
            "betas": config.betas,
            "momentum": config.momentum,
        }
        sharded = self.zero.sharded if self.zero else frozenset()
        self.optimizer = build_optimizer(self.stage, skip=sharded, **hyper)
        # ZeRO-1: this rank's slices of the sharded buckets, stepped by their own
        # optimizer (not the model's parameters, so not in get_state_dict's view).
        self.zero_optimizer = (
            optimizer_for(self.zero.slices_with_decay(), **hyper) if self.zero else None
        )
        self.lr = config.lr  # the rate of the last step taken (ZeRO-1 checkpoints)
        # The hyperparameters a replicated optimizer files per parameter (decay group,
        # no-decay group), for ZeRO-1 checkpoints to carry the same entries.
        template = optimizer_for(
            [(torch.nn.Parameter(torch.zeros(1)), d) for d in (True, False)], **hyper
        )
        assert template is not None
        self.zero_groups = tuple(
            {k: v for k, v in g.items() if k != "params"} for g in template.param_groups
        )
        info = self.runtime.info
        self.counted = [
            p
            for p in counted_parameters(
                self.stage, pipeline=info.pipeline, tp_rank=info.tp_rank, tied=self.tied
            )
            if id(p) not in sharded and not (self.fsdp and id(p) in self.fsdp.params)
        ] + (self.zero.counted(info.tp_rank) if self.zero else [])
        self.counted += sharded_parameters(
            self.stage, self.fsdp, info.tp_rank
        )  # each holder's own shard
        self.scaler = LossScaler() if self._precision() == torch.float16 else None
        t = plan.training
        self.data: Batches = build_batches(
            DataRequest(
                seq_len=t.seq_len,
                seed=config.seed,
                vocab_size=self.parts.vocab_size,
                global_batch_size=t.global_batch_size,
                micro_batch_size=t.micro_batch_size,
                data=config.data,
                data_dtype=config.data_dtype,
                val_fraction=config.val_fraction,
            ),
            data_fn=config.data_fn,
        )
        if config.eval_every > 0 and not can_evaluate(self.data):
            raise ConfigError(
                "--eval-every needs validation samples, but the data has none (--val-fraction "
                "0, too little data, or a --data-fn without eval_microbatches); pass "
                "--eval-every 0 or hold some samples out"
            )
        self.schedule = PipelineSchedule(
            stage=self.stage,
            info=info,
            p2p=stage_p2p(self.runtime, self.parts, plan, self._precision()),
            loss_fn=self.parts.loss_fn,
            global_batch_size=t.global_batch_size,
            device=self.runtime.device,
            autocast=self._autocast,
            cast_once=self._cast_once,
            loss_context=loss_parallel
            if self.runtime.tp_mesh is not None
            else contextlib.nullcontext,
            pad_to=padded_microbatches(plan, info.pipeline),
        )
        run_state.check_describable(self.data)
        self.lr_schedule = config.schedule(0)
        self._flops_per_token = flops_per_token(plan)
        self._peak_flops = peak_flops(plan, self.runtime.device)
        self.step = 0  # the next step to run
        # The data's step is step + data_shift: nonzero after a resume under another global
        # batch, so that the samples continue where the checkpoint left them (ckpt.lineage).
        self.data_shift = 0
        self.last_step = 0  # the step fit() ends at
        # Set by a hook (a preemption notice): fit() ends after the current step's hooks.
        self.stop_reason: str | None = None
        # The schedule steps so far followed (a checkpoint's, an earlier fit's): fit()
        # continues it (run_state.fit_schedule); None: the first fit plans one.
        self.schedule_so_far: LRSchedule | None = None
        self.clock = Clock(self.runtime.device)
        self.nonfinite = NonFiniteGuard(config.max_nonfinite_steps)
        self.timings = Timings()
        self.trace_steps = set(config.trace_steps)

    # ----------------------------------------------------------------- set-up helpers

    def init_weights(self) -> None:
        """Initialise the parameters a meta build left empty, exactly as a fresh run
        does; nothing once they hold values (initialised or loaded)."""
        if self._uninitialised:
            init_params(self.stage, self.parts)
            self._uninitialised = False

    def _precision(self) -> torch.dtype:
        """fp32 on CPU whatever the plan says; the plan's precision on GPU."""
        return compute_dtype(self.runtime.device, self.plan.training.precision)

    def _cast_once(self) -> contextlib.AbstractContextManager[Any]:
        """Around a step: autocast's weight copies shared by its micro-batches
        (``PipelineSchedule.run``); see ``autocast_contexts``."""
        return self._autocasts()[1]

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self._autocasts()[0]

    def _autocasts(self) -> tuple[contextlib.AbstractContextManager[Any], ...]:
        """Without autocast's weight cache on a recomputing stage (``autocast_contexts``)
        and on a weight-sharded one, where the cache would keep a 16-bit copy of every
        gathered layer for the whole step, undoing the sharding."""
        uncached = self.stage.recompute or getattr(self, "fsdp", None) is not None
        return autocast_contexts(self.runtime.device.type, self._precision(), recompute=uncached)

    # ----------------------------------------------------------------- the loop

    def fit(self, num_steps: int) -> list[StepResult]:
        """Run steps ``self.step`` .. ``self.step + num_steps - 1``."""
        self.last_step = self.step + num_steps
        # The schedule is fixed by the first fit (its end: --steps) or by the checkpoint
        # resumed; later fits continue it, as a resumed run does (past its end:
        # --lr-extend).
        self.lr_schedule = self.schedule_so_far = run_state.fit_schedule(self)
        self.init_weights()  # a deferred build that loaded nothing (--resume found none)
        for hook in self.hooks:
            hook.on_train_start(self)
        results = []
        for _ in range(num_steps):
            for hook in self.hooks:
                hook.on_step_start(self, self.step)
            result = self.train_step()
            results.append(result)
            for hook in self.hooks:
                hook.on_step_end(self, result)
            if self.stop_reason is not None:
                break  # every rank agreed on it (runtime.preempt): the same step everywhere
            # Outside the step the health watchdog times: a long evaluation is no stall.
            if self.eval_due(result.step):
                loss = self.evaluate()
                for hook in self.hooks:
                    hook.on_eval(self, result.step, loss)
        for hook in self.hooks:
            hook.on_train_end(self)
        return results

    def _microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t, info = self.plan.training, self.runtime.info
        return list(
            self.data.microbatches(
                step + self.data_shift,
                batch_size=t.global_batch_size,
                sample_range=self.runtime.topology.sample_range(info.pipeline),
                micro_batch_size=t.micro_batch_size,
            )
        )

    def train_step(self) -> StepResult:
        self.init_weights()
        t = self.plan.training
        start = time.perf_counter()
        marks = StepMarks(self.clock, self.step, keep_ops=self.step in self.trace_steps)
        self.schedule.p2p.marks = marks
        # Every parameter of the stage (the ZeRO-1 sharded ones are no optimizer's),
        # then the slices ZeRO-1 steps.
        for _, p in trainable_parameters(self.stage):
            p.grad = None
        if self.zero_optimizer is not None:
            self.zero_optimizer.zero_grad(set_to_none=True)
        microbatches = self._microbatches(self.step)
        check_token_ids(microbatches, self.parts.vocab_size, step=self.step)
        if self.scaler is not None:
            self.schedule.loss_scale = self.scaler.scale
        loss_share = self.schedule.run(microbatches)
        self.schedule.p2p.marks = None
        sync_start = self.clock.mark()
        normalize_grads(self.stage)
        self.grad_sync.all_reduce()
        opt_start = self.clock.mark()
        marks.span("sync", sync_start, opt_start)
        skipped = False
        slices = self.zero.slice_params if self.zero else []
        if self.scaler is not None:
            params = [p for _, p in trainable_parameters(self.stage)] + slices
            skipped = self.scaler.unscale_and_check(params, self.runtime.device)
            self.nonfinite.check_scale(step=self.step, scale=self.scaler.scale)
        grad_norm = None
        lr = self.lr_schedule.at(self.step)
        if not skipped:
            grad_norm = clip_grad_norm(
                self.stage, self.counted, self.config.grad_clip, self.runtime.device, slices
            )
            # A non-finite norm (the global one: every rank agrees) would poison the
            # weights and every checkpoint after them: that step is skipped.
            skipped = NonFiniteGuard.bad(grad_norm)
        if not skipped:
            self.lr = lr
            for opt in (self.optimizer, self.zero_optimizer):
                if opt is not None:
                    set_lr(opt, lr)
                    opt.step()
            if self.zero is not None:
                self.zero.all_gather()
        marks.span("optimizer", opt_start, self.clock.mark())
        loss, peaks = self._world_report(loss_share)
        self.timings.add(marks.finish())
        self.nonfinite.after_step(step=self.step, loss=loss, grad_norm=grad_norm)
        elapsed = time.perf_counter() - start
        tokens = t.global_batch_size * t.seq_len
        mfu = None
        if self._flops_per_token and self._peak_flops and elapsed > 0:
            mfu = self._flops_per_token * tokens / elapsed / self._peak_flops
        epoch_of = getattr(self.data, "epoch_of", None)
        result = StepResult(
            step=self.step,
            loss=loss,
            tokens=tokens,
            time_s=elapsed,
            skipped=skipped,
            lr=lr,
            grad_norm=grad_norm,
            epoch=(
                epoch_of(self.step + 1 + self.data_shift, t.global_batch_size)
                if callable(epoch_of)
                else None
            ),
            peak_mem_bytes=peaks,
            mfu=mfu,
        )
        self.step += 1
        return result

    def _world_report(self, loss_share: torch.Tensor) -> tuple[float, tuple[int, ...]]:
        """One all-reduce: the pipelines' loss shares and every rank's peak memory.

        Each pipeline's last stage, TP rank 0, reports its share; every rank writes
        its peak into its own slot. float64 holds byte counts exactly up to 2**53.
        """
        info, world = self.runtime.info, dist.get_world_size()
        report = torch.zeros(1 + world, dtype=torch.float64, device=self.runtime.device)
        if info.is_last_stage and info.tp_rank == 0:
            report[0] = loss_share.detach().double()
        report[1 + self.runtime.global_rank] = peak_memory_bytes(self.runtime.device)
        dist.all_reduce(report)
        values = report.tolist()
        return float(values[0]), tuple(int(v) for v in values[1:])

    def eval_due(self, step: int) -> bool:
        """Whether a validation loss follows step ``step`` (``evaluation.eval_due``)."""
        return eval_due(self.config.eval_every, step, self.last_step)

    def evaluate(self) -> float:
        """Mean loss over ``eval_batches`` fixed validation batches (forward only, the
        stage in eval mode: a model's dropout off, and no random numbers drawn)."""
        return evaluate(
            self.stage,
            self.schedule,
            self.data,
            self.runtime,
            self.plan.training,
            num_batches=self.config.eval_batches,
            vocab_size=self.parts.vocab_size,
        )

    # ----------------------------------------------------------------- state (seams)

    def run_state(self) -> dict[str, Any]:
        """What a checkpoint records beside model and optimizer (``run_state``)."""
        return run_state.describe(self)

    def lineage(self, step: int) -> tuple[ModelRecord, DataOrder]:
        """What the manifest of step ``step``'s checkpoint records of the model and data."""
        return run_state.lineage(self, step)

    def check_same_model(self, saved: ModelRecord | None, where: str) -> None:
        """Refuse a checkpoint of another architecture (``run_state.check_same_model``)."""
        run_state.check_same_model(self, saved, where)

    def state_dict(self, *, flat_optimizer: bool = False, template: bool = False) -> dict[str, Any]:
        """This rank's training state (``runtime.train_state.state_dict``)."""
        return train_state.state_dict(self, flat_optimizer=flat_optimizer, template=template)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict``; ``fit`` then continues at ``state["step"]``."""
        train_state.load_state_dict(self, state)
        self._uninitialised = False

    def close(self) -> None:
        clock = getattr(self, "compile_clock", None)  # None: built without, or not built
        if clock is not None:
            clock.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
