"""The ``run`` entry of a checkpoint: learning-rate schedule and data position.

A resumed run must see the samples and the learning rate the interrupted one would
have: the model is checked to be the same architecture (``ckpt.lineage``), the
next sample follows ``samples_seen`` (another global batch continues there, or is
refused), the data are checked to be the same (their fingerprint, sequence length,
seed and validation split; not their path, which may differ between hosts), the
decay keeps the end the interrupted run had unless ``--decay-steps`` is given,
and a schedule changed by flags is said out loud.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from autohet_cli.ckpt.lineage import (
    DataOrder,
    ModelRecord,
    batch_change_refusal,
    data_sha256,
    data_shift,
    model_differences,
    model_record,
)
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
        "samples_seen": samples_seen(trainer),
        "global_batch_size": t.global_batch_size,
    }


def samples_seen(trainer: Trainer, step: int | None = None) -> int:
    """Samples before step ``step`` (the next one): the data's step is the trainer's
    plus the shift a resume under another global batch set (``ckpt.lineage``)."""
    step = trainer.step if step is None else step
    return (step + trainer.data_shift) * trainer.plan.training.global_batch_size


def lineage(trainer: Trainer, step: int) -> tuple[ModelRecord, DataOrder]:
    """What the manifest records of the model and the data (``ckpt.lineage``)."""
    from autohet_cli.models import get_model

    plan = trainer.plan
    order = DataOrder(
        global_batch_size=plan.training.global_batch_size,
        samples_seen=samples_seen(trainer, step),
        seed=trainer.config.seed,
        data_sha256=data_sha256(json.loads(json.dumps(describe_batches(trainer.data)))),
    )
    return model_record(plan.architecture or get_model(plan.model_name)), order


def check_same_model(trainer: Trainer, saved: ModelRecord | None, where: str) -> None:
    """Refuse weights trained as another architecture (same shapes or not): DCP would
    load them wherever names and shapes agree, and training would go on silently."""
    if saved is None:
        return  # an older checkpoint: its plan name was compared, nothing more is known
    mine, _ = lineage(trainer, trainer.step)
    differ = model_differences(saved, mine)
    if differ:
        raise ConfigError(
            f"{where} holds the weights of another model than this plan's "
            f"({trainer.plan.name}): " + "; ".join(differ) + ". Resume with the plan the job "
            "ran with; to start this model from those weights, export them (autohet export) "
            "and launch a new job with --init-from (weights only)"
        )


def resume_shift(trainer: Trainer, saved: dict[str, Any], where: str) -> int:
    """The data shift that continues the checkpoint's samples under this plan's batch."""
    batch = trainer.plan.training.global_batch_size
    seen = saved.get("samples_seen")
    saved_batch = saved.get("global_batch_size")
    if not isinstance(seen, int) or saved_batch is None:
        return 0  # written before checkpoints said; the step places the data, as it did
    shift = data_shift(samples_seen=seen, step=trainer.step, global_batch_size=batch)
    if shift is None:
        raise ConfigError(
            batch_change_refusal(
                where=where,
                samples_seen=seen,
                step=trainer.step,
                saved_batch=saved_batch,
                batch=batch,
            )
        )
    if shift and not getattr(trainer.data, "samples_indexed", False):
        raise ConfigError(
            f"{where}: the checkpoint's global batch was {saved_batch}, this plan's is {batch}, "
            "and this run's data are not placed by sample (synthetic data, or a --data-fn "
            "without samples_indexed = True; runtime/data_api.py), so the next step cannot "
            f"continue at sample {seen}. Resume with a plan of global_batch_size {saved_batch}, "
            "or start a new job"
        )
    if shift and trainer.runtime.global_rank == 0:
        say(
            f"note: the global batch changed from {saved_batch} to {batch}: step "
            f"{trainer.step} starts at sample {seen}, the next unseen one (the learning-rate "
            "schedule still counts steps)"
        )
    return shift


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
