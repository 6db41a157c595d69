"""`autohet export`: a training checkpoint as a HuggingFace model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def export(
    step_dir: Annotated[
        Path,
        typer.Argument(help="Checkpoint step directory: <checkpoint_dir>/<plan>/<job>/step-<N>"),
    ],
    out: Annotated[Path, typer.Option(help="New directory for config.json and safetensors")],
    format: Annotated[str, typer.Option(help="Output format (hf: HuggingFace)")] = "hf",
    plan: Annotated[
        Path | None,
        typer.Option(help="Plan that wrote the checkpoint (default: plans/<its plan>.yaml)"),
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="float32, bfloat16 or float16 (default: as stored)")
    ] = None,
    max_shard_size: Annotated[
        str, typer.Option(help="Largest safetensors file; more files get an index")
    ] = "5GB",
) -> None:
    """Write a checkpoint saved under any plan as config.json + safetensors.

    The manifest must verify with the job's key and every file must be in
    the directory (as after autohet recover); then tensors stream one output
    file at a time.

    Example (the step-1000 checkpoint of plan lab, for transformers):

    \b
      autohet export /nvme/ckpt/lab/JOB/step-00001000 --format hf --out llama-ft
    """
    if format != "hf":
        raise typer.BadParameter("only 'hf' is supported", param_hint="--format")
    from autohet_cli.ckpt.prune import reading_step
    from autohet_cli.runtime.hf_export import export_hf, open_checkpoint, parse_size, spec_for

    with reading_step(step_dir, holder="autohet export"):  # no prune of a running job
        ckpt = open_checkpoint(step_dir)
        files = export_hf(
            ckpt, spec_for(ckpt, plan), out, dtype=dtype, max_shard_bytes=parse_size(max_shard_size)
        )
    typer.echo(f"wrote {out}: {', '.join(f.name for f in files)}")


def register(app: typer.Typer) -> None:
    app.command("export")(export)
