"""`autohet cluster import --slurm`: a cluster file from Slurm's description of its nodes."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Annotated

import typer
import yaml

from autohet_cli.errors import ConfigError
from autohet_cli.slurm import ctl
from autohet_cli.slurm.importer import import_nodes
from autohet_cli.yamlio import write_new

EPILOG = (
    "Examples:\n\n"
    "  autohet cluster import --slurm --partition gpu --out lab.yaml\n\n"
    "  autohet cluster import --slurm --nodes 'gpu[01-04]' --out gpu.yaml\n\n"
    "  autohet cluster import --slurm --gpu-type a100=A100-80\n\n"
    "Each node with GPU GRES becomes a host named after the node (Slurm node names are "
    "what launch pins jobs to), at its NodeAddr, with backend: slurm and, per GPU type, "
    "the GRES type to request. Add account, time_limit and constraints under slurm: "
    "afterwards (see README). The file is never overwritten.\n"
)


def import_(
    slurm: Annotated[
        bool, typer.Option("--slurm", help="Read the nodes from Slurm (scontrol show node).")
    ] = False,
    partition: Annotated[
        str | None, typer.Option(help="Only nodes of this partition; also set as slurm.partition.")
    ] = None,
    nodes: Annotated[
        str | None, typer.Option(help="Only these nodes (a Slurm node list, e.g. gpu[01-04]).")
    ] = None,
    gpu_type: Annotated[
        list[str] | None,
        typer.Option(
            "--gpu-type",
            metavar="GRES=TYPE",
            help="GPU type of a GRES type (repeatable), e.g. a100=A100-80. [default: by name]",
        ),
    ] = None,
    cpu_devices: Annotated[
        int,
        typer.Option(
            help="Take nodes without GPUs as cpu hosts with this many workers (0: skip).", min=0
        ),
    ] = 0,
    name: Annotated[str, typer.Option(help="The cluster's name.")] = "slurm",
    out: Annotated[Path, typer.Option(help="The cluster file to write (never replaced).")] = Path(
        "cluster.yaml"
    ),
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Write a cluster file describing Slurm's GPU nodes (GRES types and counts)."""
    if not slurm:
        raise ConfigError("cluster import: say where from: --slurm (the only source so far)")
    mapping = {}
    for item in gpu_type or []:
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise ConfigError(f"--gpu-type {item!r}: write GRES=TYPE, e.g. a100=A100-80")
        mapping[key] = value
    argv = ["scontrol", "show", "node", "-o"] + ([nodes] if nodes else [])
    result = import_nodes(
        ctl.run(argv),
        name=name,
        partition=partition,
        gpu_types=mapping,
        cpu_devices=cpu_devices,
        this_host=socket.gethostname(),
    )
    write_new(out, yaml.safe_dump(result.doc, sort_keys=False))
    hosts = result.doc["hosts"]
    if as_json:
        typer.echo(
            json.dumps({"ok": True, "path": str(out), "hosts": hosts, "notes": list(result.notes)})
        )
        return
    for note in result.notes:
        typer.echo(f"note: {note}")
    for h in hosts:
        typer.echo(f"  {h['name']} ({h['address']}): {h['gpus']['count']} x {h['gpus']['type']}")
    typer.echo(f"wrote {out}: {len(hosts)} host(s), backend slurm")


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="Describe a cluster: import it from Slurm.",
        no_args_is_help=True,
        rich_markup_mode=None,
    )
    group.command("import", epilog=EPILOG)(import_)
    app.add_typer(group, name="cluster")
