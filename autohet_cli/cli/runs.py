"""`autohet runs`: the runs launched from here, and one run's loss curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from autohet_cli.runfiles import describe, listing
from autohet_cli.runfiles.listing import RunsError

RunsDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--runs-dir",
        help="Where the runs are: the runs/ folder of the directory autohet launch ran "
        "from. [default: ./runs]",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
DEFAULT_RUNS_DIR = Path("runs")


def _runs_dir(ctx: typer.Context, given: Path | None) -> Path:
    """A subcommand's --runs-dir, else the group's (``autohet runs --runs-dir D show``)."""
    parent = ctx.parent.obj if ctx.parent is not None else None
    return given or (parent if isinstance(parent, Path) else DEFAULT_RUNS_DIR)


def runs_group(ctx: typer.Context, runs_dir: RunsDirOpt = None, as_json: JsonOpt = False) -> None:
    """List runs and plot their loss curves.

    With no command: the runs launched from this directory, newest first (as autohet
    runs list); autohet runs show RUN prints one run's summary and its loss curve."""
    ctx.obj = runs_dir
    if ctx.invoked_subcommand is None:
        _list(runs_dir or DEFAULT_RUNS_DIR, as_json)


def list_runs(ctx: typer.Context, runs_dir: RunsDirOpt = None, as_json: JsonOpt = False) -> None:
    """List runs, newest first: status, last step and loss, where the checkpoints are.

    Ids, paths and losses are printed whole (a narrow terminal wraps the lines).

    Example:

    \b
      autohet runs list --runs-dir ~/experiments/runs
    """
    _list(_runs_dir(ctx, runs_dir), as_json)


def _list(root: Path, as_json: bool) -> None:
    found = listing.find_runs(root)
    if as_json:
        typer.echo(json.dumps([r.to_json() for r in found], indent=1))
        return
    if not found:
        typer.echo(listing.no_runs_text(root))
        return
    typer.echo(describe.table(found, root))


def show_run(
    ctx: typer.Context,
    run: Annotated[
        str,
        typer.Argument(
            metavar="RUN", help="A run id, a unique prefix of one, a run folder, or latest."
        ),
    ],
    runs_dir: RunsDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a run: how it ended, where its files are, and its loss curve (also as a PNG).

    Example:

    \b
      autohet runs show latest
    """
    from autohet_cli.runfiles.plot import PNG_FILE, terminal_plot, write_png

    found = listing.load_run(listing.resolve(_runs_dir(ctx, runs_dir), run).folder, full=True)
    if found.series is None or not (found.series.train or found.series.eval):
        if not as_json:
            typer.echo("\n".join(describe.summary_lines(found)))
        raise RunsError(describe.no_metrics_text(found))
    if not as_json:  # what needs no writing first: a read-only folder still shows it
        typer.echo("\n".join(describe.summary_lines(found)))
        typer.echo(terminal_plot(found.series))
    png: str | None = None
    try:
        png = str(
            write_png(found.series, found.folder / PNG_FILE, title=f"{found.plan} {found.run_id}")
        )
    except RunsError as exc:
        if not as_json:
            typer.echo(f"plot: not written ({exc})")
    if as_json:
        typer.echo(json.dumps({**found.to_json(), **found.series.to_json(), "png": png}))
        return
    if png is not None:
        typer.echo(f"plot: {png}")


def register(app: typer.Typer) -> None:
    """Add the ``runs`` command group to ``app``."""
    group = typer.Typer(invoke_without_command=True, rich_markup_mode=None)
    group.callback()(runs_group)
    group.command("list")(list_runs)
    group.command("show")(show_run)
    app.add_typer(group, name="runs")
