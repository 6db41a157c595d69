"""Worker entry point: ``python -m autohet_cli.runtime.train --plan FILE --steps N``.

Start one worker per plan device under torchrun, in plan order (see
``autohet_cli.runtime.topology``)::

    torchrun --nproc-per-node 4 -m autohet_cli.runtime.train --plan plans/x.v1.yaml --steps 100

Without torchrun the worker runs alone, which a one-device plan allows: the
single-process reference every distributed plan must match.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from autohet_cli.errors import AutohetError
from autohet_cli.plan import load_plan
from autohet_cli.runtime.model_api import DEFAULT_MODEL_FN
from autohet_cli.runtime.trainer import Hook, MetricsHook, StepResult, TrainConfig, Trainer


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m autohet_cli.runtime.train", description=__doc__)
    p.add_argument("--plan", required=True, type=Path, help="plan file (autohet.plan/v1)")
    p.add_argument("--steps", required=True, type=int, help="optimizer steps to run")
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
        "--dump-state",
        type=Path,
        help="after the last step every rank writes its parameters, TP-gathered and keyed "
        "by full names, to DIR/rank<R>.pt (for tests and debugging)",
    )
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error("--steps must be >= 0")
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
    config = TrainConfig(seed=args.seed, lr=args.lr, device=args.device, model_fn=args.model_fn)
    metrics = args.metrics
    if metrics is None and args.run_dir is not None:
        args.run_dir.mkdir(parents=True, exist_ok=True)
        metrics = args.run_dir / "metrics.jsonl"
    hooks: list[Hook] = [MetricsHook(metrics)]
    if args.dump_state is not None:
        hooks.append(DumpStateHook(args.dump_state))
    trainer = Trainer(plan, config, hooks=hooks)
    try:
        return trainer.fit(args.steps)
    finally:
        trainer.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (AutohetError, ValueError) as exc:
        print(f"autohet runtime: error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
