"""The ``run`` entry of a checkpoint: learning-rate schedule and data position.

A resumed run must see the samples and the learning rate the interrupted one would
have: the data are checked to be the same (their fingerprint, sequence length,
seed and validation split; not their path, which may differ between hosts), the
decay keeps the end the interrupted run had unless ``--decay-steps`` is given,
and a schedule changed by flags is said out loud.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from autohet_cli.errors import ConfigError
from autohet_cli.runtime.data_api import Batches, describe_batches
from autohet_cli.runtime.records import say

if TYPE_CHECKING:
    from autohet_cli.runtime.trainer import Trainer


def describe(trainer: Trainer) -> dict[str, Any]:
    t = trainer.plan.training
    return {
        "lr_schedule": trainer.lr_schedule.to_json(),
        "data": describe_batches(trainer.data),
        "samples_seen": trainer.step * t.global_batch_size,
    }


def check_describable(batches: Batches) -> None:
    """Fail at start, not at the first checkpoint hours later, on a --data-fn whose
    describe() is not JSON."""
    try:
        json.dumps(describe_batches(batches))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"the data's describe() must return JSON-serialisable values: {exc}"
        ) from None


def check_same_data(saved: dict[str, Any], mine: dict[str, Any]) -> None:
    mine = json.loads(json.dumps(mine))
    keys = sorted((set(saved) & set(mine)) - {"path"})
    differ = [k for k in keys if saved[k] != mine[k]]
    if set(saved) - {"path"} != set(mine) - {"path"} or differ:
        what = ", ".join(f"{k}: {saved.get(k)!r} then, {mine.get(k)!r} now" for k in differ)
        raise ConfigError(
            "the checkpoint was trained on other data than this run's ("
            + (what or f"{saved.get('kind')!r} then, {mine.get('kind')!r} now")
            + "); resume with the same --data, --data-fn, --seed and sequence length, "
            "or start a new job"
        )


def resumed_decay_end(trainer: Trainer, saved: dict[str, Any]) -> int | None:
    """Where the decay ends after resuming; says so when flags changed the schedule."""
    old = saved.get("lr_schedule") or {}
    config = trainer.config
    now = config.schedule(int(old.get("decay_steps") or 0)).to_json()
    changed = [k for k in ("lr", "min_lr", "warmup_steps", "style") if old.get(k) != now.get(k)]
    if changed and trainer.runtime.global_rank == 0:
        say(
            "note: the learning-rate schedule differs from the checkpoint's ("
            + ", ".join(f"{k} {old.get(k)} then, {now.get(k)} now" for k in changed)
            + "): pass the run's --lr/--min-lr/--warmup-steps/--lr-schedule (or its --config) "
            "to continue it exactly"
        )
    if config.decay_steps is not None:
        return trainer.decay_end
    return int(old.get("decay_steps") or 0) or None
