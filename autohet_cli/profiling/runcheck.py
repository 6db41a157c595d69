"""Run the runtime on a freshly probed host and refit its profile (``profile run``'s
second phase; the shapes and why are in ``runshapes``).

Each shape is predicted with the profile as refitted so far, launched through
``launch.session.run_job`` (the same path as ``autohet launch``: preflight,
torchrun, watch, the rank-0 run report) for a few steps without checkpoints,
compared with its prediction (``launch.compare``) and absorbed by
``calibrate.calibrate``. A host without autohet installed cannot run the
runtime: the phase is skipped with a note, and the probe's profile is kept.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autohet_cli.cluster import Cluster, Host
from autohet_cli.errors import AutohetError
from autohet_cli.launch.preflight import PreflightError
from autohet_cli.launch.session import Prepared, run_job
from autohet_cli.models import ModelSpec
from autohet_cli.plan import Plan, write_plan
from autohet_cli.profiling.calibrate import calibrate, spread
from autohet_cli.profiling.runshapes import Shape, fits, predicted, shape_plan, shapes_for
from autohet_cli.profiling.schema import Profile
from autohet_cli.transport.pool import ConnectOptions, HostPool

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunCheckOptions:
    steps: int = 8  # the report's medians skip the first two
    budget_s: float = 120.0  # predicted seconds of training per run
    start_timeout_s: float = 300.0
    connect: ConnectOptions = ConnectOptions()


def choose_mbs(
    first: Shape, make: Callable[[Shape, int], Plan | str], candidates: Sequence[int]
) -> tuple[int | None, str]:
    """The largest micro-batch size the first (heaviest per device) shape runs at
    within memory and budget; else None and why each size was refused (``make``
    gives the predicted plan, or why not)."""
    reasons = []
    for mbs in sorted(set(candidates), reverse=True):
        why = make(first, mbs)
        if not isinstance(why, str):
            return mbs, ""
        reasons.append(f"micro-batch {mbs}: {why}")
    return None, "; ".join(reasons)


def check_host(
    host: Host,
    cluster: Cluster,
    model: ModelSpec,
    profile: Profile,
    *,
    seq_len: int,
    tps: Sequence[int],
    mbs_candidates: Sequence[int],
    options: RunCheckOptions,
    say: Say,
) -> tuple[Profile, list[dict[str, object]]]:
    """``profile`` refitted from runs on ``host`` and one record per shape (run,
    skipped or failed, with the predicted and measured step)."""
    entries = [e for k, e in profile.entries.items() if k.gpu_type == host.gpu_type]
    if not entries:
        return profile, []
    precision = entries[0].dtype
    measured = {(k.tensor_parallel, k.micro_batch_size) for k in profile.entries}
    shapes = shapes_for(model.num_layers, host.num_gpus, tps)
    shapes = [s for s in shapes if any((s.tp, m) in measured for m in mbs_candidates)]
    if not shapes:
        return profile, []

    def make(shape: Shape, mbs: int) -> Plan | str:
        if (shape.tp, mbs) not in measured:
            return f"TP {shape.tp} was not measured at this size (out of memory?)"
        plan = predicted(
            shape_plan(shape, model, host, mbs=mbs, seq_len=seq_len, precision=precision),
            cluster,
            current,
            model,
        )
        return fits(plan, options.steps, options.budget_s) or plan

    current = profile
    mbs, why = choose_mbs(shapes[0], make, [m for (t, m) in measured if t == 1])
    if mbs is None:
        say(f"runtime runs skipped: {why}")
        return profile, [{"shape": shapes[0].name, "status": "skipped", "why": why}]
    records: list[dict[str, object]] = []
    with (
        HostPool(cluster, options.connect) as pool,
        tempfile.TemporaryDirectory(prefix="autohet-runcheck-") as tmp,
    ):
        for shape in shapes:
            plan = make(shape, mbs)
            if isinstance(plan, str):
                records.append({"shape": shape.name, "status": "skipped", "why": plan})
                continue
            say(f"runtime run {shape.name} (micro-batch {mbs}): {shape.measures}")
            try:
                check = _run(plan, cluster, pool, Path(tmp), options, say)
                run_id = f"profile-run:{host.name}:{shape.name}:{check['run_id']}"
            except PreflightError as exc:
                say(f"runtime runs skipped: {exc}")
                records.append({"shape": shape.name, "status": "skipped", "why": str(exc)})
                break
            except AutohetError as exc:
                records.append({"shape": shape.name, "status": "failed", "why": str(exc)})
                continue
            current, _ = calibrate(
                current,
                check,
                model,
                run_id=run_id,
                global_batch_size=plan.training.global_batch_size,
            )
            step = check["step"]
            records.append(
                {
                    "shape": shape.name,
                    "status": "ran",
                    "micro_batch_size": mbs,
                    "predicted_step_ms": step["predicted_ms"],
                    "measured_step_ms": step["measured_ms"],
                }
            )
    if current is profile:
        return profile, records
    refit = spread(current, profile)
    return replace(refit, meta={**refit.meta, "runtime_runs": {host.name: records}}), records


def _run(
    plan: Plan,
    cluster: Cluster,
    pool: HostPool,
    tmp: Path,
    options: RunCheckOptions,
    say: Say,
) -> dict[str, Any]:
    """Launch one shape; its comparison with the prediction (``prediction-check.json``)."""
    _, plan_file = write_plan(plan, tmp / "plans")
    lines: list[str] = []

    def printer(line: str) -> None:
        lines.append(line)
        say(line.splitlines()[0][-80:] if line else line)

    prepared = Prepared(
        plan=plan, plan_file=plan_file, cluster=cluster, cluster_path="", remote_storage=None
    )
    rid = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
    outcome = run_job(
        prepared,
        pool,
        run_id=rid,
        train_args=[f"--steps={options.steps}", "--checkpoint-every=0"],
        start_timeout_s=options.start_timeout_s,
        runs_root=tmp / "runs",
        printer=printer,
    )
    check_file = Path(outcome.local_run_dir) / "prediction-check.json"
    if outcome.status != "finished" or not check_file.is_file():
        tail = "; ".join(lines[-3:])
        raise AutohetError(f"the {plan.name} run {outcome.status}: {outcome.detail or tail}")
    loaded: dict[str, Any] = json.loads(check_file.read_text(encoding="utf-8"))
    return {**loaded, "run_id": rid}
