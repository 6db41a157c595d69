"""`autohet estimate`: judge any plan file, ours or hand-written, by the same cost model."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.errors import ConfigError
from autohet_cli.inputs import load_inputs, tables_for
from autohet_cli.plan import check_against_cluster, load_plan
from autohet_cli.planner.explain import explain_text, summary_json


def estimate(
    plan_file: Annotated[
        str, typer.Argument(metavar="PLAN_FILE", help="A plan YAML (autohet.plan/v1)")
    ],
    cluster: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="Cluster file, or localhost (default: the one the plan names)",
        ),
    ] = None,
    profile: Annotated[
        list[str] | None,
        typer.Option(metavar="FILE", help="Profile file, repeatable (default: the plan's)"),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(metavar="MODEL", help="Zoo model or config.json (default: the plan's)"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Predict a plan's iteration time, tokens/s and per-GPU memory.

    Judges any plan file, one that plan wrote or one edited by hand, with the
    same cost model; nothing is solved. Stages marked `recompute: true` are
    costed with activation recomputation (marked R). Pass --cluster or --profile
    to ask how the plan would do on other hosts or with other measurements.

    Example:

    \b
      autohet estimate plans/paper-mix-OPT-350M.v1.yaml --json
    """
    plan = load_plan(plan_file)
    cpath = cluster or plan.inputs.get("cluster", {}).get("path")
    profiles = (
        profile
        if profile is not None
        else [v["path"] for k, v in plan.inputs.items() if k.startswith("profile")]
    )
    model_ref = model or plan.inputs.get("model", {}).get("path") or plan.model_name
    inputs = load_inputs(cpath, model_ref, profiles)
    for key, now in inputs.fingerprints.items():
        then = plan.inputs.get(key, {}).get("sha256")
        if then and now.get("sha256") and then != now["sha256"]:
            typer.secho(
                f"warning: {now.get('path')} changed since the plan was made "
                f"(sha256 differs from inputs.{key}); estimating with the current file",
                fg=typer.colors.YELLOW,
                err=True,
            )
    if inputs.model.num_layers != plan.num_layers:
        raise ConfigError(
            f"{plan_file}: model.num_layers is {plan.num_layers} but "
            f"{inputs.model.name} has {inputs.model.num_layers} layers"
        )
    check_against_cluster(
        plan, {h.name: (h.gpu_type, h.num_gpus) for h in inputs.cluster.hosts}, plan_file
    )
    ev = evaluate(
        plan.pipelines,
        inputs.cluster,
        tables_for(inputs, plan.training),
        plan.training.micro_batch_size,
    )
    if as_json:
        typer.echo(json.dumps(summary_json(plan, ev, inputs.cluster, plan_file)))
    else:
        typer.echo(explain_text(plan, ev, inputs.cluster, solved_now=False))
        if not ev.fits:
            typer.secho(
                "warning: at least one GPU runs out of memory under this plan",
                fg=typer.colors.YELLOW,
                err=True,
            )


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate)
