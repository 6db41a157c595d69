"""The worker's flags checked: values that parse but make no sense (``runtime.train_args``).

Split from ``runtime.train_args``, which declares and parses the flags: the
checks are the rules of a run (a finite learning rate, warmup before the decay
end, a known checkpoint interval), refused with ``parser.error`` as argparse
refuses a bad type, so the launcher's ``check_flags`` and the worker say the
same words. Like the parser, this module imports no torch.
"""

from __future__ import annotations

import argparse
import math

from autohet_cli.ckpt.policy import parse_every
from autohet_cli.ckpt.retention import parse_keep
from autohet_cli.limits import MAX_STEPS
from autohet_cli.peer.placement import MAX_REPLICAS, parse_budget


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Values that parse but make no sense, refused as argparse refuses a bad type;
    the text of ``--checkpoint-every``, ``--keep-checkpoints``, ``--replica-budget``
    and ``--resume STEP`` becomes the values the worker uses."""
    if args.steps is None:
        p.error("--steps is required (or steps: in --config)")
    if not 0 <= args.steps <= MAX_STEPS:
        p.error(f"--steps must be 0 to {MAX_STEPS:,}")
    for name in ("warmup_steps", "decay_steps", "eval_every"):
        if (value := getattr(args, name)) is not None and value < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.max_nonfinite_steps < 1:
        p.error("--max-nonfinite-steps must be >= 1")
    if args.eval_batches < 1:
        p.error("--eval-batches must be >= 1")
    if not 0 <= args.val_fraction < 1:
        p.error("--val-fraction must be in [0, 1)")
    _check_optimizer(p, args)
    _check_schedule(p, args)
    try:
        args.checkpoint_every = parse_every(args.checkpoint_every)
        args.keep_checkpoints = parse_keep(args.keep_checkpoints)
        args.replica_budget = parse_budget(args.replica_budget)
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
    if not 0 <= args.replicas <= MAX_REPLICAS:
        p.error(f"--replicas must be between 0 and {MAX_REPLICAS}, got {args.replicas}")


def _check_optimizer(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "grad_clip", "val_fraction"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            p.error(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    if args.lr <= 0:
        p.error(f"--lr must be > 0 (the peak learning rate), got {args.lr:g}")
    if args.min_lr is not None and not 0 <= args.min_lr <= args.lr:
        p.error(f"--min-lr must be between 0 and --lr ({args.lr:g}), got {args.min_lr:g}")
    if args.weight_decay < 0:
        p.error(f"--weight-decay must be >= 0, got {args.weight_decay:g}")
    for name in ("beta1", "beta2"):
        if not 0 <= (value := getattr(args, name)) < 1:
            p.error(f"--{name} must be in [0, 1), got {value:g}")
    if args.grad_clip < 0:
        p.error("--grad-clip must be >= 0 (0: no clipping)")


def _check_schedule(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Warmup must end before ``--decay-steps``, where the schedule decays. A run
    shorter than its warmup is allowed: a quick try of a run config
    (``--config examples/demo-run.yaml --steps 5``) is exactly that."""
    warmup, decay = args.warmup_steps, args.decay_steps
    if decay is not None and warmup > decay:
        p.error(
            f"--warmup-steps {warmup} ends after --decay-steps {decay}: the schedule would "
            "decay before it reached --lr"
        )
