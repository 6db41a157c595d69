"""Entry point: builds the typer app and turns domain errors into exit code 1."""

from __future__ import annotations

import atexit
import inspect
import json
import os
import re
import sys
import threading

import typer

from autohet_cli.errors import AutohetError

# Help is rendered by click's plain formatter (rich_markup_mode=None, here and in the
# profile and models groups): rich's option table cut option names and defaults with "…"
# and squeezed descriptions into 17 columns at 80 (any pipe); click refills paragraphs to
# the width and keeps blocks marked with \b (examples) verbatim, so they can be pasted.
app = typer.Typer(
    name="autohet",
    help=(
        "Plan, launch and heal large-model training on heterogeneous GPU fleets.\n\n"
        "Typical flow, with your cluster file (or localhost, this machine):\n\n"
        "\b\n"
        "  autohet profile run cluster.yaml --model OPT-350M\n"
        "  autohet plan --cluster cluster.yaml --model OPT-350M \\\n"
        "      --profile profiles/measured.yaml --global-batch-size 64 --explain\n"
        "  autohet estimate plans/NAME.v1.yaml\n"
        "  autohet launch plans/NAME.v1.yaml\n"
        "  autohet recover plans/NAME.v1.yaml\n"
        "  autohet runs show latest\n\n"
        "NAME is the plan name that plan prints (default: <cluster>-<model>). "
        "Each command's --help has an example."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


# Each command's module, by the name it registers: a command imports only its own
# module (``autohet plan`` need not import paramiko for launch, nor numpy for data: 0.5 s
# of every plan's start-up); the bare app and its --help import them all.
COMMANDS = {
    name: name
    for name in (
        "profile", "plan", "estimate", "launch", "recover", "runs", "export", "models",
        "data", "cluster",
    )
}  # fmt: skip


@app.callback()
def _root() -> None:
    # A group even when one command is registered (typer would run a lone command as
    # the app itself, taking its name for an argument).
    pass


def _register(argv: list[str] | None = None) -> None:
    import importlib

    args = sys.argv[1:] if argv is None else argv
    first = args[0] if args else None
    names = [COMMANDS[first]] if first in COMMANDS else list(COMMANDS.values())
    for name in names:
        importlib.import_module(f"autohet_cli.cli.{name}").register(app)
    whole_short_help(app)


def whole_short_help(group: typer.Typer) -> None:
    """Command lists show each command's first sentence whole; click would cut any
    sentence longer than the column with "..." (at 80 columns, most of ours)."""
    for info in group.registered_commands:
        if info.short_help is None and info.callback is not None:
            info.short_help = first_sentence(info.help or info.callback.__doc__ or "")
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            whole_short_help(sub.typer_instance)


def first_sentence(text: str) -> str:
    """The first sentence of a help text's first paragraph, on one line."""
    paragraph = " ".join(inspect.cleandoc(text).split("\n\n")[0].split())
    match = re.match(r"(.+?\.)(\s|$)", paragraph)
    return match.group(1) if match else paragraph


def main() -> None:
    _register()
    try:
        app()
    except AutohetError as exc:
        if _wants_json(sys.argv[1:]):
            # Scripts that asked for JSON get an object on stdout on failure too.
            error = {"ok": False, "error": str(exc), "error_type": type(exc).__name__}
            typer.echo(json.dumps(error))
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(1)


# Commands whose every output is written and closed before they return (atomic
# writes, echo): their console-script exit may skip the interpreter's teardown.
QUICK_EXIT_COMMANDS = frozenset({"plan"})


def console_main() -> None:
    """The ``autohet`` console script: ``main``, then for a command in
    ``QUICK_EXIT_COMMANDS`` with nothing else running (one thread), the exit hooks,
    a flush of stdout and stderr, and ``os._exit``. The interpreter's teardown (a
    final garbage collection of a planner's 10^4 memoised objects, then every
    module's) cost 0.1-0.15 s of a 3 s ``autohet plan`` on a small machine (issue
    32) and does nothing a finished command needs. ``main`` itself (tests call it
    in-process) never exits this way."""
    try:
        main()
        code: str | int | None = 0
    except SystemExit as exc:
        code = exc.code
    argv = sys.argv[1:]
    quick = bool(argv) and argv[0] in QUICK_EXIT_COMMANDS and threading.active_count() == 1
    if not quick or not (code is None or isinstance(code, int)):
        sys.exit(code)
    atexit._run_exitfuncs()  # first: what the hooks print is flushed below (review)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: what a normal exit would report
            sys.exit(code)
    os._exit(code or 0)


def _wants_json(argv: list[str]) -> bool:
    """``--json`` among the options (not after a ``--`` that starts a user script)."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in options
