"""`autohet recover`: parse options, hand them to ``recovery.session``, print the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from autohet_cli.cli import trainopts
from autohet_cli.launch.pathargs import HELP as PATHS_HELP
from autohet_cli.plan import load_plan
from autohet_cli.recovery import session
from autohet_cli.recovery.report import dry_run_text, phases_text

EPILOG = (
    "Examples:\n\n"
    "  autohet recover plans/lab.v1.yaml                  # probe hosts, resume\n\n"
    "  autohet recover plans/lab.v1.yaml --lost v100-1 --dry-run\n\n"
    "  autohet recover plans/lab.v1.yaml --step 40 --steps 500 --json\n\n"
    "Only a host that does not answer counts as lost; a host that refuses us (host "
    "key, authentication, permissions) stops recovery with that message. One recover "
    "of a job runs at a time: a lock in the job's directory on the hosts names the "
    "one running.\n\n" + PATHS_HELP
)


@trainopts.options("recover")
def recover(
    plan_file: Annotated[
        Path, typer.Argument(metavar="PLAN_FILE", help="The plan that was running.")
    ],
    lost: Annotated[
        str | None,
        typer.Option(help="Hosts known lost, e.g. v100-1,v100-2. [default: probe every host]"),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(help="Cluster file; hosts added to it are used. [default: the plan's]"),
    ] = None,
    step: Annotated[
        int | None,
        typer.Option(help="Resume from this step. [default: newest usable]", min=0),
    ] = None,
    job: Annotated[
        str | None,
        typer.Option(help="Checkpoint namespace (launch prints it). [default: the newest]"),
    ] = None,
    *,
    training: trainopts.Training,
    time_limit: Annotated[
        float,
        typer.Option(
            help="Seconds for re-planning. The search in the old plan's space, seeded "
            "with the survivors kept in place, takes at most 1.5 s of it (a replan is "
            "recovery time); the rest is for when nothing fits that space",
            min=0.1,
        ),
    ] = 30.0,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print the plan change and the transfers; move nothing."),
    ] = False,
    resume: Annotated[
        bool,
        typer.Option("--resume/--no-resume", help="Relaunch training after moving the shards."),
    ] = True,
    master_port: trainopts.MasterPortOpt = None,
    backend: Annotated[
        str | None,
        typer.Option(
            "--backend",
            metavar="ssh|slurm",
            help="How to relaunch: ssh or slurm (a new batch job on the survivors). Shards "
            "are listed and copied over SSH either way, so on Slurm the nodes must accept "
            "SSH from here (most sites allow it to nodes of your own jobs, or always). "
            "[default: the cluster file's backend, else ssh]",
        ),
    ] = None,
    accept_new_host_keys: trainopts.AcceptNewHostKeysOpt = False,
    known_hosts: trainopts.KnownHostsOpt = None,
    break_lock: Annotated[
        bool,
        typer.Option(
            "--break-lock",
            help="Break the recover lock another machine's recover left on the hosts, "
            "once it is 5 min old (only when that recover is no longer running).",
        ),
    ] = False,
    auto_recover: Annotated[
        bool,
        typer.Option(
            "--auto-recover",
            help="If the resumed run loses a host too (spot losses come in waves), "
            "recover again from the plan just written, up to once per host of the plan.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """After a preemption: replan on the survivors, copy shards peer to peer, resume.

    Finds the lost hosts and the newest complete checkpoint, writes the next plan
    version, copies each missing shard from a surviving peer (remote storage only
    for what every peer lost), verifies it by sha256, then relaunches training.
    """

    def say(message: str) -> None:
        if not as_json:
            typer.echo(message)

    req = session.RecoverRequest(
        plan_file=plan_file,
        lost=tuple(h.strip() for h in (lost or "").split(",") if h.strip()),
        cluster=cluster,
        step=step,
        job=job,
        **training.request_fields(),
        **trainopts.reach(
            master_port=master_port,
            backend=backend,
            known_hosts=known_hosts,
            accept_new_host_keys=accept_new_host_keys,
        ),
        time_limit_s=time_limit,
        dry_run=dry_run,
        resume=resume,
        break_lock=break_lock,
    )
    result = session.recover(req, say)
    waves = len(load_plan(plan_file).hosts())  # each wave loses one host at least
    while auto_recover and waves > 0 and (nxt := session.next_wave(req, result)) is not None:
        waves -= 1
        say(
            f"auto-recover: the resumed run lost {', '.join(nxt.lost)} too; recovering "
            f"again from {nxt.plan_file}"
        )
        req, result = nxt, session.recover(nxt, say)
    if as_json:
        typer.echo(json.dumps(result.report))
    elif dry_run:
        for line in dry_run_text(result.report):
            typer.echo(line)
    else:
        typer.echo(f"recovery phases: {phases_text(result.report.get('phases') or {})}")
    raise typer.Exit(result.exit_code)


def register(app: typer.Typer) -> None:
    app.command("recover", epilog=EPILOG)(recover)
