"""The worker's flags: ``python -m autohet_cli.runtime.train --help`` (``runtime.train``).

Parsing them (their checks: ``runtime.train_checks``), a ``--config`` file's
settings as their defaults, and the ``TrainConfig`` they make; split from
``runtime.train``, which runs them.

The launcher checks the built-in trainer's flags with this same parser before
anything starts (``check_flags``): a flag the worker would refuse is one line and
exit 1 in a second, in the words the worker would use, instead of argparse's usage
on every worker. So this module imports no torch (``runtime.worker_defaults``,
``ckpt.layout``).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from autohet_cli.ckpt.layout import CHECKPOINT_DIR_ENV, DEFAULT_JOB
from autohet_cli.ckpt.policy import AUTO, describe_every
from autohet_cli.ckpt.retention import DEFAULT_KEEP
from autohet_cli.errors import AutohetError, ConfigError
from autohet_cli.runtime.lr_schedule import DEFAULT_EXTEND, EXTEND_MODES
from autohet_cli.runtime.train_checks import check
from autohet_cli.runtime.worker_defaults import DEFAULT_MODEL_FN, HEARTBEAT_INTERVAL_S

if TYPE_CHECKING:
    from autohet_cli.runtime.train_config import TrainConfig

PROG = "python -m autohet_cli.runtime.train"


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
    p.add_argument(
        "--lr-extend",
        default=DEFAULT_EXTEND,
        choices=EXTEND_MODES,
        help="a resumed run whose --steps goes past its checkpoint's decay end (no "
        "--decay-steps given): redecay (default) decays from the rate at the resumed step "
        "to min-lr at --steps, no jump; rewarm warms up to --lr again over --warmup-steps, "
        "then decays to --steps; continue trains the new steps at min-lr. Rank 0 says "
        "which; a resume to the same end is exact whatever this says",
    )
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


class _Refusing(argparse.ArgumentParser):
    """The worker's parser as the launcher runs it: a refusal raises ``ConfigError``
    (argparse's own words, one line) instead of printing the usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)

    def print_help(self, file: object = None) -> None:
        pass  # --help: refused by exit() below, printing nothing

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise ConfigError(
            "--help: every worker would print its help and exit without training; "
            f"read it with `{PROG} --help`"
        )


def _config_defaults(
    p: argparse.ArgumentParser, argv: Sequence[str] | None, *, missing_ok: bool = False
) -> None:
    """Make a ``--config`` file's settings the parser's defaults (flags then override).
    ``missing_ok``: a file that is not here is the hosts' (the launcher's check)."""
    pre = type(p)(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", type=Path)
    known, _ = pre.parse_known_args(argv)
    if known.config is None or (missing_ok and not known.config.exists()):
        return
    from autohet_cli.runconfig import load_run_config

    try:
        settings = load_run_config(known.config)
    except AutohetError as exc:
        p.error(str(exc))
    p.set_defaults(**settings)


def parse_args(
    argv: Sequence[str] | None = None, *, description: str | None = None
) -> argparse.Namespace:
    """The worker's flags, checked; a refusal prints the usage and exits 2 (argparse)."""
    # No abbreviations: ``--init=x`` would reach the worker as --init-from while the
    # launcher's path resolution and checks, which read full names, never saw it.
    p = argparse.ArgumentParser(prog=PROG, description=description, allow_abbrev=False)
    return _parse(p, argv)


def check_flags(argv: Sequence[str], *, where: str = "worker flags") -> None:
    """Refuse (``ConfigError``, one line) the built-in trainer's flags ``argv`` (the
    launcher's, without ``--plan``) where the worker would refuse them. ``where``
    names their source in the message."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in LAUNCHER_OWNED:
            raise ConfigError(f"{where}: {flag} is the launcher's: {LAUNCHER_OWNED[flag]}")
    try:
        _parse(_Refusing(prog=PROG, allow_abbrev=False), ["--plan", "PLAN", *argv], missing_ok=True)
    except ConfigError as exc:
        if str(exc).startswith("--help:"):
            raise ConfigError(f"{where}: {exc}") from None
        raise ConfigError(f"{where}: {exc} (the worker's flags: `{PROG} --help`)") from None


# Flags the launcher sets itself and keeps reading afterwards (heartbeats under the
# run directory, the run record's checkpoint folders, recover's job): a worker given
# another value through --train-arg would silently part from what the launcher
# watches, so they are refused there, with where to set each instead.
LAUNCHER_OWNED = {
    "--plan": "the plan is autohet launch's PLAN_FILE argument",
    "--run-dir": "each run's folder is made by the launcher (name it with --run-id)",
    "--checkpoint-dir": "set checkpoint_dir per host in the cluster file",
    "--remote-storage": "set remote_storage in the cluster file",
    "--job": "pass --job to autohet launch (with --resume to continue one)",
}


def _parse(
    p: argparse.ArgumentParser, argv: Sequence[str] | None, *, missing_ok: bool = False
) -> argparse.Namespace:
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
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="torch.compile each transformer block (runtime/compiling.py); auto (default): "
        "on CUDA only",
    )
    p.add_argument(
        "--no-compile", dest="compile", action="store_const", const="off", help="--compile off"
    )
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
        + describe_every(None).replace("%", "%%")  # argparse %-formats help strings
        + "; 0: no periodic saves, the last step is still saved (so is a preemption "
        "notice's step; with --no-emergency-save nothing is saved at all)",
    )
    p.add_argument(
        "--no-emergency-save",
        dest="emergency_save",
        action="store_false",
        help="a preemption notice (SIGTERM, the host's check) stops training without "
        "saving; by default every rank saves the step they agree on, also with "
        "--checkpoint-every 0. With --checkpoint-every 0 this turns checkpoints off: "
        "not even the last step is saved",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="after each save, copy every host's shards to N partner hosts (another "
        "machine, another GPU type or spot pool where there is one), so a lost host's "
        "shards come from a peer instead of remote storage (default 1; 0: off)",
    )
    p.add_argument(
        "--replica-budget",
        default="auto",
        metavar="SIZE",
        help="the most bytes of other hosts' shards this host keeps per checkpoint step, "
        "e.g. 20GB (default auto: what the checkpoint disk has free, less 5%% and at "
        "least 1 GiB); a host's shards go to partners with room",
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
        default=HEARTBEAT_INTERVAL_S,
        metavar="S",
        help=f"seconds between background heartbeats (default {HEARTBEAT_INTERVAL_S:g})",
    )
    _config_defaults(p, argv, missing_ok=missing_ok)
    args, unknown = p.parse_known_args(argv)
    if unknown:
        p.error(_unrecognized(p, unknown))
    check(p, args)
    return args


def _unrecognized(p: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    """argparse's words, with the closest flag for the first unknown one."""
    said = f"unrecognized arguments: {' '.join(unknown)}"
    flags = [f for f in p._option_string_actions if f.startswith("--")]
    for word in unknown:
        if word.startswith("-"):
            near = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1)
            return said + (f" (did you mean {near[0]}?)" if near else "")
    return said


def train_config(args: argparse.Namespace) -> TrainConfig:
    from autohet_cli.runtime.train_config import TrainConfig  # torch: the worker's side

    return TrainConfig(
        seed=args.seed,
        lr=args.lr,
        min_lr=args.min_lr,
        warmup_steps=args.warmup_steps,
        decay_steps=args.decay_steps,
        lr_schedule=args.lr_schedule,
        lr_extend=args.lr_extend,
        weight_decay=args.weight_decay,
        betas=(args.beta1, args.beta2),
        grad_clip=args.grad_clip,
        device=args.device,
        compile=args.compile,
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
