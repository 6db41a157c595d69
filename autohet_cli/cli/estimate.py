"""`autohet estimate`: judge any plan file, ours or hand-written, by the same cost model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from autohet_cli.costmodel.evaluate import PlanEval, evaluate
from autohet_cli.costmodel.pipeline import simulate_1f1b
from autohet_cli.errors import ConfigError
from autohet_cli.inputs import load_inputs, tables_for
from autohet_cli.plan import Plan, check_against_cluster, load_plan
from autohet_cli.planner.explain import explain_text, provenance, summary_json
from autohet_cli.trace import chrome_trace, predicted_spans


def estimate(
    plan_file: Annotated[
        str, typer.Argument(metavar="PLAN_FILE", help="A plan YAML (autohet.plan/v1)")
    ],
    cluster: Annotated[
        str | None,
        typer.Option(
            "--cluster",
            metavar="FILE",
            help="Cluster file, or localhost (default: the one the plan names)",
        ),
    ] = None,
    profile: Annotated[
        list[str] | None,
        typer.Option(
            "--profile", metavar="FILE", help="Profile file, repeatable (default: the plan's)"
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", metavar="MODEL", help="Zoo model or config.json (default: the plan's)"
        ),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            metavar="OUT.json",
            help="Also write the predicted 1F1B schedule as a Chrome/Perfetto trace (compare "
            "with the one `launch --train-arg=--trace` measures).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Predict a plan's iteration time, tokens/s and per-GPU memory.

    Judges any plan file, one that plan wrote or one edited by hand, with the
    same cost model; nothing is solved. Stages marked `recompute: true` are
    costed with activation recomputation (marked R). Stages whose times rest on
    unmeasured profile entries (analytic or calibrated) get a source column and
    a summary line. Pass --cluster or --profile to ask how the plan would do on
    other hosts or with other measurements.

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
    tables = tables_for(inputs, plan.training)
    ev = evaluate(plan.pipelines, inputs.cluster, tables, plan.training.micro_batch_size)
    sources = provenance(plan, tables)
    if trace is not None:
        write_trace(trace, predicted_trace(plan, ev))
    if as_json:
        typer.echo(json.dumps(summary_json(plan, ev, inputs.cluster, plan_file, sources=sources)))
    else:
        typer.echo(explain_text(plan, ev, inputs.cluster, solved_now=False, sources=sources))
        if not ev.fits:
            typer.secho(
                "warning: at least one GPU runs out of memory under this plan",
                fg=typer.colors.YELLOW,
                err=True,
            )


def predicted_trace(plan: Plan, ev: PlanEval) -> dict[str, Any]:
    """One predicted iteration: each pipeline's simulated 1F1B timeline, its sends,
    then gradient sync and the optimizer (and fixed per-step cost)."""
    timelines, sends, syncs, opts = [], [], [], []
    for p, pe in zip(plan.pipelines, ev.pipelines, strict=True):
        fwd = [st.cost.fwd_ms for st in pe.stages]
        bwd = [st.cost.bwd_ms for st in pe.stages]
        links = [st.send_ms for st in pe.stages[:-1]]
        sim = simulate_1f1b(fwd, bwd, p.num_microbatches, links, record_timeline=True)
        timelines.append(sim.timeline)
        sends.append(links)
        syncs.append([st.grad_sync_ms for st in pe.stages])
        opts.append([ev.optimizer_ms] * len(pe.stages))
    spans = predicted_spans(timelines, sends, syncs, opts, ev.pipeline_ms)
    return chrome_trace(spans, title=f"predicted: {plan.name}.v{plan.version}")


def write_trace(path: Path, trace: dict[str, Any]) -> None:
    if path.exists():
        raise ConfigError(f"{path}: already exists; choose another --trace file")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(trace), encoding="utf-8")
    tmp.replace(path)
    typer.echo(f"wrote {path}: open it in https://ui.perfetto.dev or chrome://tracing", err=True)


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate)
