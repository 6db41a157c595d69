"""`autohet profile calibrate`: refit a profile from a launched run (``profiling.calibrate``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from tabulate import tabulate

from autohet_cli.errors import ConfigError
from autohet_cli.models import get_model
from autohet_cli.plan import load_plan
from autohet_cli.profiling.calibrate import calibrate, left_out
from autohet_cli.profiling.schema import Profile, load_profile, save_profile

CHECK_FILE = "prediction-check.json"


def calibrate_command(
    run_dir: Annotated[
        Path,
        typer.Argument(
            metavar="RUN_DIR",
            help="A finished launch's local run directory (runs/PLAN.vN/RUN_ID), holding "
            f"{CHECK_FILE}.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Profile file to write (new).")],
    profile: Annotated[
        Path | None,
        typer.Option(help="Profile the plan was made with. [default: none, analytic]"),
    ] = None,
    plan_file: Annotated[
        Path | None,
        typer.Option(
            "--plan",
            help="The plan that ran. [default: the newest plans/PLAN.vN.yaml named by the run]",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the refit as JSON.")] = False,
) -> None:
    """Refit a profile to what a run measured, so the next plan predicts it.

    Per GPU type, TP degree and micro-batch size the run used, forward, backward
    and optimizer times are scaled to the measured ones (entries marked
    calibrated); the fixed per-step cost and the memory beyond the model's
    prediction become the GPU type's overheads. Plan again with --profile OUT.

    \b
      autohet launch plans/lab.v1.yaml --steps 20
      autohet profile calibrate runs/lab.v1/20261124T101500Z \\
          --profile profiles/lab.yaml --out profiles/lab-cal.yaml
      autohet plan --cluster lab.yaml --model OPT-350M \\
          --global-batch-size 64 --profile profiles/lab-cal.yaml
    """
    check_path = run_dir / CHECK_FILE
    try:
        check = json.loads(check_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{check_path}: not found; calibrate from the run directory of a launch that "
            "finished (launch prints it)"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{check_path}: unreadable: {exc}") from None
    if out.exists():
        raise ConfigError(f"{out}: already exists; choose another --out")
    plan = load_plan(plan_file or _plan_of(run_dir, check))
    base = load_profile(profile) if profile else Profile()
    model = plan.architecture or get_model(plan.model_name)
    try:
        refit, rows = calibrate(
            base,
            check,
            model,
            run_id=str(run_dir.resolve()),
            global_batch_size=plan.training.global_batch_size,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # edited or foreign
        what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ConfigError(
            f"{check_path}: not a prediction check this autohet reads ({what}); calibrate "
            "from the file a launch of this version wrote, unedited"
        ) from None
    save_profile(refit, out)
    why = [left_out(st) for st in check.get("stages") or []]
    sharded, partial = why.count("sharded"), why.count("partial")
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "ok": True,
                    "out": str(out),
                    "refit": rows,
                    "sharded_stages_left_out": sharded,
                    "partial_recompute_stages_left_out": partial,
                    **_overheads(refit),
                }
            )
        )
        return
    typer.echo(
        tabulate(
            [
                [r["gpu_type"], r["tensor_parallel"], r["micro_batch_size"], r["was"]]
                + ["yes" if r["recompute"] else "no"]
                + [f"{r[k]:.3f}" for k in ("fwd_x", "bwd_x", "update_x")]
                for r in rows
            ],
            headers=["gpu", "tp", "mbs", "was", "recompute", "fwd x", "bwd x", "update x"],
        )
    )
    for gpu, o in _overheads(refit)["overheads"].items():
        typer.echo(
            f"{gpu}: fixed cost {o['step_ms']:.2f} ms per step, {o['mem_bytes'] / 2**20:.0f} "
            f"MiB beyond the model (mean of {o['runs']} run(s))"
        )
    if sharded:
        fitted = {g: o.shard_x for g, o in refit.overheads.items() if o.shard_x != 1.0}
        what = ", ".join(f"{g} {x:.2f}x" for g, x in sorted(fitted.items())) or "not refitted"
        typer.echo(
            f"note: {sharded} weight-sharded stage(s) left out of the layer fits (their "
            "times include FSDP's gathers and reduce-scatters); they refit those "
            f"collectives' time against the model's instead (shard_x: {what})"
        )
    if partial:
        typer.echo(
            f"note: {partial} stage(s) recomputing only their first layers left out (one "
            "time mixes recomputed and plain layers, which neither fit can take apart)"
        )
    typer.echo(f"wrote {out}: plan with --profile {out}")


def _overheads(p: Profile) -> dict[str, Any]:
    return {
        "overheads": {
            g: {
                "step_ms": o.step_ms,
                "mem_bytes": o.mem_bytes,
                "runs": o.runs,
                "shard_x": o.shard_x,
            }
            for g, o in sorted(p.overheads.items())
        }
    }


def _plan_of(run_dir: Path, check: dict[str, Any]) -> Path:
    """``plans/NAME.vN.yaml`` for a run of NAME.vN, looked up beside ``runs/``."""
    ref = str(check.get("plan") or "")
    recorded = Path(str(check.get("plan_file") or ""))
    if recorded.name and recorded.is_file():
        return recorded
    for root in (run_dir.resolve().parents[2] / "plans", Path("plans")):
        candidate = root / f"{ref}.yaml"
        if ref and candidate.is_file():
            return candidate
    raise ConfigError(f"cannot find the plan file of run {ref or run_dir}: pass --plan FILE")
