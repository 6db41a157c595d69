"""``autohet profile``: import measured per-layer profiles and inspect profile files."""

from __future__ import annotations

import dataclasses
import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from autohet_cli.catalog import canonical_gpu_name
from autohet_cli.cli import profile_calibrate, profile_run
from autohet_cli.errors import ConfigError, ProfileError
from autohet_cli.models import canonical_model_name
from autohet_cli.profiling.sailor import import_sailor
from autohet_cli.profiling.schema import Profile, ProfileEntry, load_profile, save_profile
from autohet_cli.profiling.store import entry_totals, select_entries, tp_mbs_pairs

HELP = """\
Per-layer profiles: how long each layer of a model takes on each GPU type, and
how much memory it needs. The planner reads them; types nobody measured get
analytic estimates from the GPU catalog.

A profile file (schema autohet.profile/v1, YAML) holds, per model, GPU type,
tensor-parallel degree (tp) and micro-batch size (mbs), every layer's forward,
backward and optimizer-update milliseconds, its parameter count and the
activation and output bytes of one micro-batch.

Examples:

\b
  autohet profile run cluster.yaml --model OPT-350M
  autohet profile import --format sailor tests/data/sailor --model OPT-350M \\
      --out profiles/opt.yaml
  autohet profile show profiles/sailor/OPT-350M.yaml --gpu A100-40 --tp 1
"""


class ImportFormat(StrEnum):
    sailor = "sailor"


_IMPORTERS = {ImportFormat.sailor: import_sailor}


def register(app: typer.Typer) -> None:
    sub = typer.Typer(
        help=HELP,
        short_help="Measure, import and inspect per-layer profiles.",
        no_args_is_help=True,
        rich_markup_mode=None,
    )
    sub.command("import")(import_profiles)
    sub.command("show")(show)
    sub.command("run")(profile_run.run)
    sub.command("calibrate")(profile_calibrate.calibrate_command)
    app.add_typer(sub, name="profile")


def import_profiles(
    directory: Annotated[
        Path,
        typer.Argument(
            metavar="DIRECTORY",
            help="Data to import. For sailor: the directory holding "
            "profiles/<MODEL>/<GPU>/profile.json and llm_info.json.",
            show_default=False,
        ),
    ],
    fmt: Annotated[
        ImportFormat,
        typer.Option("--format", help="Layout of DIRECTORY: sailor (eth-easl/sailor data)."),
    ],
    model: Annotated[
        str, typer.Option("--model", "-m", help="Zoo name or the data's spelling (OPT-350).")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Profile file to write.")],
    merge_into: Annotated[
        Path | None,
        typer.Option(help="Existing profile to add to; imported entries replace equal keys."),
    ] = None,
    skip_gpu: Annotated[
        list[str] | None,
        typer.Option(
            "--skip-gpu",
            metavar="TYPE",
            help="Leave this GPU type out (repeatable), e.g. a mislabelled file.",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Convert measured profiles (Sailor's) into an autohet profile file.

    Example (the Sailor measurements that ship in the repository):

    \b
      autohet profile import --format sailor tests/data/sailor --model OPT-350M \\
          --out profiles/opt-350m.yaml
    """
    if out.exists() and not force:
        raise ConfigError(f"{out}: already exists; pass --force to replace it, or change --out")
    imported = _IMPORTERS[fmt](directory, model, skip_gpus=skip_gpu or ())
    result = load_profile(merge_into).merged_with(imported) if merge_into else imported
    save_profile(result, out, overwrite=force)
    _print_import(imported, directory, result, out, merge_into)


def show(
    file: Annotated[
        Path, typer.Argument(metavar="FILE", help="Profile file (autohet.profile/v1).")
    ],
    model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
    gpu: Annotated[str | None, typer.Option(help="Only this GPU type.")] = None,
    tp: Annotated[int | None, typer.Option(help="Only this tensor-parallel degree.")] = None,
    mbs: Annotated[int | None, typer.Option(help="Only this micro-batch size.")] = None,
    layers: Annotated[
        bool, typer.Option("--layers", help="Also print each entry's layers.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Print a profile's entries: sums over layers per (model, GPU, tp, mbs).

    Example:

    \b
      autohet profile show profiles/sailor/OPT-350M.yaml --gpu V100-16 --layers
    """
    profile = load_profile(file)
    entries = select_entries(
        profile,
        model=canonical_model_name(model) if model else None,
        gpu_type=_gpu_in(profile, gpu) if gpu else None,
        tensor_parallel=tp,
        micro_batch_size=mbs,
    )
    if not entries:
        raise ProfileError(
            f"{file}: no entry matches; it holds models {', '.join(profile.models())} "
            f"on {', '.join(sorted({k.gpu_type for k in profile.entries}))}"
        )
    if as_json:
        typer.echo(json.dumps(_json_view(profile, entries, layers), indent=2))
        return
    typer.echo(f"{file}: {len(entries)} entries (sums over layers)")  # unwrapped path
    console = Console()
    console.print(_totals_table(entries))
    for entry in entries if layers else []:
        console.print(_layers_table(entry))


def _gpu_in(profile: Profile, gpu: str) -> str:
    """A type the profile holds by that exact name (a cluster-defined type such as
    A6000 is no catalog spelling), else the catalog's name for the spelling."""
    held = {k.gpu_type for k in profile.entries} | set(profile.devices)
    return gpu if gpu in held else canonical_gpu_name(gpu)


def _print_import(
    imported: Profile, directory: Path, result: Profile, out: Path, merge_into: Path | None
) -> None:
    """Lines that name paths go through plain echo, never rich: rich wraps at the
    terminal width (80 when piped) and would split a long path across lines, so a
    user could not paste it and a script could not grep it."""
    num_layers = sorted({len(e.layers) for e in imported.entries.values()})
    typer.echo(
        f"imported {', '.join(imported.models())} from {directory}: "
        f"{len(imported.entries)} entries of {'/'.join(map(str, num_layers))} layers"
    )
    Console().print(_summary_table(imported))
    for note in (imported.meta.get("history") or [{}])[-1].get("notes", []):
        typer.echo(f"note: {note}")
    merged = f" (merged with {merge_into})" if merge_into else ""
    typer.echo(f"wrote {out}{merged}: {len(result.entries)} entries")


def _summary_table(p: Profile) -> Table:
    table = Table()
    for col in ("model", "GPU type", "tp", "micro-batch sizes"):
        table.add_column(col)
    for model in p.models():
        for gpu in sorted(p.devices):
            pairs = tp_mbs_pairs(p, model, gpu)
            for tp in sorted({t for t, _ in pairs}):
                table.add_row(model, gpu, str(tp), " ".join(str(m) for t, m in pairs if t == tp))
    return table


def _totals_table(entries: list[ProfileEntry]) -> Table:
    table = Table()
    for col in ("model", "GPU", "tp", "mbs", "source", "fwd ms", "bwd ms", "params"):
        table.add_column(col, justify="left" if col in ("model", "GPU", "source") else "right")
    for e in entries:
        t = entry_totals(e)
        table.add_row(
            t["model"],
            t["gpu_type"],
            str(t["tensor_parallel"]),
            str(t["micro_batch_size"]),
            t["source"],
            f"{t['fwd_ms']:.3f}",
            f"{t['bwd_ms']:.3f}",
            f"{t['num_params'] / 1e6:,.1f}M",
        )
    return table


def _layers_table(e: ProfileEntry) -> Table:
    k = e.key
    table = Table(
        title=f"{k.model} on {k.gpu_type}, tp {k.tensor_parallel}, mbs {k.micro_batch_size}, "
        f"seq_len {k.seq_len} ({e.source}, {e.dtype})"
    )
    for col in ("layer", "fwd ms", "bwd ms", "update ms", "params", "act MB", "out MB"):
        table.add_column(col, justify="right")
    for i, lt in enumerate(e.layers):
        table.add_row(
            str(i),
            f"{lt.fwd_ms:.3f}",
            f"{lt.bwd_ms:.3f}",
            f"{lt.update_ms:.3f}",
            f"{lt.num_params:,}",
            f"{lt.act_bytes / 1e6:.1f}",
            f"{lt.output_bytes / 1e6:.1f}",
        )
    return table


def _json_view(p: Profile, entries: list[ProfileEntry], layers: bool) -> dict[str, Any]:
    rows = []
    for e in entries:
        row = entry_totals(e)
        if layers:
            row["layers"] = [dataclasses.asdict(lt) for lt in e.layers]
        rows.append(row)
    devices = {name: dataclasses.asdict(d) for name, d in sorted(p.devices.items())}
    return {"meta": dict(p.meta), "devices": devices, "entries": rows}
