"""The trainer's state as checkpoints hold it: model and optimizer keyed by full
parameter names (the seam every plan shares), the step, the loss scale and the
``run`` entry (``runtime.run_state``).

Below the trainer, which calls these with itself: they see it as
``trainer_api.TrainerState`` and never import ``runtime.trainer``."""

from __future__ import annotations

import json
from typing import Any

from autohet_cli.ckpt.state import nested_optimizer
from autohet_cli.runtime import run_state
from autohet_cli.runtime.trainer_api import TrainerState

# param_groups entries that pick torch's implementation, not the training's numbers
IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


def state_dict(
    trainer: TrainerState, *, flat_optimizer: bool = False, template: bool = False
) -> dict[str, Any]:
    """This rank's training state, model and optimizer keyed by full parameter names.

    ``torch.distributed.checkpoint.state_dict.get_state_dict`` maps the optimizer
    state from parameter ids to the same names; TP shards are DTensors. Saved with
    ``torch.distributed.checkpoint`` from every rank, it loads under any plan.
    ``flat_optimizer``: one entry per name and key (``state.<name>.exp_avg``,
    ``param_groups.<name>.lr``) instead of ``param_groups`` lists, which differ
    between plans; what checkpoints use (``ckpt.checkpointer``). ``run`` is
    ``run_state()`` as one JSON string (one checkpoint entry whatever it holds).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=flat_optimizer)
    optimizer: dict[str, Any]
    if trainer.optimizer is None:  # ZeRO-1 slices hold every parameter's state
        model, optimizer = get_model_state_dict(trainer.stage, options=options), {}
    else:
        model, optimizer = get_state_dict(trainer.stage, trainer.optimizer, options=options)
    if trainer.zero is not None:
        if not flat_optimizer:
            raise ValueError("a ZeRO-1 plan's optimizer state exists flat only")
        entries = (
            trainer.zero.load_template()
            if template
            else trainer.zero.state_entries(trainer.zero_optimizer, trainer.zero_groups, trainer.lr)
        )
        optimizer = {**optimizer, **entries}
    return {
        "model": model,
        "optimizer": optimizer,
        "step": trainer.step,
        "loss_scale": trainer.scaler.scale if trainer.scaler else None,
        "run": json.dumps(trainer.run_state(), sort_keys=True),
    }


def load_state_dict(trainer: TrainerState, state: dict[str, Any]) -> None:
    """Inverse of ``state_dict`` (either form); ``fit`` then continues at ``state["step"]``.

    Refuses a checkpoint whose data differ from this run's: the same step would
    then see other samples than the interrupted run; under another global batch the
    data continue at the checkpoint's next sample, or the resume is refused.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    saved = json.loads(state["run"]) if state.get("run") else None
    if saved is not None:
        run_state.check_same_data(saved.get("data") or {}, trainer.run_state()["data"])
        trainer.schedule_so_far = run_state.resumed_schedule(trainer, saved)
    flat = "state" not in state["optimizer"]
    optim = state["optimizer"]
    if trainer.zero is not None:
        assert flat
        trainer.zero.load_entries(trainer.zero_optimizer, optim)
        mine = trainer.zero.names()
        optim = {
            k: v for k, v in optim.items() if k.partition(".")[2].rpartition(".")[0] not in mine
        }
    if trainer.optimizer is None:
        set_model_state_dict(trainer.stage, state["model"])
    else:
        built = [
            {k: g[k] for k in IMPLEMENTATION if k in g} for g in trainer.optimizer.param_groups
        ]
        set_state_dict(
            trainer.stage,
            trainer.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=nested_optimizer(optim) if flat else optim,
        )
        # The saver's kernel choice is not this rank's: a TP stage's optimizer takes no
        # fused kernel (runtime.optim), whatever the checkpoint's param_groups say.
        for group, flags in zip(trainer.optimizer.param_groups, built, strict=True):
            group.update(flags)
    trainer.step = int(state["step"])
    if saved is not None:
        trainer.data_shift = run_state.resume_shift(trainer, saved, f"step {trainer.step}")
    if trainer.scaler is not None and state.get("loss_scale"):
        trainer.scaler.scale = float(state["loss_scale"])
