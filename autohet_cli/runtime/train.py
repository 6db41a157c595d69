"""Worker entry point: ``python -m autohet_cli.runtime.train --plan FILE --steps N``.

Start one worker per plan device under torchrun, in plan order (see
``autohet_cli.runtime.topology``)::

    torchrun --nproc-per-node 4 -m autohet_cli.runtime.train --plan plans/x.v1.yaml --steps 100

Without torchrun the worker runs alone, which a one-device plan allows: the
single-process reference every distributed plan must match.

``--steps N`` is the step training ends at: a run resumed from step k
(``--resume``) runs steps k .. N-1. ``--checkpoint-every`` (``auto`` by default,
``ckpt.schedule``) saves on a schedule and at the end
(``ckpt.checkpointer``; docs/checkpoint-format.md); every rank beats a heartbeat
under ``RUN_DIR/heartbeat/`` and a lost peer ends the run within the collective
timeout (``runtime.health``). A worker marks its start under ``RUN_DIR/boot/`` and
records why it failed under ``RUN_DIR/errors/`` (``runtime.records``), which is
how the launcher tells a crash from a lost host.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from autohet_cli.ckpt.checkpointer import (
    CHECKPOINT_DIR_ENV,
    DEFAULT_JOB,
    Checkpointer,
    CheckpointError,
    CheckpointHook,
    RemoteCopy,
    checkpoint_root,
    remote_url,
)
from autohet_cli.ckpt.format import check_job
from autohet_cli.ckpt.jobdir import remove_if_unused
from autohet_cli.ckpt.policy import AUTO, describe_every, parse_every
from autohet_cli.ckpt.retention import DEFAULT_KEEP, parse_keep
from autohet_cli.errors import AutohetError, ConfigError
from autohet_cli.limits import MAX_STEPS
from autohet_cli.plan import load_plan
from autohet_cli.preemption import CHECK_ENV, check_from_env
from autohet_cli.runtime.context import WorkerEnv, pick_device
from autohet_cli.runtime.health import (
    DEFAULT_INTERVAL_S,
    HealthMonitor,
    default_timeout_s,
    init_process_group,
)
from autohet_cli.runtime.metrics import TENSORBOARD_DIR
from autohet_cli.runtime.model_api import DEFAULT_MODEL_FN
from autohet_cli.runtime.preempt import PreemptionHook, notices
from autohet_cli.runtime.records import error_detail, first_line, say, write_boot, write_error
from autohet_cli.runtime.report import RunReportHook
from autohet_cli.runtime.startup import StartupClock
from autohet_cli.runtime.trainer import Hook, MetricsHook, StepResult, TrainConfig, Trainer

RUN_DIR_ENV = "AUTOHET_RUN_DIR"
NOTICE_BUDGET_ENV = "AUTOHET_NOTICE_BUDGET_S"


def _training_options(p: argparse.ArgumentParser) -> None:
    """Data, optimizer and schedule (the keys of a run config file, ``runconfig``)."""
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="run config file (YAML or TOML, autohet_cli/runconfig.py): its settings are "
        "the defaults, flags override them",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--min-lr", type=float, help="learning rate after decay (default lr/10)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warmup (default 0)")
    p.add_argument("--decay-steps", type=int, help="step decay ends at (default --steps)")
    p.add_argument("--lr-schedule", default="cosine", choices=["cosine", "linear", "constant"])
    p.add_argument("--weight-decay", type=float, default=0.1, help="on matrices (default 0.1)")
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="clip gradients to this global norm over every stage and shard (default 1.0; 0: off)",
    )
    p.add_argument(
        "--max-nonfinite-steps",
        type=int,
        default=3,
        metavar="N",
        help="stop with an error once N steps in a row had a non-finite loss or gradient "
        "norm (default 3); such steps are skipped, so the weights stay finite",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="training tokens: a directory from `autohet data prepare`, a flat uint16/uint32 "
        "token file (nanoGPT's train.bin), an .npy, or a Megatron .bin/.idx prefix; on "
        "every host (default: synthetic tokens)",
    )
    p.add_argument("--data-dtype", choices=["uint16", "uint32"], help="of a headerless file")
    p.add_argument(
        "--data-fn",
        metavar="MODULE:FN",
        help="package.module:function returning the batches (autohet_cli/runtime/data_api.py)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.005,
        help="share of the samples held out for validation (default 0.005)",
    )
    p.add_argument(
        "--eval-every", type=int, default=0, help="steps between validation losses (0: never)"
    )
    p.add_argument("--eval-batches", type=int, default=4, help="global batches per validation loss")


def _config_defaults(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> None:
    """Make a ``--config`` file's settings the parser's defaults (flags then override)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path)
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return
    from autohet_cli.runconfig import load_run_config

    try:
        settings = load_run_config(known.config)
    except AutohetError as exc:
        p.error(str(exc))
    p.set_defaults(**settings)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m autohet_cli.runtime.train", description=__doc__)
    p.add_argument("--plan", required=True, type=Path, help="plan file (autohet.plan/v1)")
    p.add_argument(
        "--steps",
        type=int,
        help="train up to this step (a resumed run continues from its checkpoint's step); "
        "required, here or in --config",
    )
    _training_options(p)
    p.add_argument(
        "--metrics",
        type=Path,
        help="rank 0 appends one JSON line per step here (default RUN_DIR/metrics.jsonl)",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        help="this run's directory on the host (the launcher passes it): metrics go there",
    )
    p.add_argument(
        "--model-fn",
        default=DEFAULT_MODEL_FN,
        help=f"package.module:function returning ModelParts (default {DEFAULT_MODEL_FN})",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--init-from",
        metavar="DIR",
        help="HuggingFace model directory (config.json + model.safetensors or its sharded "
        "index): initial weights; each rank reads only its layers' TP shards",
    )
    p.add_argument(
        "--dump-state",
        type=Path,
        help="after the last step every rank writes its parameters, TP-gathered and keyed "
        "by full names, to DIR/rank<R>.pt (for tests and debugging)",
    )
    p.add_argument(
        "--trace",
        nargs="?",
        const="",
        metavar="FILE",
        help="write a Chrome/Perfetto trace of 3 steps (after 2 warm-up steps) to FILE "
        "(default RUN_DIR/trace.json), in the form `autohet estimate --trace` writes",
    )
    p.add_argument(
        "--checkpoint-every",
        default=AUTO,
        metavar="K",
        help="save after every K-th step and at the end; 'auto' (default): "
        + describe_every(None)
        + "; 0: never",
    )
    p.add_argument(
        "--no-emergency-save",
        dest="emergency_save",
        action="store_false",
        help="a preemption notice (SIGTERM, the host's check) stops training without "
        "saving; by default every rank saves the step they agree on, also with "
        "--checkpoint-every 0",
    )
    p.add_argument(
        "--sync-checkpoints",
        action="store_true",
        help="write each checkpoint while training waits, instead of snapshotting the "
        "state into host memory and writing it in the background (the default; a rank "
        "short of host memory writes synchronously by itself and says so)",
    )
    p.add_argument(
        "--keep-checkpoints",
        default=DEFAULT_KEEP,
        metavar="K",
        help=f"keep the newest K complete steps of the job on every host and in the remote "
        f"copy, older ones are removed after each save (default {DEFAULT_KEEP}); 0: keep "
        "every step. The step a run resumed from stays until it saved K newer ones",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        metavar="DIR",
        help=f"this host's checkpoint directory (default ${CHECKPOINT_DIR_ENV}, else "
        "RUN_DIR/../../checkpoints)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="STEP",
        help="load the newest complete checkpoint (or the one of STEP) before training",
    )
    p.add_argument(
        "--remote-storage",
        metavar="URL",
        help="fsspec URL checkpoints are copied to in the background (default "
        "$AUTOHET_REMOTE_STORAGE, else none)",
    )
    p.add_argument(
        "--job",
        default=DEFAULT_JOB,
        metavar="ID",
        help="the run namespace under CHECKPOINT_DIR/<plan name>/ (default "
        f"{DEFAULT_JOB!r}; autohet launch starts a new one per fresh run)",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        metavar="S",
        help="seconds before a collective (and a step) counts as stuck (default 60 on CPU, "
        "300 on GPU)",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help=f"seconds between background heartbeats (default {DEFAULT_INTERVAL_S:g})",
    )
    _config_defaults(p, argv)
    args = p.parse_args(argv)
    if args.steps is None:
        p.error("--steps is required (or steps: in --config)")
    if not 0 <= args.steps <= MAX_STEPS:
        p.error(f"--steps must be 0 to {MAX_STEPS:,}")
    for name in ("warmup_steps", "eval_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.max_nonfinite_steps < 1:
        p.error("--max-nonfinite-steps must be >= 1")
    if args.eval_batches < 1:
        p.error("--eval-batches must be >= 1")
    if not 0 <= args.val_fraction < 1:
        p.error("--val-fraction must be in [0, 1)")
    for name in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "grad_clip", "val_fraction"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            p.error(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    if args.lr <= 0 or (args.min_lr is not None and not 0 <= args.min_lr <= args.lr):
        p.error("learning rates need --lr > 0 and 0 <= --min-lr <= --lr")
    if args.grad_clip < 0:
        p.error("--grad-clip must be >= 0 (0: no clipping)")
    try:
        args.checkpoint_every = parse_every(args.checkpoint_every)
        args.keep_checkpoints = parse_keep(args.keep_checkpoints)
    except ValueError as exc:
        p.error(str(exc))
    if args.resume not in (None, "latest"):
        if not args.resume.isdigit():
            p.error(f"--resume {args.resume!r}: expected a step number (or no value: the newest)")
        args.resume = int(args.resume)
    if args.collective_timeout is not None and args.collective_timeout <= 0:
        p.error("--collective-timeout must be > 0")
    if args.heartbeat_interval <= 0:
        p.error("--heartbeat-interval must be > 0")
    return args


class DumpStateHook(Hook):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: Trainer) -> None:
        state = trainer.stage.full_state_dict()  # collective within the TP group
        self.directory.mkdir(parents=True, exist_ok=True)
        rank = trainer.runtime.global_rank
        target = self.directory / f"rank{rank}.pt"
        tmp = target.with_suffix(".tmp")
        torch.save({"step": trainer.step, "rank_info": _info(trainer), "params": state}, tmp)
        tmp.replace(target)


def _info(trainer: Trainer) -> dict[str, int]:
    i = trainer.runtime.info
    return {"pipeline": i.pipeline, "stage": i.stage, "tp_rank": i.tp_rank, "rank": i.rank}


def _run_dir(args: argparse.Namespace) -> Path | None:
    """``--run-dir``, else ``$AUTOHET_RUN_DIR`` (set by the launcher), else none."""
    return args.run_dir or (Path(os.environ[RUN_DIR_ENV]) if os.environ.get(RUN_DIR_ENV) else None)


def run(args: argparse.Namespace) -> list[StepResult]:
    plan = load_plan(args.plan)
    config = train_config(args)
    run_dir = _run_dir(args)
    metrics = args.metrics
    if metrics is None and args.run_dir is not None:
        args.run_dir.mkdir(parents=True, exist_ok=True)
        metrics = args.run_dir / "metrics.jsonl"
    tb_dir = (metrics.parent / TENSORBOARD_DIR) if metrics is not None else None
    metrics_hook = MetricsHook(metrics, tensorboard_dir=tb_dir)
    hooks: list[Hook] = [metrics_hook]
    trace = None
    if args.trace is not None:
        trace = Path(args.trace) if args.trace else (run_dir or Path(".")) / "trace.json"
    hooks.append(RunReportHook(run_dir, trace_path=trace))
    if args.dump_state is not None:
        hooks.append(DumpStateHook(args.dump_state))
    clock = StartupClock(say)
    clock.mark("imports")
    device = pick_device(args.device, WorkerEnv.from_environ())
    timeout_s = args.collective_timeout or default_timeout_s(device)
    init_process_group(device, timeout_s)
    clock.mark("process_group")
    # Resuming: the weights come from the checkpoint, else fit() initialises them.
    trainer = Trainer(plan, config, hooks=[clock, *hooks], defer_init=args.resume is not None)
    clock.mark("build")
    health = HealthMonitor(
        trainer.runtime, run_dir=run_dir, interval_s=args.heartbeat_interval, timeout_s=timeout_s
    )
    health.start()
    saver: CheckpointHook | None = None
    checkpointer: Checkpointer | None = None
    try:
        checkpointer = _checkpointer(args, trainer, run_dir)
        if checkpointer is not None and trainer.runtime.global_rank == 0:
            checkpointer.listeners.append(lambda record: say(record.describe()))
            checkpointer.listeners.append(
                lambda record: metrics_hook.write_checkpoint(record.to_json())
            )
        if checkpointer is not None and args.resume is not None:
            checkpointer.resume(None if args.resume == "latest" else args.resume)
        # The watchdog's step ends before a save: saves have their own, longer timeout.
        trainer.hooks.append(health)
        if checkpointer is not None and (args.checkpoint_every != 0 or args.emergency_save):
            if trainer.runtime.global_rank == 0:
                when = describe_every(args.checkpoint_every)
                if args.checkpoint_every == 0:
                    when = "no periodic saves (--checkpoint-every 0)"
                notice = (
                    "; a preemption notice saves its step"
                    if args.emergency_save
                    else "; a preemption notice saves nothing (--no-emergency-save)"
                )
                say(
                    f"checkpoints: {when}{notice}, in "
                    f"{checkpointer.plan_dir}"
                    + (f" (remote copy: {checkpointer.remote.url})" if checkpointer.remote else "")
                )
            saver = CheckpointHook(
                checkpointer,
                args.checkpoint_every,
                say=say,
                emergency=args.emergency_save,
                notice_budget_s=_notice_budget_s(),
            )
            trainer.hooks.append(saver)
        # After the checkpoint hook: its final save is the emergency checkpoint.
        trainer.hooks.append(_preemption_hook(trainer, saver))
        results = trainer.fit(max(0, args.steps - trainer.step))
    except BaseException as exc:
        if checkpointer is not None:  # a run that failed before saving leaves no job
            with contextlib.suppress(Exception):
                checkpointer.forget_if_unused()
        health.fail(exc)  # a lost peer is reported here and the process ends
        raise
    else:
        health.stop()
    finally:
        trainer.close()
    return results


def _preemption_hook(trainer: Trainer, saver: CheckpointHook | None) -> PreemptionHook:
    """SIGTERM and the host's preemption check (``runtime.preempt``); the check is
    polled by the host's first worker only."""
    check = check_from_env(os.environ.get(CHECK_ENV))
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if check is not None and local_rank == 0 and trainer.runtime.global_rank == 0:
        say(f"preemption check: {check.describe()} every {check.interval_s:g} s")
    return PreemptionHook(
        host=trainer.runtime.info.device.host,
        rank=trainer.runtime.global_rank,
        check=check,
        poll=local_rank == 0,
        say=say,
        saved_steps=(lambda: saver.saved_steps) if saver is not None else None,
    )


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        seed=args.seed,
        lr=args.lr,
        min_lr=args.min_lr,
        warmup_steps=args.warmup_steps,
        decay_steps=args.decay_steps,
        lr_schedule=args.lr_schedule,
        weight_decay=args.weight_decay,
        betas=(args.beta1, args.beta2),
        grad_clip=args.grad_clip,
        device=args.device,
        model_fn=args.model_fn,
        init_from=args.init_from,
        data=args.data,
        data_dtype=args.data_dtype,
        data_fn=args.data_fn,
        val_fraction=args.val_fraction,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        max_nonfinite_steps=args.max_nonfinite_steps,
    )


def _checkpointer(
    args: argparse.Namespace, trainer: Trainer, run_dir: Path | None
) -> Checkpointer | None:
    root = checkpoint_root(args.checkpoint_dir, run_dir)
    if args.checkpoint_every == 0 and args.resume is None and not args.emergency_save:
        # Nothing will be saved: the job directory the launcher made (the key alone)
        # goes now rather than pile up (every rank of a host may try; harmless).
        if root is not None:
            with contextlib.suppress(ConfigError, OSError):
                remove_if_unused(root / trainer.plan.name / check_job(args.job))
        return None
    optional = args.checkpoint_every is None or args.checkpoint_every == 0
    if root is None and optional and args.resume is None:
        if trainer.runtime.global_rank == 0:
            say("note: no checkpoint directory (--checkpoint-dir, --run-dir): not saving")
        return None
    if root is None:
        raise CheckpointError(
            f"no checkpoint directory: pass --checkpoint-dir, set ${CHECKPOINT_DIR_ENV} or "
            "--run-dir"
        )
    url = remote_url(args.remote_storage)
    plan = trainer.plan
    return Checkpointer(
        trainer,
        root=root,
        plan_ref=f"{plan.name}.v{plan.version}",
        plan_sha256=hashlib.sha256(args.plan.read_bytes()).hexdigest(),
        job=args.job,
        keep=args.keep_checkpoints,
        remote=RemoteCopy(url, plan.name, args.job) if url else None,
        background=not args.sync_checkpoints,
    )


def _notice_budget_s() -> float | None:
    """``$AUTOHET_NOTICE_BUDGET_S``: the shortest notice a spot host of the plan gets
    (set by the launcher); a save longer than it is warned about."""
    raw = os.environ.get(NOTICE_BUDGET_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def main(argv: Sequence[str] | None = None) -> int:
    # First: a shutdown's SIGTERM during start-up or loading is a notice, not a death.
    notices().install()
    args = parse_args(argv)
    run_dir = _run_dir(args)
    write_boot(run_dir)
    try:
        run(args)
    except (AutohetError, ValueError) as exc:
        say(f"error: {exc}")
        write_error(run_dir, kind="error", message=str(exc))
        return 1
    except Exception as exc:  # user code (--model-fn) or a bug: record, then the traceback
        write_error(
            run_dir,
            kind="error",
            message=f"{type(exc).__name__}: {first_line(str(exc))}",
            detail=error_detail(exc),
        )
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
