"""`autohet launch`: parse options, hand them to ``launch.session``, print the outcome."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from autohet_cli.cli import trainopts
from autohet_cli.launch import runfolder, session
from autohet_cli.launch.executor import JobOutcome
from autohet_cli.launch.jobs import NothingToTrain
from autohet_cli.launch.pathargs import HELP as PATHS_HELP

EPILOG = (
    "Examples:\n\n"
    "  autohet launch plans/lab.v1.yaml --steps 200\n\n"
    "  autohet launch plans/lab.v1.yaml --config run.yaml --data /data/tokens\n\n"
    "  autohet launch plans/lab.v1.yaml --dry-run\n\n"
    "  autohet launch plans/lab.v1.yaml --resume --steps 400\n\n"
    "  autohet launch plans/llama.v1.yaml --init-from /data/Meta-Llama-3-8B\n\n"
    "  autohet launch plans/lab.v1.yaml --sync-dir . -- my_train.py --epochs 3\n\n"
    "  autohet launch plans/lab.v1.yaml --backend slurm --dry-run\n\n"
    "A lost host (unreachable, dropped connection, frozen workers) stops the others "
    "and prints the `autohet recover` command (--auto-recover runs it). Workers that "
    "fail on their own (a crash, a bad config) are reported with their root cause and "
    "the log path; recovering would not help them. Every fresh launch checkpoints into "
    "a new job (namespace) beside earlier ones, which are never deleted; within a job "
    "the newest complete checkpoints are kept (--keep-checkpoints, 3 by default).\n\n" + PATHS_HELP
)


@trainopts.options("launch")
def launch(
    plan_file: Annotated[
        Path, typer.Argument(metavar="PLAN_FILE", help="Plan to run (plans/NAME.vN.yaml).")
    ],
    script: Annotated[
        list[str] | None,
        typer.Argument(help="After --: your script and its arguments (default: built-in)."),
    ] = None,
    cluster: Annotated[
        str | None, typer.Option(help="Cluster file or 'localhost'. [default: the plan's]")
    ] = None,
    *,
    training: trainopts.Training,
    init_from: Annotated[
        str | None,
        typer.Option(
            "--init-from",
            metavar="HF_DIR",
            help="Start from HuggingFace weights: a model directory (config.json and "
            "safetensors) on every host (relative: see Paths below); each rank reads only "
            "its shard.",
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="Continue the newest job (or --job) from its newest checkpoint."
        ),
    ] = False,
    job: Annotated[
        str | None,
        typer.Option(help="Checkpoint namespace to use. [default: a new one; --resume: newest]"),
    ] = None,
    master_port: trainopts.MasterPortOpt = None,
    run_id: Annotated[
        str | None, typer.Option(help="Run directory name, used once. [default: UTC time]")
    ] = None,
    sync_dir: Annotated[
        Path | None,
        typer.Option(
            help="Copy this directory of this machine into each host's workdir first "
            "(changes only)."
        ),
    ] = None,
    start_timeout: Annotated[
        float,
        typer.Option(help="Seconds for every host's interpreter and workers to start.", min=1),
    ] = 300.0,
    backend: Annotated[
        str | None,
        typer.Option(
            "--backend",
            metavar="ssh|slurm",
            help="How to start the workers: ssh (each host over SSH) or slurm (one "
            "heterogeneous batch job, one component per host group, settings from the "
            "cluster file's slurm: section; the run directory must be on a file system "
            "the nodes share). [default: the cluster file's backend, else ssh]",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print each host's command (Slurm: the batch script), then run the checks "
            "the launch runs before starting anything (hosts, paths, --init-from, --data; "
            "Slurm: its commands, a shared run folder): exit 1 where the launch would refuse.",
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Run even if the cluster file changed.")
    ] = False,
    accept_new_host_keys: trainopts.AcceptNewHostKeysOpt = False,
    known_hosts: trainopts.KnownHostsOpt = None,
    auto_recover: Annotated[
        bool, typer.Option("--auto-recover", help="If a host is lost, recover at once.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the outcome as JSON.")] = False,
) -> None:
    """Start torchrun on every host of PLAN, stream the output, stop cleanly on Ctrl-C."""
    req = session.LaunchRequest(
        plan_file=plan_file,
        cluster=cluster,
        **training.request_fields(),
        **trainopts.reach(
            master_port=master_port,
            backend=backend,
            known_hosts=known_hosts,
            accept_new_host_keys=accept_new_host_keys,
        ),
        script=tuple(script or ()),
        run_id=run_id,
        sync_dir=sync_dir,
        force=force,
        start_timeout_s=start_timeout,
        resume=resume,
        job=job,
        init_from=init_from,
    )
    if dry_run:
        typer.echo(session.dry_run(req))
        for line in session.dry_check(req):  # the launch's checks: exit 1 where it would refuse
            typer.echo(line, err=True)
        return
    try:
        result = session.launch(req, (lambda _line: None) if as_json else typer.echo)
    except NothingToTrain as done:  # the job is where --steps ends it: not a failure
        typer.echo(_nothing_json(done) if as_json else f"nothing to train: {done}")
        raise typer.Exit(0) from None
    out = result.outcome
    if as_json:
        typer.echo(
            json.dumps(
                {
                    **out.to_dict(),
                    "recover_command": result.recover_command,
                    "resume_command": result.resume_command,
                }
            )
        )
    else:
        _print_outcome(out, result.recover_command, result.resume_command)
    if auto_recover and result.recover_command is not None:
        argv = session.recover_argv(req, out.lost_hosts, full=True)
        typer.echo(f"auto-recover: autohet {' '.join(argv)}")
        raise typer.Exit(subprocess.call([sys.executable, "-m", "autohet_cli", *argv]))
    raise typer.Exit(out.exit_code)


def _nothing_json(done: NothingToTrain) -> str:
    return json.dumps(
        {"status": "nothing_to_train", "exit_code": 0, "detail": str(done), "last_step": done.step}
    )


def _print_outcome(out: JobOutcome, hint: str | None, resume: str | None = None) -> None:
    typer.echo(f"{out.status}: {out.detail or out.last_status}")
    cause = out.root_cause
    if cause and cause.get("detail"):
        for line in str(cause["detail"]).splitlines()[-8:]:
            typer.echo(f"    {line}")
    if out.local_run_dir:
        typer.echo(runfolder.end_line(out.local_run_dir))
    if hint:
        typer.echo(f"to continue on the survivors: {hint}")
    elif resume:
        typer.echo(
            "no host of the plan survives to recover on (its job key and checkpoints are "
            f"there); to resume the job once its hosts answer again: {resume}"
        )


def register(app: typer.Typer) -> None:
    app.command("launch", epilog=EPILOG)(launch)
