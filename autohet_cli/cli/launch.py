"""`autohet launch`: start a plan's workers on every host, stream them, stop them cleanly."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from autohet_cli.cluster import load_cluster
from autohet_cli.defaults import default_cluster_path
from autohet_cli.errors import PlanError
from autohet_cli.launch.executor import ConnectOptions, Job, home_directories, recover_command
from autohet_cli.launch.specs import LaunchOptions, build_launch_specs
from autohet_cli.plan import Plan, check_against_cluster, load_plan
from autohet_cli.recovery.manifest import remote_root
from autohet_cli.yamlio import sha256_file


def launch(
    plan_file: Annotated[Path, typer.Argument(help="Plan to run (plans/NAME.vN.yaml)")],
    script: Annotated[
        list[str] | None,
        typer.Argument(
            help="After --: your training script and its arguments (default: the built-in "
            "GPT trainer)"
        ),
    ] = None,
    cluster: Annotated[str | None, typer.Option(help="Cluster file (default: the plan's)")] = None,
    steps: Annotated[int, typer.Option(help="Steps for the built-in trainer", min=0)] = 100,
    train_arg: Annotated[
        list[str] | None,
        typer.Option(help="Extra argument for the built-in trainer, e.g. --train-arg=--lr=3e-4"),
    ] = None,
    master_port: Annotated[int, typer.Option(help="torchrun rendezvous port")] = 29500,
    run_id: Annotated[
        str | None, typer.Option(help="Run directory name (default: UTC time)")
    ] = None,
    sync_dir: Annotated[
        Path | None,
        typer.Option(
            help="Copy this local directory into each host's workdir first (only changed "
            "files move, like rsync), e.g. your training code"
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="Print each host's command and exit")] = False,
    force: Annotated[
        bool, typer.Option(help="Run even if the cluster file changed since the plan was made")
    ] = False,
    accept_new_host_keys: Annotated[
        bool, typer.Option(help="Trust host keys seen for the first time (like ssh accept-new)")
    ] = False,
    known_hosts: Annotated[Path | None, typer.Option(help="known_hosts file")] = None,
    auto_recover: Annotated[
        bool,
        typer.Option(
            help="If a host is lost, run autohet recover at once (same steps, keys and port + 1)"
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the outcome as JSON")] = False,
) -> None:
    """Start torchrun on every host of PLAN, stream output, stop everything on Ctrl-C.

    Example: autohet launch plans/lab.v1.yaml --steps 200   |   autohet launch
    plans/lab.v1.yaml -- my_train.py --epochs 3
    """
    plan = load_plan(plan_file)
    cluster_path = (
        cluster or plan.inputs.get("cluster", {}).get("path") or str(default_cluster_path())
    )
    _check_fingerprint(plan, plan_file, cluster_path, force)
    cl = load_cluster(cluster_path)
    check_against_cluster(
        plan, {h.name: (h.gpu_type, h.num_gpus) for h in cl.hosts}, str(plan_file)
    )
    rid = run_id or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    extra = [f"--steps={steps}", *(train_arg or [])]
    options = LaunchOptions(
        run_id=rid,
        master_port=master_port,
        script=script or (),
        train_args=extra,
        remote_storage=remote_root(cl.remote_storage, os.environ),
    )
    connect = ConnectOptions(known_hosts=known_hosts, accept_new_host_keys=accept_new_host_keys)
    homes = None if dry_run else home_directories(plan, cl, connect)
    specs = build_launch_specs(plan, cl, options, homes)
    if dry_run:
        for s in specs:
            typer.echo(
                f"# {s.host} ({s.address}), node {s.node_rank}, "
                f"{s.nproc_per_node} worker(s)\n{s.command_line()}"
            )
        return
    job = Job(
        specs,
        cl,
        plan_file,
        Path("runs") / f"{plan.name}.v{plan.version}" / rid,
        connect=connect,
        shares=tuple(p.num_microbatches for p in plan.pipelines),
        sync_source=sync_dir,
        printer=(lambda _line: None) if as_json else typer.echo,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: job.stop_requested.set())
    try:
        job.start()
        outcome = job.watch()
    finally:
        job.stop_all()
        job.close()
    hint = recover_command(plan_file, cluster, outcome.lost_hosts or outcome.failed_hosts)
    if as_json:
        typer.echo(
            json.dumps(
                {**outcome.__dict__}
                if hasattr(outcome, "__dict__")
                else {k: getattr(outcome, k) for k in outcome.__slots__}
            )
        )
    else:
        typer.echo(
            f"{outcome.status}: {outcome.detail or outcome.last_status} "
            f"(logs: {outcome.local_run_dir})"
        )
        if outcome.status in ("host_lost", "failed"):
            typer.echo(f"to continue on the survivors: {hint}")
    if auto_recover and outcome.status in ("host_lost", "failed"):
        argv = [
            *shlex.split(hint)[1:],
            "--steps",
            str(steps),
            "--master-port",
            str(master_port + 1),
            *(f"--train-arg={a}" for a in (train_arg or [])),
        ]
        if known_hosts:
            argv += ["--known-hosts", str(known_hosts)]
        typer.echo(f"auto-recover: autohet {shlex.join(argv)}")
        code = subprocess.call([sys.executable, "-m", "autohet_cli", *argv])
        raise typer.Exit(code)
    raise typer.Exit(outcome.exit_code)


def _check_fingerprint(plan: Plan, plan_file: Path, cluster_path: str, force: bool) -> None:
    want = plan.inputs.get("cluster", {}).get("sha256")
    if not want or force:
        return
    have = sha256_file(cluster_path)
    if have != want:
        raise PlanError(
            f"{plan_file}: made for a cluster file with sha256 {want[:12]}…, but "
            f"{cluster_path} now has {have[:12]}…; re-plan (autohet plan) or pass --force"
        )


def register(app: typer.Typer) -> None:
    app.command("launch")(launch)
