"""Worker entry point: ``python -m autohet_cli.runtime.train --plan FILE --steps N``.

Start one worker per plan device under torchrun, in plan order (see
``autohet_cli.runtime.topology``)::

    torchrun --nproc-per-node 4 -m autohet_cli.runtime.train --plan plans/x.v1.yaml --steps 100

Without torchrun the worker runs alone, which a one-device plan allows: the
single-process reference every distributed plan must match.

``--steps N`` is the step training ends at: a run resumed from step k
(``--resume``) runs steps k .. N-1. ``--checkpoint-every`` (``auto`` by default,
``runtime.ckpt_schedule``) saves on a schedule and at the end
(``runtime.checkpoint``; docs/checkpoint-format.md); every rank beats a heartbeat
under ``RUN_DIR/heartbeat/`` and a lost peer ends the run within the collective
timeout (``runtime.health``). A worker marks its start under ``RUN_DIR/boot/`` and
records why it failed under ``RUN_DIR/errors/`` (``runtime.records``), which is
how the launcher tells a crash from a lost host.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from autohet_cli.ckpt.policy import AUTO, describe_every, parse_every
from autohet_cli.errors import AutohetError
from autohet_cli.plan import load_plan
from autohet_cli.runtime.checkpoint import (
    CHECKPOINT_DIR_ENV,
    DEFAULT_JOB,
    Checkpointer,
    CheckpointError,
    CheckpointHook,
    RemoteCopy,
    checkpoint_root,
    remote_url,
)
from autohet_cli.runtime.context import WorkerEnv, pick_device
from autohet_cli.runtime.health import (
    DEFAULT_INTERVAL_S,
    HealthMonitor,
    default_timeout_s,
    init_process_group,
)
from autohet_cli.runtime.model_api import DEFAULT_MODEL_FN
from autohet_cli.runtime.records import error_detail, first_line, write_boot, write_error
from autohet_cli.runtime.trainer import Hook, MetricsHook, StepResult, TrainConfig, Trainer

RUN_DIR_ENV = "AUTOHET_RUN_DIR"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m autohet_cli.runtime.train", description=__doc__)
    p.add_argument("--plan", required=True, type=Path, help="plan file (autohet.plan/v1)")
    p.add_argument(
        "--steps",
        required=True,
        type=int,
        help="train up to this step (a resumed run continues from its checkpoint's step)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
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
        "--checkpoint-every",
        default=AUTO,
        metavar="K",
        help="save after every K-th step and at the end; 'auto' (default): "
        + describe_every(None)
        + "; 0: never",
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
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error("--steps must be >= 0")
    try:
        args.checkpoint_every = parse_every(args.checkpoint_every)
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


def run(args: argparse.Namespace) -> list[StepResult]:
    plan = load_plan(args.plan)
    config = TrainConfig(
        seed=args.seed,
        lr=args.lr,
        device=args.device,
        model_fn=args.model_fn,
        init_from=args.init_from,
    )
    run_dir = args.run_dir or (
        Path(os.environ[RUN_DIR_ENV]) if os.environ.get(RUN_DIR_ENV) else None
    )
    metrics = args.metrics
    if metrics is None and args.run_dir is not None:
        args.run_dir.mkdir(parents=True, exist_ok=True)
        metrics = args.run_dir / "metrics.jsonl"
    hooks: list[Hook] = [MetricsHook(metrics)]
    if args.dump_state is not None:
        hooks.append(DumpStateHook(args.dump_state))
    device = pick_device(args.device, WorkerEnv.from_environ())
    timeout_s = args.collective_timeout or default_timeout_s(device)
    init_process_group(device, timeout_s)
    trainer = Trainer(plan, config, hooks=hooks)
    health = HealthMonitor(
        trainer.runtime, run_dir=run_dir, interval_s=args.heartbeat_interval, timeout_s=timeout_s
    )
    health.start()
    try:
        checkpointer = _checkpointer(args, trainer, run_dir)
        if checkpointer is not None and args.resume is not None:
            checkpointer.resume(None if args.resume == "latest" else args.resume)
        # The watchdog's step ends before a save: saves have their own, longer timeout.
        trainer.hooks.append(health)
        if checkpointer is not None and args.checkpoint_every != 0:
            if trainer.runtime.global_rank == 0:
                _say(
                    f"checkpoints: {describe_every(args.checkpoint_every)}, in "
                    f"{checkpointer.plan_dir}"
                    + (f" (remote copy: {checkpointer.remote.url})" if checkpointer.remote else "")
                )
            trainer.hooks.append(CheckpointHook(checkpointer, args.checkpoint_every, say=_say))
        results = trainer.fit(max(0, args.steps - trainer.step))
    except BaseException as exc:
        health.fail(exc)  # a lost peer is reported here and the process ends
        raise
    else:
        health.stop()
    finally:
        trainer.close()
    return results


def _checkpointer(
    args: argparse.Namespace, trainer: Trainer, run_dir: Path | None
) -> Checkpointer | None:
    if args.checkpoint_every == 0 and args.resume is None:
        return None
    root = checkpoint_root(args.checkpoint_dir, run_dir)
    if root is None and args.checkpoint_every is None and args.resume is None:
        if trainer.runtime.global_rank == 0:
            _say("note: no checkpoint directory (--checkpoint-dir, --run-dir): not saving")
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
        remote=RemoteCopy(url, plan.name, args.job) if url else None,
    )


def _say(message: str) -> None:
    print(f"autohet runtime: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = args.run_dir or (
        Path(os.environ[RUN_DIR_ENV]) if os.environ.get(RUN_DIR_ENV) else None
    )
    write_boot(run_dir)
    try:
        run(args)
    except (AutohetError, ValueError) as exc:
        print(f"autohet runtime: error: {exc}", file=sys.stderr, flush=True)
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
