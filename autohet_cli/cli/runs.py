"""`autohet runs`: the runs launched from here, and a run's or a job's loss curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from autohet_cli.runfiles import describe, jobs, listing, view
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
    runs list); autohet runs show RUN|JOB prints a run's summary and the loss curve of
    its job (the launch and every resume and recovery after it)."""
    ctx.obj = runs_dir
    if ctx.invoked_subcommand is None:
        _list(runs_dir or DEFAULT_RUNS_DIR, as_json)


def list_runs(ctx: typer.Context, runs_dir: RunsDirOpt = None, as_json: JsonOpt = False) -> None:
    """List runs, newest first: status, last step and loss, job, where the checkpoints are.

    The job column says which run of its job a run is ("J (2 of 2)": a resume or a
    recovery continued it); autohet runs show J plots the job's whole curve. Ids,
    paths and losses are printed whole (a narrow terminal wraps the lines).

    Example:

    \b
      autohet runs list --runs-dir ~/experiments/runs
    """
    _list(_runs_dir(ctx, runs_dir), as_json)


def _list(root: Path, as_json: bool) -> None:
    found = listing.find_runs(root)
    if as_json:
        linked = jobs.by_run(found)
        rows = [{**r.to_json(), **jobs.link_json(r, linked.get(r.name))} for r in found]
        typer.echo(json.dumps(rows, indent=1))
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
            metavar="RUN|JOB",
            help="A run id, a job id, a unique prefix of either, a run folder, or latest.",
        ),
    ],
    runs_dir: RunsDirOpt = None,
    run_only: Annotated[
        bool,
        typer.Option("--run-only", help="Plot this run's steps only, not its whole job's."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Show a run: how it ended, where its files are, and its job's loss curve (also
    as a PNG).

    A job is a launch and every --resume and recover that continued it, each in a
    run folder of its own (a recovery under a new plan version). When the run's job
    has several runs, the curve is the whole job's, with a ':' column where a run
    resumed; steps a resumed run did again show its values, and the summary says
    which logged steps they replaced. --json gives that series, each point with
    its run.

    Examples:

    \b
      autohet runs show latest
      autohet runs show 20261125T140305Z-3f2a   # a job id: its newest run
      autohet runs show latest --run-only --json
    """
    shown = view.load_view(_runs_dir(ctx, runs_dir), run, run_only=run_only)
    if not as_json:  # what needs no writing first: a read-only folder still shows it
        typer.echo("\n".join(shown.head()))
    if not shown.has_points:
        raise RunsError(describe.no_metrics_text(shown.run))
    if not as_json:
        typer.echo(shown.plot_text())
    png: str | None = None
    try:
        png = str(shown.write_png())
    except RunsError as exc:
        if not as_json:
            typer.echo(f"plot: not written ({exc})")
    if as_json:
        typer.echo(json.dumps(shown.to_json(png)))
    elif png is not None:
        typer.echo(f"plot: {png}")


def register(app: typer.Typer) -> None:
    """Add the ``runs`` command group to ``app``."""
    group = typer.Typer(invoke_without_command=True, rich_markup_mode=None)
    group.callback()(runs_group)
    group.command("list")(list_runs)
    group.command("show")(show_run)
    app.add_typer(group, name="runs")
