"""The ``run`` entry of a checkpoint: learning-rate schedule and data position.

A resumed run must see the samples and the learning rate the interrupted one would
have: the model is checked to be the same architecture (``ckpt.lineage``), the
next sample follows ``samples_seen`` (another global batch continues there, or is
refused), the data are checked to be the same (their fingerprint, sequence length,
seed and validation split; not their path, which may differ between hosts), the
decay keeps the end the interrupted run had unless ``--decay-steps`` is given or
``--steps`` goes past it (``--lr-extend``, said out loud), and a schedule changed
by flags is said out loud.

Below the trainer: these functions are handed it (``trainer_api.TrainerView``,
or an object with the same fields) and never import ``runtime.trainer``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

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
from autohet_cli.runtime.lr_schedule import LRSchedule, describe_extension, extended
from autohet_cli.runtime.trainer_api import TrainerView
from autohet_cli.workerbase.records import say


def describe(trainer: TrainerView) -> dict[str, Any]:
    t = trainer.plan.training
    return {
        "lr_schedule": trainer.lr_schedule.to_json(),
        "data": describe_batches(trainer.data),
        "samples_seen": samples_seen(trainer),
        "global_batch_size": t.global_batch_size,
    }


def samples_seen(trainer: TrainerView, step: int | None = None) -> int:
    """Samples before step ``step`` (the next one): the data's step is the trainer's
    plus the shift a resume under another global batch set (``ckpt.lineage``)."""
    step = trainer.step if step is None else step
    return (step + trainer.data_shift) * trainer.plan.training.global_batch_size


def _model(trainer: TrainerView) -> ModelRecord:
    from autohet_cli.models import get_model

    plan = trainer.plan
    return model_record(plan.architecture or get_model(plan.model_name))


def lineage(trainer: TrainerView, step: int) -> tuple[ModelRecord, DataOrder]:
    """What the manifest records of the model and the data (``ckpt.lineage``)."""
    plan = trainer.plan
    order = DataOrder(
        global_batch_size=plan.training.global_batch_size,
        samples_seen=samples_seen(trainer, step),
        seed=trainer.config.seed,
        data_sha256=data_sha256(json.loads(json.dumps(describe_batches(trainer.data)))),
    )
    return _model(trainer), order


def check_same_model(trainer: TrainerView, saved: ModelRecord | None, where: str) -> None:
    """Refuse weights trained as another architecture (same shapes or not): DCP would
    load them wherever names and shapes agree, and training would go on silently."""
    if saved is None:
        return  # an older checkpoint: its plan name was compared, nothing more is known
    mine = _model(trainer)
    differ = model_differences(saved, mine)
    if differ:
        from autohet_cli.hfconfig import CONTEXT_FIELDS, FREE_FIELDS

        fields = set(saved.fields) | set(mine.fields)
        changed = {k for k in fields if saved.fields.get(k) != mine.fields.get(k)}
        deliberate = changed <= {*CONTEXT_FIELDS, *FREE_FIELDS}
        raise ConfigError(
            f"{where} holds the weights of another model than this plan's "
            f"({trainer.plan.name}): " + "; ".join(differ) + ". Resume with the plan the job "
            "ran with"
            + (
                "; to start this model from those weights, export them (autohet export) "
                "and launch a new job with --init-from (weights only)"
                if deliberate
                else "; weights of these shapes mean another model under this plan, "
                "which no --init-from makes either"
            )
        )


def resume_shift(trainer: TrainerView, saved: dict[str, Any], where: str) -> int:
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


def resumed_schedule(trainer: TrainerView, saved: dict[str, Any]) -> LRSchedule | None:
    """The schedule the checkpoint's run was on, with this run's rates (a change of
    flags is said out loud): its decay end (``--decay-steps`` overrides it) and
    where an extension re-planned it. None from a checkpoint that kept no decay end:
    the run then plans to ``--steps``, as a fresh one."""
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
    end = int(old.get("decay_steps") or 0)
    if config.decay_steps is None and not end:
        return None
    restart_lr = old.get("restart_lr")
    return replace(
        config.schedule(end),  # --decay-steps, when given, wins
        restart_step=int(old.get("restart_step") or 0),
        restart_lr=None if restart_lr is None else float(restart_lr),
        rewarm=bool(old.get("rewarm", False)),
    )


def fit_schedule(trainer: TrainerView) -> LRSchedule:
    """The schedule of a fit to ``trainer.last_step``: a fresh run's ends its decay
    there (or at ``--decay-steps``); a run that continues one (resumed, or a later
    fit) keeps it, unless it trains past its decay end without ``--decay-steps``:
    then ``--lr-extend`` re-plans it (``runtime.lr_schedule``), and rank 0 says how,
    since the old end would train every new step at min_lr."""
    so_far, config = trainer.schedule_so_far, trainer.config
    if so_far is None:
        return config.schedule(trainer.last_step)
    if config.decay_steps is not None:
        return so_far
    how, step, end = config.lr_extend, trainer.step, trainer.last_step
    note = describe_extension(so_far, step=step, end=end, how=how)
    if note is not None and trainer.runtime.global_rank == 0:
        say(f"note: {note}")
    return extended(so_far, step=step, end=end, how=how)
