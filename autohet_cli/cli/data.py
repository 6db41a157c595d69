"""``autohet data``: turn text into the token files training reads.

``prepare`` is a thin shell over ``dataset.prepare``: it parses the options, shows
the progress the domain code reports, and prints a summary line or JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from autohet_cli.cli.progress import progress_bar
from autohet_cli.dataset.prepare import (
    EOD_CANDIDATES,
    PrepareOptions,
    PrepareResult,
    default_workers,
    partial_dir,
    prepare,
)
from autohet_cli.dataset.readers import DocSeparator

EPILOG = (
    "Examples:\n\n"
    "\b\n"
    "  autohet data prepare autohet_cli/data/sample/corpus.txt --tokenizer sample \\\n"
    "      --doc-separator blank-line --out data/kjv\n"
    "  autohet data prepare shards/ --tokenizer ./llama3/tokenizer.json \\\n"
    "      --text-key content --workers 8 --out data/web --json"
)


def prepare_command(
    inputs: Annotated[
        list[Path],
        typer.Argument(
            metavar="INPUT",
            help=".txt, .jsonl, .parquet (or .txt.gz, .jsonl.gz) files, or directories "
            "of them (read recursively, sorted).",
        ),
    ],
    tokenizer: Annotated[
        str,
        typer.Option(
            "--tokenizer",
            help="A local tokenizer.json, a directory holding one, or `sample` for the "
            "shipped 2,048-token sample tokenizer. Never downloaded.",
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            help="Directory to create with tokens.bin and meta.json; must not exist.",
        ),
    ],
    text_key: Annotated[
        str, typer.Option("--text-key", help="Field (.jsonl) or column (.parquet) of the text.")
    ] = "text",
    doc_separator: Annotated[
        DocSeparator,
        typer.Option(
            "--doc-separator",
            help="How a .txt file is cut into documents: none (the file is one "
            "document) or blank-line (paragraphs are documents).",
        ),
    ] = DocSeparator.NONE,
    eod_token: Annotated[
        str | None,
        typer.Option(
            "--eod-token",
            help="Token appended after every document (default: the first of "
            f"{', '.join(EOD_CANDIDATES)} in the vocabulary).",
        ),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            min=1,
            help=f"Tokenizer processes (default: {default_workers()}, the CPU count "
            "capped at 4). The output is the same for any number.",
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
) -> None:
    """Tokenize text files into one token file (tokens.bin + meta.json) for training.

    Every document is followed by the end-of-document token. Work goes into
    OUT.partial/ first and is renamed to OUT when whole, so OUT is never half
    written; run the same command again after an interruption to resume with the
    inputs already finished. Empty documents are skipped.
    """
    options = PrepareOptions(
        inputs=tuple(inputs),
        tokenizer=tokenizer,
        out_dir=out,
        text_key=text_key,
        doc_separator=doc_separator,
        eod_token=eod_token,
        num_workers=workers or default_workers(),
    )
    shown = not json_output and sys.stderr.isatty()
    try:
        with progress_bar("tokenizing", enabled=shown) as report:
            result = prepare(options, report)
    except KeyboardInterrupt:
        partial = partial_dir(out)
        resume = f"; run the same command again to resume from {partial}"
        typer.echo(
            f"interrupted: {out} was not written{resume if partial.exists() else ''}", err=True
        )
        raise typer.Exit(130) from None
    for line in result.redone:
        typer.echo(f"note: {line}", err=True)
    typer.echo(json.dumps(_summary(result), indent=2) if json_output else _line(result))


def _summary(result: PrepareResult) -> dict[str, object]:
    return {
        "ok": True,
        "out": str(result.out_dir),
        "num_documents": result.num_documents,
        "num_tokens": result.num_tokens,
        "num_input_bytes": result.num_input_bytes,
        "num_inputs_reused": result.num_inputs_reused,
        "num_inputs_redone": len(result.redone),
        "redone": list(result.redone),
        "elapsed_s": round(result.elapsed_s, 3),
        "tokens_per_s": round(result.tokens_per_s, 1),
        "meta": result.meta,
    }


def _line(result: PrepareResult) -> str:
    meta = result.meta
    reused = f", {result.num_inputs_reused} reused" if result.num_inputs_reused else ""
    if result.redone:
        reused += f", {len(result.redone)} re-encoded"
    return (
        f"{_count(result.num_documents, 'document')}, {result.num_tokens:,} tokens "
        f"({meta['dtype']}, vocab {meta['vocab_size']:,}) from "
        f"{_count(len(meta['inputs']), 'input')}{reused}, {result.num_input_bytes:,} bytes, "
        f"in {result.elapsed_s:.1f} s ({result.tokens_per_s:,.0f} tokens/s) -> {result.out_dir}"
    )


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def register(app: typer.Typer) -> None:
    """Add the ``data`` command group to ``app``."""
    group = typer.Typer(
        help="Prepare training data: tokenize text into token files.",
        no_args_is_help=True,
        rich_markup_mode=None,
    )
    group.command("prepare", epilog=EPILOG)(prepare_command)
    app.add_typer(group, name="data")
