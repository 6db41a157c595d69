"""Training options shared by `launch` and `recover`: run config, data, worker flags.

Both commands declare them once, here: ``options`` puts them where the command has
its ``training`` parameter and hands the command what they resolve to
(:class:`Training`). The options of how to reach the hosts, alike in both, are here
too (``MasterPortOpt``, ``KnownHostsOpt``, ... and ``reach``).

Precedence, lowest first: built-in defaults, the ``--config`` file, the command's
own flags (``--steps``, ``--data``, ...), then ``--train-arg``s, which reach the
worker last and so win (argparse keeps the last value of a flag).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from autohet_cli.ckpt.policy import parse_every
from autohet_cli.ckpt.retention import DEFAULT_KEEP, parse_keep
from autohet_cli.errors import ConfigError
from autohet_cli.limits import MAX_STEPS, at_most
from autohet_cli.peer.placement import MAX_REPLICAS, parse_budget
from autohet_cli.runconfig import load_run_config, worker_args
from autohet_cli.runtime.train_args import check_flags
from autohet_cli.transport.pool import ConnectOptions

DEFAULT_STEPS = 100
DEFAULT_EVERY = "auto"

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        metavar="FILE",
        help="Run config (YAML or TOML): steps, data, lr, warmup_steps, lr_schedule, "
        "grad_clip, eval_every, ... (keys: autohet_cli/runconfig.py); flags override it.",
    ),
]
DataOpt = Annotated[
    str | None,
    typer.Option(
        "--data",
        metavar="PATH",
        help="Training tokens on every host: a directory from `autohet data prepare`, a "
        "flat uint16 token file (nanoGPT), an .npy, or a Megatron .bin/.idx prefix "
        "(relative: see Paths below). [default: synthetic tokens]",
    ),
]
KeepOpt = Annotated[
    int | None,
    typer.Option(
        "--keep-checkpoints",
        metavar="K",
        min=0,
        help="Keep the newest K complete checkpoints of the job on every host and in "
        "remote storage; older ones are deleted after each successful save (one save of a "
        "1.2B llama is 15 GB). The step a run resumed from and the step recover copies "
        f"stay until no longer read. 0: keep every step. [default: {DEFAULT_KEEP}]",
    ),
]
ReplicasOpt = Annotated[
    int | None,
    typer.Option(
        "--replicas",
        metavar="N",
        min=0,
        max=MAX_REPLICAS,
        help="After each save, copy every host's shards to N partner hosts (another "
        "machine; another GPU type or spot pool first), in the background: recover then "
        "takes a lost host's shards from its partner, not from remote storage. "
        "0: off. [default: 1]",
    ),
]
ReplicaBudgetOpt = Annotated[
    str | None,
    typer.Option(
        "--replica-budget",
        metavar="SIZE",
        help="Most bytes of other hosts' shards one host keeps per checkpoint step, "
        "e.g. 20GB. [default: auto: what the checkpoint disk has free, less 5%]",
    ),
]
NoEmergencyOpt = Annotated[
    bool,
    typer.Option(
        "--no-emergency-save",
        help="A preemption notice (SIGTERM, the host's check) stops without saving. "
        "By default every rank saves the step it is on, even with --checkpoint-every 0. "
        "With --checkpoint-every 0 it turns checkpoints off: not even the last step is "
        "saved.",
    ),
]
NoCompileOpt = Annotated[
    bool,
    typer.Option(
        "--no-compile",
        help="Run the model eagerly. By default each transformer block is compiled with "
        "torch.compile on CUDA GPUs (the first step then takes a minute or so longer; "
        "the startup line says how long); CPU devices run eagerly either way.",
    ),
]

# Not training options, but launch and recover declare them alike too.
MasterPortOpt = Annotated[
    int | None,
    typer.Option(help="Rendezvous port. [default: a free port on the master host]"),
]
AcceptNewHostKeysOpt = Annotated[
    bool, typer.Option("--accept-new-host-keys", help="Trust host keys seen first now.")
]
KnownHostsOpt = Annotated[Path | None, typer.Option(help="known_hosts file.")]


def reach(
    *,
    master_port: int | None,
    backend: str | None,
    known_hosts: Path | None,
    accept_new_host_keys: bool,
) -> dict[str, Any]:
    """The request fields, alike in launch and recover, of how to reach the hosts."""
    connect = ConnectOptions(known_hosts=known_hosts, accept_new_host_keys=accept_new_host_keys)
    return {"master_port": master_port, "backend": backend, "connect": connect}


class LrExtend(StrEnum):
    """``--lr-extend``'s choices (``runtime.lr_schedule``)."""

    redecay = "redecay"
    rewarm = "rewarm"
    continue_ = "continue"  # a keyword as a name


LrExtendOpt = Annotated[
    LrExtend | None,
    typer.Option(
        "--lr-extend",
        help="When a resumed run (launch --resume, recover) trains past its checkpoint's "
        "learning-rate decay (a finished run extended, or --steps beyond the first "
        "launch's): redecay decays from the current rate to min_lr at --steps, no jump; "
        "rewarm warms up to --lr again (--warmup-steps), then decays to --steps; continue "
        "trains the new steps at min_lr. Rank 0's log says which. A resume to the same end "
        "is exact whatever this says. [default: redecay]",
        show_default=False,
    ),
]
DataFnOpt = Annotated[
    str | None,
    typer.Option(
        "--data-fn",
        metavar="MODULE:FN",
        help="Your batches: package.module:function (contract: autohet_cli/runtime/data_api.py).",
    ),
]


def switches(
    train_arg: list[str] | None, *, no_emergency_save: bool, no_compile: bool
) -> list[str]:
    """The worker flags of the command's on/off options, after ``--train-arg``s."""
    out = list(train_arg or ())
    out += ["--no-emergency-save"] if no_emergency_save else []
    out += ["--no-compile"] if no_compile else []
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Training:
    """What the training options resolve to; launch and recover requests take these
    fields by the same names (``request_fields``)."""

    steps: int
    checkpoint_every: str
    train_args: tuple[str, ...]
    keep_checkpoints: int = DEFAULT_KEEP

    def request_fields(self) -> dict[str, Any]:
        return asdict(self)


def resolve(
    *,
    config: Path | None,
    steps: int | None,
    checkpoint_every: str | None,
    data: str | None,
    data_fn: str | None,
    train_arg: list[str] | None,
    keep_checkpoints: int | None = None,
    replicas: int | None = None,
    replica_budget: str | None = None,
    lr_extend: str | None = None,
) -> Training:
    settings = load_run_config(config) if config is not None else {}
    file_every = settings.pop("checkpoint_every", None)
    every = checkpoint_every or file_every or DEFAULT_EVERY
    file_steps = settings.pop("steps", None)
    file_keep = settings.pop("keep_checkpoints", None)
    keep = next((k for k in (keep_checkpoints, file_keep) if k is not None), DEFAULT_KEEP)
    try:
        parse_every(every)
        keep = parse_keep(keep)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if "replica_budget" in settings:
        try:
            parse_budget(str(settings["replica_budget"]))
        except ValueError as exc:
            raise ConfigError(f"{config}: replica_budget: {exc}") from None
    explicit = [f"--data={data}"] if data else []
    explicit += [f"--replicas={replicas}"] if replicas is not None else []
    if replica_budget is not None:
        try:
            parse_budget(replica_budget)
        except ValueError as exc:
            raise ConfigError(f"--replica-budget: {exc}") from None
        explicit += [f"--replica-budget={replica_budget}"]
    explicit += [f"--data-fn={data_fn}"] if data_fn else []
    explicit += [f"--lr-extend={lr_extend}"] if lr_extend else []
    if steps is None:
        steps = DEFAULT_STEPS if file_steps is None else int(file_steps)
    at_most(steps, MAX_STEPS, "--steps", "published runs take 10^5-10^6 steps")
    if config is not None:  # named here; with the other flags the launch checks them again
        check_flags([f"--steps={steps}", *worker_args(settings)], where=str(config))
    return Training(
        steps=steps,
        checkpoint_every=every,
        keep_checkpoints=keep,
        train_args=(*worker_args(settings), *explicit, *(train_arg or ())),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Differs:
    """What the training options say differently in each command."""

    steps_min: int
    checkpoint_every_help: str
    train_arg_help: str


_BY_COMMAND = {
    "launch": _Differs(
        steps_min=0,
        checkpoint_every_help="Save every K steps and after the last; auto: under 2% "
        "overhead, at least every 30 min; 0: no periodic saves, the last step is still "
        "saved (nothing at all with --no-emergency-save). [default: auto]",
        train_arg_help="Extra worker argument (repeatable), for example: --train-arg=--lr=3e-4",
    ),
    "recover": _Differs(
        steps_min=1,
        checkpoint_every_help="As for launch: K steps, auto, or 0 (the last step only). "
        "[default: auto]",
        train_arg_help="Extra worker argument (repeatable).",
    ),
}


def _declarations(differs: _Differs) -> list[inspect.Parameter]:
    """The training options in ``--help`` order."""
    steps = Annotated[
        int | None,
        typer.Option(
            help=f"Train until this step. [default: {DEFAULT_STEPS}]", min=differs.steps_min
        ),
    ]
    every = Annotated[
        str | None,
        typer.Option("--checkpoint-every", metavar="K|auto|0", help=differs.checkpoint_every_help),
    ]
    train_arg = Annotated[list[str] | None, typer.Option(help=differs.train_arg_help)]
    declared: list[tuple[str, Any, object]] = [
        ("steps", steps, None),
        ("config", ConfigOpt, None),
        ("data", DataOpt, None),
        ("data_fn", DataFnOpt, None),
        ("lr_extend", LrExtendOpt, None),
        ("checkpoint_every", every, None),
        ("no_emergency_save", NoEmergencyOpt, False),
        ("no_compile", NoCompileOpt, False),
        ("keep_checkpoints", KeepOpt, None),
        ("replicas", ReplicasOpt, None),
        ("replica_budget", ReplicaBudgetOpt, None),
        ("train_arg", train_arg, None),
    ]
    kind = inspect.Parameter.KEYWORD_ONLY
    return [inspect.Parameter(n, kind, annotation=a, default=d) for n, a, d in declared]


def options(command_name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Declare the training options of ``command_name`` (launch, recover) in place of the
    command's keyword-only ``training`` parameter; the command is called with them
    resolved (``resolve``) as ``training``."""
    declared = _declarations(_BY_COMMAND[command_name])
    names = [p.name for p in declared]

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        params = list(signature.parameters.values())
        at = [p.name for p in params].index("training")

        @functools.wraps(command)
        def run(**kwargs: Any) -> None:
            given = {name: kwargs.pop(name) for name in names}
            switched = switches(
                given.pop("train_arg"),
                no_emergency_save=given.pop("no_emergency_save"),
                no_compile=given.pop("no_compile"),
            )
            command(**kwargs, training=resolve(**given, train_arg=switched))

        run.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*params[:at], *declared, *params[at + 1 :]]
        )
        return run

    return decorate
