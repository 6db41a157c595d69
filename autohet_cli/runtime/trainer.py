"""The step loop: schedule, gradient sync, optimizer step, metrics, hooks.

One iteration on every rank:

1. each pipeline runs 1F1B over its own micro-batches (``pipeline``), leaving on
   its ranks the gradients of its share of the mean loss over the global batch;
2. the segment groups sum those gradients across pipelines (``gradsync``);
3. fp16 only: gradients are unscaled and a step with an inf/nan anywhere is skipped;
4. the optimizer steps (AdamW or SGD, as the plan says);
5. the loss shares are summed over the world for rank 0's metrics.

Seams for what comes later (checkpointing, health): ``Trainer.step`` is the next
step to run and the data depend only on (seed, step), so ``load_state_dict`` of a
``state_dict()`` (model and optimizer keyed by full parameter names, ready for
torch.distributed.checkpoint) resumes exactly; ``Hook`` objects see the start and
end of training and of every step (a checkpoint hook saves every N steps, a
health hook beats a heart, or raises to stop the run).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from autohet_cli.plan import Plan
from autohet_cli.runtime.context import Runtime, init_runtime
from autohet_cli.runtime.data import SyntheticCorpus
from autohet_cli.runtime.gradsync import GradSync
from autohet_cli.runtime.model_api import DEFAULT_MODEL_FN, ModelFn, layer_of, load_model_fn
from autohet_cli.runtime.pipeline import P2P, PipelineSchedule
from autohet_cli.runtime.stage import (
    StageModule,
    build_stage,
    local_tensor,
    normalize_grads,
    trainable_parameters,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.9  # SGD
    device: str = "auto"  # auto | cpu | cuda
    model_fn: str = DEFAULT_MODEL_FN
    init_from: str | None = None  # HF model directory: initial weights (runtime.hf_weights)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    step: int
    loss: float  # mean over the global batch
    tokens: int
    time_s: float
    skipped: bool = False  # fp16 overflow: no optimizer step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "loss": self.loss,
            "tokens": self.tokens,
            "time_s": round(self.time_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "skipped": self.skipped,
        }


class Hook:
    """Override what you need; every rank calls every hook."""

    def on_train_start(self, trainer: Trainer) -> None:
        pass

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        pass

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        pass

    def on_train_end(self, trainer: Trainer) -> None:
        pass


class MetricsHook(Hook):
    """Rank 0 appends one JSON line per step to ``path`` and prints a short line."""

    def __init__(self, path: str | Path | None, *, echo: bool = True) -> None:
        self.path = Path(path) if path else None
        self.echo = echo

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if trainer.runtime.global_rank != 0:
            return
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(result.to_json()) + "\n")
        if self.echo:
            print(
                f"step {result.step} loss {result.loss:.6f} tokens/s {result.tokens_per_s:.0f}",
                flush=True,
            )


class LossScaler:
    """Dynamic loss scaling for fp16, agreed over the world so every rank skips together."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 1000) -> None:
        self.scale, self.growth_interval, self._good = scale, growth_interval, 0

    @torch.no_grad()
    def unscale_and_check(self, params: Sequence[torch.nn.Parameter], device: torch.device) -> bool:
        found = torch.zeros((), device=device)
        for p in params:
            if p.grad is not None:
                g = local_tensor(p.grad)
                g.mul_(1.0 / self.scale)
                found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        overflow = bool(found.item())
        self._good = 0 if overflow else self._good + 1
        if overflow:
            self.scale /= 2
        elif self._good % self.growth_interval == 0:
            self.scale *= 2
        return overflow


class Trainer:
    def __init__(
        self,
        plan: Plan,
        config: TrainConfig,
        *,
        model_fn: ModelFn | None = None,
        hooks: Sequence[Hook] = (),
    ) -> None:
        self.plan, self.config, self.hooks = plan, config, list(hooks)
        fn = model_fn or load_model_fn(config.model_fn)
        self.runtime: Runtime = init_runtime(plan, device=config.device)
        self.stage, self.parts = build_stage(fn, self.runtime, config.seed)
        if config.init_from:
            from autohet_cli.models import get_model
            from autohet_cli.runtime.hf_weights import load_hf_weights

            spec = plan.architecture or get_model(plan.model_name)
            load_hf_weights(self.stage, spec, config.init_from)
        tied = [tuple(names) for names in self.parts.tied]
        self.runtime.build_sync_groups([(g[0], tuple(layer_of(n) for n in g)) for g in tied])
        self.grad_sync = GradSync(self.stage, self.runtime, tied)
        self.optimizer = build_optimizer(self.stage, plan, config)
        self.scaler = LossScaler() if self._precision() == torch.float16 else None
        t = plan.training
        self.corpus = SyntheticCorpus(
            vocab_size=self.parts.vocab_size, seq_len=t.seq_len, seed=config.seed
        )
        self.schedule = PipelineSchedule(
            stage=self.stage,
            info=self.runtime.info,
            p2p=self._p2p(),
            loss_fn=self.parts.loss_fn,
            global_batch_size=t.global_batch_size,
            device=self.runtime.device,
            autocast=self._autocast,
            loss_context=loss_parallel
            if self.runtime.tp_mesh is not None
            else contextlib.nullcontext,
        )
        self.step = 0  # the next step to run

    # ----------------------------------------------------------------- set-up helpers

    def _p2p(self) -> P2P:
        info, t = self.runtime.info, self.plan.training
        shape: tuple[int, ...] = ()
        if info.num_stages > 1:
            if self.parts.activation_shape is None:
                raise ValueError(
                    "the model function gave no activation_shape, needed for plans with "
                    "more than one stage per pipeline"
                )
            shape = tuple(self.parts.activation_shape(t.micro_batch_size, t.seq_len))
        topo = self.runtime.topology
        return P2P(
            prev_rank=self.runtime.peer(topo.prev_rank(info.rank)),
            next_rank=self.runtime.peer(topo.next_rank(info.rank)),
            shape=shape,
            device=self.runtime.device,
        )

    def _precision(self) -> torch.dtype:
        """fp32 on CPU whatever the plan says; the plan's precision on GPU."""
        if self.runtime.device.type != "cuda":
            return torch.float32
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            self.plan.training.precision, torch.float32
        )

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self._precision()
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.runtime.device.type, dtype=dtype)

    # ----------------------------------------------------------------- the loop

    def fit(self, num_steps: int) -> list[StepResult]:
        """Run steps ``self.step`` .. ``self.step + num_steps - 1``."""
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
        for hook in self.hooks:
            hook.on_train_end(self)
        return results

    def train_step(self) -> StepResult:
        t, info = self.plan.training, self.runtime.info
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        microbatches = self.corpus.microbatches(
            self.step,
            batch_size=t.global_batch_size,
            sample_range=self.runtime.topology.sample_range(info.pipeline),
            micro_batch_size=t.micro_batch_size,
        )
        if self.scaler is not None:
            self.schedule.loss_scale = self.scaler.scale
        loss_share = self.schedule.run(microbatches)
        normalize_grads(self.stage)
        self.grad_sync.all_reduce()
        skipped = False
        if self.scaler is not None:
            params = [p for _, p in trainable_parameters(self.stage)]
            skipped = self.scaler.unscale_and_check(params, self.runtime.device)
        if not skipped:
            self.optimizer.step()
        # One loss per pipeline: its last stage's TP rank 0 reports it.
        reporter = info.is_last_stage and info.tp_rank == 0
        loss = (
            loss_share.detach().float() if reporter else torch.zeros((), device=self.runtime.device)
        )
        dist.all_reduce(loss)
        elapsed = time.perf_counter() - start
        result = StepResult(
            step=self.step,
            loss=float(loss.item()),
            tokens=t.global_batch_size * t.seq_len,
            time_s=elapsed,
            skipped=skipped,
        )
        self.step += 1
        return result

    # ----------------------------------------------------------------- state (seams)

    def state_dict(self, *, flat_optimizer: bool = False) -> dict[str, Any]:
        """This rank's training state, model and optimizer keyed by full parameter names.

        ``torch.distributed.checkpoint.state_dict.get_state_dict`` maps the optimizer
        state from parameter ids to the same names; TP shards are DTensors. Saved with
        ``torch.distributed.checkpoint`` from every rank, it loads under any plan.
        ``flat_optimizer``: one entry per name and key (``state.<name>.exp_avg``,
        ``param_groups.<name>.lr``) instead of ``param_groups`` lists, which differ
        between plans; what checkpoints use (``runtime.checkpoint``).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(flatten_optimizer_state_dict=flat_optimizer)
        model, optimizer = get_state_dict(self.stage, self.optimizer, options=options)
        return {
            "model": model,
            "optimizer": optimizer,
            "step": self.step,
            "loss_scale": self.scaler.scale if self.scaler else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict`` (either form); ``fit`` then continues at ``state["step"]``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        flat = "state" not in state["optimizer"]
        set_state_dict(
            self.stage,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(flatten_optimizer_state_dict=flat),
        )
        self.step = int(state["step"])
        if self.scaler is not None and state.get("loss_scale"):
            self.scaler.scale = float(state["loss_scale"])

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def build_optimizer(stage: StageModule, plan: Plan, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (plan optimizer ``adam``) or SGD; weight decay on matrices only (nanoGPT)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, p in trainable_parameters(stage):
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if plan.training.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)
