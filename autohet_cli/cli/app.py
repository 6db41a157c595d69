"""Entry point: builds the typer app and turns domain errors into exit code 1."""

from __future__ import annotations

import sys

import typer

from autohet_cli.errors import AutohetError

app = typer.Typer(
    name="autohet",
    help=(
        "Plan, launch and heal large-model training on heterogeneous GPU fleets.\n\n"
        "Typical flow: `autohet profile run cluster.yaml`, `autohet plan --cluster "
        "cluster.yaml --model OPT-350M --global-batch-size 64 --explain`, then "
        "`autohet estimate plans/NAME.v1.yaml` to judge any plan with the same cost model."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    from autohet_cli.cli import estimate, launch, models, plan, profile, recover

    for module in (profile, plan, estimate, launch, recover, models):
        module.register(app)


def main() -> None:
    _register()
    try:
        app()
    except AutohetError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(1)
