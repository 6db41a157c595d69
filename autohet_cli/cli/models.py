"""``autohet models``: what the planner knows about a model, before planning with it.

``list`` shows the zoo; ``show`` shows the partitionable layers of a zoo model or
a HuggingFace ``config.json``, which is what plans index with ``layers: [a, b)``
and what profiles are keyed by, so users can read a plan against it.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from autohet_cli.models import ZOO, LayerSpec, ModelSpec, get_model


def _model_row(m: ModelSpec) -> dict[str, object]:
    return {
        "name": m.name,
        "family": m.family,
        "layers": m.num_layers,
        "blocks": m.num_blocks,
        "params": m.num_params,
        "params_b": m.num_params / 1e9,
        "hidden": m.hidden_size,
        "heads": m.num_heads,
        "kv_heads": m.num_kv_heads,
    }


def _layer_row(layer: LayerSpec, seq_len: int) -> dict[str, object]:
    return {
        "index": layer.index,
        "name": layer.name,
        "kind": layer.kind,
        "params": layer.num_params,
        "shared_params": layer.shared_params,
        "fwd_gflops_per_sample": layer.fwd_flops(seq_len, micro_batch_size=1) / 1e9,
    }


def _cell(value: object) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _print_table(
    title: str,
    rows: list[dict[str, object]],
    columns: dict[str, str],
    numeric: frozenset[str] = frozenset(),
) -> None:
    """Rows as a rich table; ``columns`` maps row keys to headers, in display order.

    Text columns are left-aligned and numbers (and the ``numeric`` keys, numbers
    written as text) right-aligned so digits line up.
    """
    table = Table(title=title)
    for key, header in columns.items():
        left = isinstance(rows[0][key], str) and key not in numeric
        table.add_column(header, justify="left" if left else "right")
    for row in rows:
        table.add_row(*(_cell(row[key]) for key in columns))
    Console().print(table)


def list_models(
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
) -> None:
    """List the model zoo (names accept shorthands such as OPT-350 or llama_3_8).

    Example:

    \b
      autohet models list --json
    """
    rows = [_model_row(m) for m in ZOO.values()]
    if json_output:
        typer.echo(json.dumps(rows, indent=2))
        return
    # In K/M/B as models show writes them: "0.0002205" billion is not read at a glance.
    for row in rows:
        row["params_text"] = params_text(int(str(row["params"])))
    columns = {
        "name": "name",
        "family": "family",
        "layers": "layers",
        "blocks": "blocks",
        "params_text": "params",
        "hidden": "hidden",
        "heads": "heads",
    }
    _print_table("Model zoo", rows, columns, numeric=frozenset({"params_text"}))


def params_text(n: int) -> str:
    """``354.6K``, ``124.4M``, ``6.738B``: the unit that keeps 4 significant digits
    readable (a tiny model's "0.0003546B" is not)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


def show_model(
    model: Annotated[
        str, typer.Argument(metavar="NAME_OR_CONFIG_JSON", help="Zoo name or config.json path.")
    ],
    seq_len: Annotated[
        int | None,
        typer.Option(
            "--seq-len",
            min=1,
            help="Sequence length for the FLOPs (default: the model's training length).",
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
) -> None:
    """Show the partitionable layers of a model, as plans and profiles index them.

    Example:

    \b
      autohet models show OPT-350M --seq-len 2048
    """
    spec = get_model(model)
    seq = seq_len or spec.default_seq_len
    layers = [_layer_row(layer, seq) for layer in spec.layers()]
    if json_output:
        typer.echo(json.dumps({**_model_row(spec), "seq_len": seq, "layer_list": layers}, indent=2))
        return
    columns = {
        "index": "index",
        "name": "name",
        "kind": "kind",
        "params": "params",
        "fwd_gflops_per_sample": f"fwd GFLOPs/sample @ {seq}",
    }
    title = f"{spec.name} ({spec.family}, {params_text(spec.num_params)} params)"
    _print_table(title, layers, columns)
    shared = sum(layer.shared_params for layer in spec.layers())
    if shared:
        typer.echo(
            f"The head holds a tied copy of the embedding ({shared:,} params, "
            "counted once in the total)."
        )


def register(app: typer.Typer) -> None:
    """Add the ``models`` command group to ``app``."""
    group = typer.Typer(
        help="Inspect the model zoo and HuggingFace configs.",
        no_args_is_help=True,
        rich_markup_mode=None,
    )
    group.command("list")(list_models)
    group.command("show")(show_model)
    app.add_typer(group, name="models")
