"""`autohet recover`: replan on the survivors, move checkpoint shards local-first, resume."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from autohet_cli.cluster import Cluster, load_cluster
from autohet_cli.defaults import default_cluster_path
from autohet_cli.launch.executor import ConnectOptions, Job, home_directories
from autohet_cli.launch.specs import LaunchOptions, build_launch_specs
from autohet_cli.plan import Plan, load_plan, write_plan
from autohet_cli.recovery import executor as rx
from autohet_cli.recovery.replan import replan
from autohet_cli.recovery.report import PhaseClock, build_report
from autohet_cli.yamlio import sha256_file


def recover(
    plan_file: Annotated[Path, typer.Argument(help="The plan that was running")],
    lost: Annotated[
        str | None,
        typer.Option(help="Hosts known lost, e.g. v100-1,v100-2 (default: probe every host)"),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(help="Cluster file (default: the plan's); hosts added to it are used"),
    ] = None,
    steps: Annotated[int, typer.Option(help="Train until this step", min=1)] = 100,
    checkpoint_every: Annotated[int, typer.Option(help="Checkpoint every K steps", min=0)] = 10,
    train_arg: Annotated[list[str] | None, typer.Option(help="Extra trainer argument")] = None,
    time_limit: Annotated[float, typer.Option(help="Seconds for re-planning")] = 30.0,
    dry_run: Annotated[
        bool, typer.Option(help="Print the plan change and the transfer plan, move nothing")
    ] = False,
    no_resume: Annotated[bool, typer.Option(help="Move shards but do not relaunch")] = False,
    master_port: Annotated[int, typer.Option(help="torchrun rendezvous port")] = 29500,
    accept_new_host_keys: Annotated[bool, typer.Option(help="Trust new host keys")] = False,
    known_hosts: Annotated[Path | None, typer.Option(help="known_hosts file")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON")] = False,
) -> None:
    """After a preemption: find the lost hosts and the last complete checkpoint, write a
    new plan version for the survivors, copy each missing shard from a surviving peer
    (remote storage only for what every peer lost), verify it, and resume training."""

    def say(message: str) -> None:
        if not as_json:
            typer.echo(message)

    old = load_plan(plan_file)
    cluster_path = (
        cluster or old.inputs.get("cluster", {}).get("path") or str(default_cluster_path())
    )
    cl = load_cluster(cluster_path)
    connect = ConnectOptions(known_hosts=known_hosts, accept_new_host_keys=accept_new_host_keys)
    hosts = rx.Hosts(cl, connect)
    clock = PhaseClock()
    root = rx.remote_root_for(cl)
    try:
        with clock.phase("detect"):
            gone = [h for h in (lost or "").split(",") if h] or rx.detect_lost(old, hosts, say)
        survivors = [h.name for h in cl.hosts if h.name not in gone]
        with clock.phase("checkpoint"):
            choice, remote = rx.choose_checkpoint(old.name, survivors, cl, hosts, root)
        say(f"lost: {', '.join(gone) or 'none'}; resuming from {choice.step_dir}")
        with clock.phase("replan"):
            inputs = {
                **old.inputs,
                "cluster": {"path": cluster_path, "sha256": sha256_file(cluster_path)},
            }
            r = replan(
                old,
                cl,
                gone,
                old_path=str(plan_file),
                tables=rx.plan_inputs_tables(old, cluster_path),
                time_limit_s=time_limit,
                inputs=inputs,
            )
        new_plan, new_path = (
            (replace(r.plan, version=0), Path("(dry run)"))
            if dry_run
            else write_plan(r.plan, plan_file.parent)
        )
        for note in new_plan.notes:
            say(f"plan: {note}")
        with clock.phase("transfer"):
            present = rx.hashes_present(new_plan.hosts(), cl, old.name, choice.step_dir, hosts)
            tp = rx.transfers_for(choice, new_plan, cl, present, remote, gone, root)
            if dry_run:
                typer.echo(
                    json.dumps(
                        {
                            "lost": gone,
                            "step": choice.step,
                            "new_plan_hosts": new_plan.hosts(),
                            "plan_diff": _diff(old, new_plan),
                            "notes": list(new_plan.notes),
                            "transfers": tp.to_dict(),
                        },
                        indent=2,
                    )
                )
                return
            rx.execute_transfers(tp, hosts, say)
            rx.finalize(tp, rx.manifest_text(choice.manifest), cl, hosts)
        say(
            f"wrote {new_path}; {len(tp.items)} file(s) copied "
            f"({tp.bytes_from_peers} B from peers, {tp.bytes_from_remote} B from remote)"
        )
        report = build_report(
            replan=r,
            transfer=tp,
            new_plan_path=str(new_path),
            old_plan_path=str(plan_file),
            phases=clock.phases,
            resumed_step=choice.step,
        )
        code = 0
        if not no_resume:
            code = _relaunch(
                new_plan,
                new_path,
                cl,
                connect,
                clock,
                say,
                root,
                [
                    f"--steps={steps}",
                    f"--resume={choice.step}",
                    f"--checkpoint-every={checkpoint_every}",
                    *(train_arg or []),
                ],
                master_port,
            )
            report = replace(report, phases=clock.phases)
    finally:
        hosts.close()
    typer.echo(json.dumps(report.to_dict()) if as_json else f"recovered: phases {report.phases}")
    raise typer.Exit(code)


def _relaunch(
    plan: Plan,
    path: Path,
    cl: Cluster,
    connect: ConnectOptions,
    clock: PhaseClock,
    say: Callable[[str], None],
    root: str,
    train_args: list[str],
    master_port: int,
) -> int:
    rid = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    options = LaunchOptions(
        run_id=rid, master_port=master_port, train_args=train_args, remote_storage=root
    )
    specs = build_launch_specs(plan, cl, options, home_directories(plan, cl, connect))
    job = Job(
        specs,
        cl,
        path,
        Path("runs") / f"{plan.name}.v{plan.version}" / rid,
        connect=connect,
        shares=tuple(p.num_microbatches for p in plan.pipelines),
        printer=say,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: job.stop_requested.set())
    try:
        with clock.phase("relaunch"):
            job.start()
        outcome = job.watch()
    finally:
        job.stop_all()
        job.close()
    say(f"{outcome.status}: {outcome.detail or outcome.last_status}")
    return outcome.exit_code


def _diff(old: Plan, new: Plan) -> dict[str, object]:
    """Stage by stage, old and new: host:gpus [start, end) per pipeline, and the batch."""

    def shape(p: Plan) -> list[str]:
        return [
            f"m={pl.num_microbatches}: "
            + " | ".join(
                f"{s.host}:{','.join(str(d.gpu) for d in s.devices)} [{s.layer_start},"
                f"{s.layer_end})"
                for s in pl.stages
            )
            for pl in p.pipelines
        ]

    removed = sorted(set(old.hosts()) - set(new.hosts()))
    return {
        "old": shape(old),
        "new": shape(new),
        "hosts_dropped": removed,
        "tensor_parallel": [old.tensor_parallel, new.tensor_parallel],
        "micro_batch_size": [old.training.micro_batch_size, new.training.micro_batch_size],
    }


def register(app: typer.Typer) -> None:
    app.command("recover")(recover)
