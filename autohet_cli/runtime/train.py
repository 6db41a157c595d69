"""Worker entry point: ``python -m autohet_cli.runtime.train --plan FILE --steps N``.

Start one worker per plan device under torchrun, in plan order (see
``autohet_cli.runtime.topology``)::

    torchrun --nproc-per-node 4 -m autohet_cli.runtime.train --plan plans/x.v1.yaml --steps 100

Without torchrun the worker runs alone, which a one-device plan allows: the
single-process reference every distributed plan must match.

``--steps N`` is the step training ends at: a run resumed from step k
(``--resume``) runs steps k .. N-1. ``--checkpoint-every`` (``auto`` by default,
``runtime.checkpoint_hook``) saves on a schedule and at the end
(``ckpt.checkpointer``; docs/checkpoint-format.md); every rank beats a heartbeat
under ``RUN_DIR/heartbeat/`` and a lost peer ends the run within the collective
timeout (``runtime.health``). A worker marks its start under ``RUN_DIR/boot/`` and
records why it failed under ``RUN_DIR/errors/`` (``workerbase.records``), which is
how the launcher tells a crash from a lost host.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch

from autohet_cli.ckpt.checkpointer import (
    CHECKPOINT_DIR_ENV,
    Checkpointer,
    CheckpointError,
    RemoteCopy,
    checkpoint_root,
    remote_url,
)
from autohet_cli.ckpt.format import check_job
from autohet_cli.ckpt.jobdir import remove_if_unused
from autohet_cli.ckpt.policy import describe_every, saves_anything
from autohet_cli.errors import AutohetError, ConfigError
from autohet_cli.plan import load_plan
from autohet_cli.preemption import CHECK_ENV, check_from_env
from autohet_cli.runfiles.metricsfile import FOLDER_ENV, METRICS_FILE, STREAM_ENV, TENSORBOARD_DIR
from autohet_cli.runtime import train_args
from autohet_cli.runtime.checkpoint_hook import CheckpointHook
from autohet_cli.runtime.context import WorkerEnv, pick_device
from autohet_cli.runtime.health import (
    HealthMonitor,
    default_timeout_s,
    init_process_group,
)
from autohet_cli.runtime.preempt import PreemptionHook, notices
from autohet_cli.runtime.report import RunReportHook
from autohet_cli.runtime.stage import local_tensor
from autohet_cli.runtime.startup import StartupClock
from autohet_cli.runtime.train_args import train_config
from autohet_cli.runtime.trainer import Hook, MetricsHook, StepResult, Trainer
from autohet_cli.runtime.trainer_api import TrainerView
from autohet_cli.workerbase.exiting import skip_final_collection
from autohet_cli.workerbase.records import error_detail, first_line, say, write_boot, write_error

RUN_DIR_ENV = "AUTOHET_RUN_DIR"
NOTICE_BUDGET_ENV = "AUTOHET_NOTICE_BUDGET_S"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The worker's flags, checked (``runtime.train_args``); this docstring's module
    text is their ``--help`` description."""
    return train_args.parse_args(argv, description=__doc__)


class DumpStateHook(Hook):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: TrainerView) -> None:
        state = trainer.stage.full_state_dict()  # collective within the TP group
        self.directory.mkdir(parents=True, exist_ok=True)
        rank = trainer.runtime.global_rank
        target = self.directory / f"rank{rank}.pt"
        tmp = target.with_suffix(".tmp")
        torch.save({"step": trainer.step, "rank_info": _info(trainer), "params": state}, tmp)
        tmp.replace(target)


def _info(trainer: TrainerView) -> dict[str, int]:
    """Where the rank sits, and how many parameter elements it holds itself (its shards:
    fewer than its stage's under TP or ``shard: weights``)."""
    i = trainer.runtime.info
    held = sum(local_tensor(p).numel() for p in trainer.stage.parameters())
    return {
        "pipeline": i.pipeline,
        "stage": i.stage,
        "tp_rank": i.tp_rank,
        "rank": i.rank,
        "held_numel": held,
    }


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
    # The launcher's run folder on this machine: the metrics and TensorBoard go there
    # too (its TensorBoard alone: one set of events per run is enough).
    folder = Path(os.environ[FOLDER_ENV]) if os.environ.get(FOLDER_ENV) else None
    metrics_hook = MetricsHook(
        metrics,
        tensorboard_dir=folder / TENSORBOARD_DIR if folder else tb_dir,
        copy_to=folder / METRICS_FILE if folder else None,
        stream=os.environ.get(STREAM_ENV) == "1",
    )
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
        every, emergency = args.checkpoint_every, args.emergency_save
        if checkpointer is not None and saves_anything(every, emergency=emergency):
            if trainer.runtime.global_rank == 0:
                notice = (
                    ""  # said by describe_every
                    if every == 0
                    else "; a preemption notice saves its step"
                    if emergency
                    else "; a preemption notice saves nothing (--no-emergency-save)"
                )
                say(
                    f"checkpoints: {describe_every(every, emergency=emergency)}{notice}, in "
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


def _checkpointer(
    args: argparse.Namespace, trainer: Trainer, run_dir: Path | None
) -> Checkpointer | None:
    root = checkpoint_root(args.checkpoint_dir, run_dir)
    if not saves_anything(args.checkpoint_every, emergency=args.emergency_save) and (
        args.resume is None
    ):
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
        replicas=args.replicas,
        replica_budget_bytes=args.replica_budget,
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


def leave(code: int) -> NoReturn:
    """End a worker whose failure is recorded (stderr, ``errors/rankN.json``) without
    the interpreter's teardown: exit hooks, then a flush of stdout and stderr, then
    ``os._exit``. A save thread that failed beside the one the error names can still
    hold torch objects when the teardown destroys them, and then a C++ destructor
    aborts the process ("terminate called without an active exception", SIGABRT;
    seen once in a loaded suite run, tests/dist/test_guards.py, after every save had
    failed), where the launcher must read exit 1 and the recorded cause, not a
    signal. A worker that succeeded exits normally."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    skip_final_collection()  # a successful worker's exit: 1-2 s less (workerbase.exiting)
    code = main()
    notices().hold_through_exit()  # a late repeat of a shutdown's SIGTERM: not a failure
    if code != 0:
        leave(code)
    sys.exit(code)
