"""`autohet profile run`: measure the GPUs of a cluster over SSH and write a profile."""

from __future__ import annotations

import json
import threading
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from autohet_cli.cluster import load_cluster
from autohet_cli.defaults import resolve_cluster_path
from autohet_cli.errors import ConfigError, ProfileError
from autohet_cli.models import get_model
from autohet_cli.profiling.run import (
    ProfileRunRequest,
    ProfileRunResult,
    measured_precision,
    run_profiling,
)
from autohet_cli.profiling.schema import load_profile, save_profile
from autohet_cli.settings import TrainingSettings

PLAN_PRECISION = TrainingSettings(global_batch_size=1, micro_batch_size=1, seq_len=1).precision


class Precision(StrEnum):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{option}: expected positive integers, got {text!r}")
    return values


def run(
    cluster: Annotated[
        Path,
        typer.Argument(
            metavar="CLUSTER",
            help="Cluster YAML or hostfile, or localhost (the embedded cluster of this machine)",
        ),
    ],
    model: Annotated[
        str, typer.Option("--model", metavar="MODEL", help="Zoo model or HF config.json to time")
    ],
    out: Annotated[
        Path,
        typer.Option(
            help="Profile to write; an existing one is merged "
            "into (new measurements win, other types kept)"
        ),
    ] = Path("profiles/measured.yaml"),
    tp: Annotated[str, typer.Option(help="TP degrees to time, e.g. 1,2,4,8")] = "1,2,4,8",
    micro_batch_sizes: Annotated[str, typer.Option(help="e.g. 1,2,4")] = "1,2,4",
    seq_len: Annotated[
        int | None, typer.Option(help="Tokens per sample (default: the model's)", min=1)
    ] = None,
    hosts: Annotated[str | None, typer.Option(help="Only these hosts, e.g. a100-0,v100-0")] = None,
    all_hosts: Annotated[
        bool, typer.Option("--all-hosts", help="Measure every host, not one per GPU type")
    ] = False,
    precision: Annotated[
        Precision,
        typer.Option(
            help="Precision to time the layers in. auto: bf16 on GPUs that compute it "
            "natively (Ampere and newer), fp16 on older ones, fp32 on CPU hosts (the "
            "runtime trains in fp32 on a CPU whatever a plan asks, so a CPU is measured "
            "in fp32 only). A plan uses an entry only at its own --precision (bf16 unless "
            "told), so measure in the precision you will plan in; measuring again in "
            "another replaces the entries it measures",
        ),
    ] = Precision.auto,
    timeout: Annotated[float, typer.Option(help="Seconds per host for the measurement")] = 900.0,
    accept_new_host_keys: Annotated[
        bool,
        typer.Option(
            "--accept-new-host-keys",
            help="Trust and record host keys seen for the first time (like ssh's accept-new); "
            "a changed key is always refused",
        ),
    ] = False,
    known_hosts: Annotated[
        Path | None, typer.Option(help="known_hosts file (default: ~/.ssh/known_hosts)")
    ] = None,
    runtime_runs: Annotated[
        bool,
        typer.Option(
            "--runtime-runs/--no-runtime-runs",
            help="After the probe, run the runtime itself for a few steps on each probed "
            "host (data parallel 2, each TP degree, 2 stages) and refit the profile from "
            "those runs: the per-step cost, stage-exchange latency, gradient-sync rate, TP "
            "as the runtime runs it and the memory it holds, which timing layers alone "
            "misses. Needs autohet installed on the host (skipped with a note if not)",
        ),
    ] = True,
    runtime_steps: Annotated[
        int, typer.Option(help="Steps per runtime run (medians skip the first 2)", min=3)
    ] = 8,
    runtime_budget: Annotated[
        float,
        typer.Option(
            help="Seconds of predicted training per runtime run: the largest measured "
            "micro-batch size within it is used",
            min=1.0,
        ),
    ] = 120.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Measure each GPU type of CLUSTER over SSH for MODEL.

    Copies a small probe to one host per GPU type (a localhost host runs
    locally), times the model's layers at each TP degree and micro-batch size
    that fits, measures matmul TFLOP/s and memory bandwidth, and writes a
    profile that autohet plan --profile reads. Measurements are filed under each
    host's GPU type as the cluster file names it, so a type the file defines
    under gpu_types: is measured like a catalog one.

    Then (unless --no-runtime-runs) it launches a few short runs of the
    runtime on each probed host and refits the profile from them, so that
    plans predict what the runtime really does (entries become "calibrated";
    autohet profile calibrate does the same from any launched run later).

    Example (then: autohet plan --profile profiles/measured.yaml ...):

    \b
      autohet profile run profiles/clusters/lab-mix.yaml --model OPT-350M
    """
    spec = get_model(model)
    req = ProfileRunRequest(
        cluster=load_cluster(resolve_cluster_path(cluster)),
        model=spec,
        seq_len=spec.default_seq_len if seq_len is None else seq_len,
        tps=_ints(tp, "--tp"),
        micro_batch_sizes=_ints(micro_batch_sizes, "--micro-batch-sizes"),
        hosts=[h for h in (hosts or "").split(",") if h],
        all_hosts=all_hosts,
        timeout_s=timeout,
        known_hosts=known_hosts,
        accept_new_host_keys=accept_new_host_keys,
        runtime_runs=runtime_runs,
        runtime_steps=runtime_steps,
        runtime_budget_s=runtime_budget,
        precision=precision.value,
    )
    result = _with_live_view(req, enabled=not as_json)
    if result.profile is None:
        raise ProfileError(
            "no host could be profiled: " + "; ".join(f"{o.host}: {o.error}" for o in result.failed)
        )
    merged = load_profile(out).merged_with(result.profile) if out.exists() else result.profile
    save_profile(merged, out, overwrite=True)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "profile_path": str(out),
                    "precision": precision.value,  # as asked; each host's as measured
                    "hosts": {
                        o.host: {
                            "ok": o.error is None,
                            "seconds": round(o.seconds, 3),
                            "error": o.error,
                            "precision": measured_precision(o),
                        }
                        for o in result.outcomes
                    },
                    "network": result.profile.meta.get("network", []),
                    "runtime_runs": result.profile.meta.get("runtime_runs", {}),
                }
            )
        )
    else:
        for link in result.profile.meta.get("network", []):
            pair = " <-> ".join(link["hosts"])
            figure = f"{link['gbps']} Gbit/s" if "gbps" in link else f"failed: {link['error']}"
            typer.echo(f"network {pair}: {figure}")
        for host, records in result.profile.meta.get("runtime_runs", {}).items():
            for i, r in enumerate(records):
                retried = [
                    later for later in records[i + 1 :]
                    if later.get("shape") == r.get("shape") and later.get("status") == "ran"
                ]  # fmt: skip
                if r.get("status") == "ran":
                    typer.echo(f"{host}: runtime run {_run_line(r)}")
                elif r.get("status") == "carried":
                    typer.echo(f"{host}: {r.get('shape')}: {r.get('why')}")
                elif retried:
                    typer.secho(
                        f"{host}: runtime run {_run_line(r)}; ran again at micro-batch "
                        f"{retried[0].get('micro_batch_size')}",
                        fg=typer.colors.YELLOW,
                        err=True,
                    )
                else:  # the probe's profile is kept: say what it lacks and why
                    typer.secho(
                        f"{host}: runtime run {_run_line(r)}; the profile keeps the probe's "
                        "numbers there (autohet profile calibrate RUN_DIR refits them from "
                        "any launched run)",
                        fg=typer.colors.YELLOW,
                        err=True,
                    )
        for o in result.failed:
            typer.secho(f"{o.host}: {o.error}", fg=typer.colors.RED, err=True)
        typer.echo(
            f"wrote {out}: {len(result.outcomes) - len(result.failed)} host(s) measured, "
            f"{len(result.failed)} failed"
        )
        for note in precision_notes(result):
            typer.secho(f"note: {note}", fg=typer.colors.YELLOW, err=True)
    if result.failed:
        raise typer.Exit(1)


def precision_notes(result: ProfileRunResult) -> list[str]:
    """Per precision measured other than a plan's default, the --precision that uses
    it: without it the plan calls these entries unmeasured (issue 46)."""
    by_dtype: dict[str, list[str]] = {}
    for o in result.outcomes:
        dtype = measured_precision(o)
        if dtype is not None and dtype != PLAN_PRECISION and "," not in dtype:
            by_dtype.setdefault(dtype, []).append(o.host)
    return [
        f"{', '.join(hosts)} measured in {dtype}: plan with --precision {dtype} to use "
        f"these entries (autohet plan asks {PLAN_PRECISION} unless told)"
        for dtype, hosts in by_dtype.items()
    ]


def _run_line(r: dict[str, object]) -> str:
    if r.get("status") != "ran":
        return f"{r.get('shape')}: {r.get('status')} ({r.get('why')})"
    pred, meas = r.get("predicted_step_ms"), r.get("measured_step_ms")
    if not isinstance(pred, int | float) or not isinstance(meas, int | float) or meas <= 0:
        return f"{r.get('shape')}: ran"
    compiled = r.get("compile_s")
    how = (
        f"measured compiled ({compiled:.1f} s of torch.compile in its first step)"
        if isinstance(compiled, int | float) and compiled > 0
        else "measured compiled"
        if compiled is not None
        else "measured"
    )
    return (
        f"{r.get('shape')} (micro-batch {r.get('micro_batch_size')}): step predicted by the "
        f"probe {pred:.1f} ms, {how} {meas:.1f} ms (x{pred / meas:.2f}); refitted"
    )


def _with_live_view(req: ProfileRunRequest, *, enabled: bool) -> ProfileRunResult:
    """One row per host (status, last line, seconds) while the probes run."""
    rows: dict[str, tuple[str, float]] = {}
    lock = threading.Lock()
    start = time.monotonic()

    def on_event(host: str, what: str) -> None:
        with lock:
            rows[host] = (what, time.monotonic() - start)

    def render() -> Table:
        table = Table(title=f"profiling {req.model.name} on {req.cluster.name}")
        for col in ("host", "status", "s"):
            table.add_column(col)
        with lock:
            for host, (what, at) in sorted(rows.items()):
                # Text, not markup: remote output like "[/tmp/x]" must print as is.
                table.add_row(Text(host), Text(what), f"{at:.0f}")
        return table

    if not enabled:
        return run_profiling(req)
    with Live(
        get_renderable=render, console=Console(stderr=True), refresh_per_second=4, transient=False
    ):
        return run_profiling(req, on_event)
