"""`autohet plan`: solve for the fastest asymmetric 3D plan and write it as an artifact."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from autohet_cli.cli.clock import process_age_s
from autohet_cli.cli.progress import progress_bar
from autohet_cli.errors import AutohetError, ConfigError
from autohet_cli.inputs import load_inputs, tables_for
from autohet_cli.plan import (
    Plan,
    default_plan_name,
    load_plan,
    next_version,
    plan_to_dict,
    validate_name,
    write_plan,
)
from autohet_cli.planner.api import make_plan, training_for
from autohet_cli.planner.explain import explain_text, provenance, summary_json
from autohet_cli.runtime.models import unsupported_reason

OUTPUT_RESERVE_S = 0.5  # writing the plan, its explanation, exiting (mix-256: 0.35-0.55 s)


def plan(
    model: Annotated[
        str,
        typer.Option(
            "--model", metavar="MODEL", help="Zoo model (autohet models list) or a HF config.json"
        ),
    ],
    global_batch_size: Annotated[
        int, typer.Option("--global-batch-size", metavar="N", help="Samples per iteration", min=1)
    ],
    cluster: Annotated[
        str | None,
        typer.Option(
            "--cluster",
            metavar="FILE",
            help="Cluster YAML or hostfile; localhost (the default) is the embedded "
            "cluster of this machine",
        ),
    ] = None,
    profile: Annotated[
        list[str] | None,
        typer.Option(
            "--profile",
            metavar="FILE",
            help="Profile file, repeatable; analytic estimates fill what profiles lack",
        ),
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option(help="Tokens per sample (default: the model's)")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Plan name (default: <cluster>-<model>)")] = None,
    out_dir: Annotated[str, typer.Option(help="Where plans/<name>.v<N>.yaml go")] = "plans",
    precision: Annotated[
        str,
        typer.Option(
            help="bf16, fp16 or fp32. Profile entries count as measured only in this "
            "precision (autohet profile run --precision); on CPU hosts the runtime "
            "trains in fp32 whatever this says, so plan them in fp32"
        ),
    ] = "bf16",
    optimizer: Annotated[str, typer.Option(help="adam or sgd")] = "adam",
    objective: Annotated[str, typer.Option(help="time (s/iteration) or cost ($/token)")] = "time",
    time_limit: Annotated[
        float,
        typer.Option(
            help="Seconds the whole command may take, from start to the plan written "
            "(kept to a fraction of a second: the planner's checks are cooperative): "
            "the best plan found by then, with its proven gap; what the time left no "
            "room for (baselines, contingency plans) is named in the plan's notes. "
            "With under 2 s left after reading the inputs, the first plan takes up "
            "to 3 s more"
        ),
    ] = 60.0,
    contingency: Annotated[
        bool,
        typer.Option(
            "--contingency",
            help="Also solve for the loss of each spot host (used by autohet recover)",
        ),
    ] = False,
    recompute: Annotated[
        bool | None,
        typer.Option(
            "--recompute/--no-recompute",
            help="Activation recomputation: by default the planner decides per stage, "
            "recomputing only where memory binds (each layer's forward runs again before "
            "its backward, ~1/3 more compute on that stage, and the stage keeps one "
            "hidden state per layer per micro-batch in flight instead of all its "
            "activations). --recompute: on every stage; --no-recompute: never",
            show_default=False,
        ),
    ] = None,
    zero1: Annotated[
        bool | None,
        typer.Option(
            "--zero1/--no-zero1",
            help="ZeRO-1: shard the optimizer state over the pipelines that hold the same "
            "layers (each keeps 1/P of Adam's moments and steps 1/P of the update; the "
            "gradient all-reduce becomes a reduce-scatter plus an all-gather of the same "
            "bytes), so that fewer, wider stages or more pipelines fit. By default the "
            "planner decides: it shards where that makes the plan at least 1% faster "
            "and says so in the plan's notes. --zero1: always; --no-zero1: never",
            show_default=False,
        ),
    ] = None,
    shard_weights: Annotated[
        bool | None,
        typer.Option(
            "--shard-weights/--no-shard-weights",
            help="Sharded weights (FSDP / ZeRO-3): the pipelines that hold the same stage "
            "each keep 1/P of its weights, gradients and optimizer state and gather the "
            "weights layer by layer before each micro-batch's forward and backward, "
            "hidden behind compute where the links allow; so fewer, shorter pipelines "
            "fit where memory binds. By default the planner searches it only where "
            "memory binds, shards stages where that makes the plan at "
            "least 1% faster, and says so in the plan's notes. --shard-weights: search "
            "it always and use it where it fits; --no-shard-weights: never",
            show_default=False,
        ),
    ] = None,
    measured_only: Annotated[
        bool,
        typer.Option(
            "--measured-only",
            help="Use only the (GPU type, TP degree, micro-batch size) combinations the "
            "profile measured (source measured or sailor), never analytic or calibrated "
            "estimates; fails, naming what was measured, when nothing else fits",
        ),
    ] = False,
    explain: Annotated[
        bool,
        typer.Option(
            "--explain",
            help="Print stages, memory, bottlenecks, baselines, and which stage times "
            "rest on unmeasured profile entries",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Solve for the fastest plan on a mixed fleet and write it.

    Minimises iteration time (or cost per token) over tensor-parallel degree,
    micro-batch size, pipelines and their uneven stages, and writes
    plans/NAME.vN.yaml, a new version each time. Uses a second process for the
    baselines where the machine has two cores or more
    (AUTOHET_PLANNER_PROCESSES=1: one process).

    Example (Sailor's measured OPT-350M on the paper's A100/V100/RTX 3090 mix):

    \b
      autohet plan --cluster profiles/clusters/paper-mix.yaml --model OPT-350M \\
          --profile profiles/sailor/OPT-350M.yaml --global-batch-size 64 --explain
    """
    if objective not in ("time", "cost"):
        raise typer.BadParameter("expected 'time' or 'cost'", param_hint="--objective")
    inputs = load_inputs(cluster, model, profile or [])
    # Here, not in make_plan: recover replans a cost plan's survivors with its
    # objective, and survivors all free (the priced hosts lost) must still get a plan
    # (free plans then rank by speed, request.FREE_PRICE_PER_HOUR).
    if objective == "cost" and not any(h.price_per_hour > 0 for h in inputs.cluster.hosts):
        raise ConfigError(
            f"--objective cost: no host of cluster {inputs.cluster.name} ({cluster}) has a "
            "price_per_hour, so every plan costs nothing; give the hosts their price in "
            "dollars per hour in the cluster file, or plan with --objective time"
        )
    # `is None`, not falsiness: --name '' and --seq-len 0 are errors, not the defaults.
    plan_name = (
        validate_name(name)
        if name is not None
        else default_plan_name(inputs.cluster.name, inputs.model.name)
    )
    training = training_for(
        global_batch_size,
        inputs.model.default_seq_len if seq_len is None else seq_len,
        precision,
        optimizer,
    )
    tables = tables_for(inputs, training)
    # The limit bounds the command (issue 32), from the process's start; writing and
    # explaining the plan get OUTPUT_RESERVE_S of it.
    ends_by = time.monotonic() - process_age_s() + time_limit - OUTPUT_RESERVE_S
    with progress_bar("planning", enabled=not as_json) as report:
        outcome = make_plan(
            name=plan_name,
            cluster=inputs.cluster,
            model=inputs.model,
            tables=tables,
            global_batch_size=global_batch_size,
            objective=objective,
            time_limit_s=time_limit,
            inputs=inputs.fingerprints,
            contingency=contingency,
            progress=report,
            recompute=recompute,
            zero1=zero1,
            shard_weights=shard_weights,
            measured_only=measured_only,
            ends_by=ends_by,
        )
    planned = outcome.plan
    # Say now, not at launch, when the built-in runtime cannot train this model.
    if (reason := unsupported_reason(inputs.model)) is not None:
        if not explain:  # --explain prints it with the plan's other notes: once
            typer.secho(f"note: {reason}", fg=typer.colors.YELLOW, err=True)
        planned = replace(planned, notes=(*planned.notes, reason))
    unchanged = _same_as_newest(planned, Path(out_dir))
    written, path = unchanged or write_plan(planned, out_dir)
    if unchanged is not None and not as_json:
        typer.echo(f"unchanged: {path} is this plan already (same inputs, same result)")
    sources = provenance(written, tables)
    if as_json:
        summary = summary_json(written, outcome.eval, inputs.cluster, str(path), sources=sources)
        typer.echo(json.dumps({**summary, "unchanged": unchanged is not None}))
        return
    if explain:
        typer.echo(explain_text(written, outcome.eval, inputs.cluster, sources=sources))
    ev = outcome.eval
    typer.echo(
        f"{'kept' if unchanged else 'wrote'} {path}: {ev.iteration_ms / 1e3:.3f} s/iteration, "
        f"{ev.tokens_per_s:,.0f} tokens/s"
    )


def _same_as_newest(planned: Plan, out_dir: Path) -> tuple[Plan, Path] | None:
    """The newest version of this plan's name when it is this plan (all but its version
    and creation time): planning twice from the same inputs (``make demo`` twice) keeps
    one version, not identical v1, v2, v3; a checkpoint's plan sha256 stays valid."""
    version = next_version(out_dir, planned.name) - 1
    path = out_dir / f"{planned.name}.v{version}.yaml"
    if version < 1 or not path.is_file():
        return None
    try:
        newest = load_plan(path)
    except AutohetError:
        return None  # not ours to judge here: a new version is written beside it

    def body(p: Plan) -> dict[str, object]:
        d = plan_to_dict(replace(p, version=0, created=""))
        solver = d.get("solver")
        if isinstance(solver, dict):  # how long the solve took is no part of the plan
            d["solver"] = {k: v for k, v in solver.items() if k != "time_s"}
        return d

    return (newest, path) if body(newest) == body(planned) else None


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
