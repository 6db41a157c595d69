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
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autohet_cli.ckpt.format import new_key
from autohet_cli.cluster import Cluster, Host
from autohet_cli.errors import AutohetError
from autohet_cli.estimates.profile import Profile
from autohet_cli.launch.preflight import PreflightError
from autohet_cli.launch.session import JobChoice, Prepared, run_job
from autohet_cli.models import ModelSpec
from autohet_cli.plan import Plan, write_plan
from autohet_cli.profiling.calibrate import calibrate, carry_to_tp, spread
from autohet_cli.profiling.runshapes import Shape, fits, predicted, shape_plan, shapes_for
from autohet_cli.transport.pool import ConnectOptions, HostPool

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunCheckOptions:
    steps: int = 8  # the report's medians skip the first two
    budget_s: float = 120.0  # predicted seconds of training per run
    start_timeout_s: float = 300.0
    # A run still going this long after its start is stopped and recorded as failed:
    # the budget rests on the probe's prediction, which these runs exist to correct.
    run_timeout_s: float | None = None  # None: start_timeout_s + 5 x budget_s
    connect: ConnectOptions = ConnectOptions()


def choose_mbs(
    shapes: Sequence[Shape], make: Callable[[Shape, int], Plan | str], candidates: Sequence[int]
) -> tuple[int | None, str]:
    """The micro-batch size at which the most shapes run within memory and budget
    (the largest among equals); else None and why each size was refused (``make``
    gives the predicted plan, or why not)."""
    best: tuple[int, int] | None = None
    reasons = []
    for mbs in sorted(set(candidates), reverse=True):
        why = [w for w in (make(s, mbs) for s in shapes) if isinstance(w, str)]
        runnable = len(shapes) - len(why)
        if runnable and (best is None or runnable > best[0]):
            best = (runnable, mbs)
        if why and runnable == 0:
            reasons.append(f"micro-batch {mbs}: {why[0]}")
    if best is None:
        return None, "; ".join(reasons) or "no micro-batch size was measured"
    return best[1], ""


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
    stop: threading.Event | None = None,
) -> tuple[Profile, list[dict[str, object]]]:
    """``profile`` refitted from runs on ``host`` and one record per shape (run,
    skipped or failed, with the predicted and measured step), kept in its meta
    (``runtime_runs``) whatever happened. A run that fails leaves the profile as
    the runs before it refitted it."""
    mine = {
        (k.tensor_parallel, k.micro_batch_size): e
        for k, e in profile.entries.items()
        if k.gpu_type == host.gpu_type and k.model == model.name and k.seq_len == seq_len
    }
    records: list[dict[str, object]] = []

    def done(refit: Profile) -> tuple[Profile, list[dict[str, object]]]:
        if refit is not profile:
            refit = spread(refit, profile)
            ran = {r["shape"] for r in records if r["status"] == "ran"}
            unrun = [s.tp for s in shapes_for(model.num_layers, host.num_gpus, tps)
                     if s.tp > 1 and s.name not in ran]  # fmt: skip
            if unrun:
                refit = carry_to_tp(refit, profile, unrun)
                records.append(
                    {
                        "shape": ",".join(f"tp-{t}" for t in unrun),
                        "status": "carried",
                        "why": "no run of its own: its probe times are scaled by TP 1's refit",
                    }
                )
        return replace(refit, meta={**refit.meta, "runtime_runs": {host.name: records}}), records

    if not mine:
        records.append({"shape": "-", "status": "skipped", "why": "the probe measured nothing"})
        return done(profile)
    precision = next(iter(mine.values())).dtype
    shapes = shapes_for(model.num_layers, host.num_gpus, tps)
    current = profile

    def make(shape: Shape, mbs: int) -> Plan | str:
        if (shape.tp, mbs) not in mine:
            return f"TP {shape.tp} was not measured at micro-batch {mbs} (out of memory?)"
        try:
            plan = predicted(
                shape_plan(shape, model, host, mbs=mbs, seq_len=seq_len, precision=precision),
                cluster,
                current,
                model,
            )
        except AutohetError as exc:
            return f"cannot be predicted: {exc}"
        return fits(plan, options.steps, options.budget_s) or plan

    measured_mbs = sorted({m for _, m in mine} & set(mbs_candidates))
    mbs, why = choose_mbs(shapes, make, measured_mbs)
    if mbs is None:
        say(f"runtime runs skipped: {why}")
        records.append({"shape": shapes[0].name, "status": "skipped", "why": why})
        return done(profile)
    with (
        HostPool(cluster, options.connect) as pool,
        tempfile.TemporaryDirectory(prefix="autohet-runcheck-") as tmp,
    ):
        queue = list(shapes)
        while queue:
            shape = queue.pop(0)
            plan = make(shape, mbs)
            if stop is not None and stop.is_set():
                plan = "interrupted"
            if isinstance(plan, str):
                records.append({"shape": shape.name, "status": "skipped", "why": plan})
                continue
            say(f"runtime run {shape.name} (micro-batch {mbs}): {shape.measures}")
            try:
                check = _run(plan, cluster, pool, Path(tmp), options, say, stop)
                current, _ = calibrate(
                    current,
                    check,
                    model,
                    run_id=f"profile-run:{host.name}:{shape.name}:{check['run_id']}",
                    global_batch_size=plan.training.global_batch_size,
                )
            except PreflightError as exc:
                say(f"runtime runs skipped: {exc}")
                records.append({"shape": shape.name, "status": "skipped", "why": str(exc)})
                break
            except (AutohetError, KeyError, TypeError, ValueError) as exc:
                # A report from another autohet version, or a run that failed: the
                # profile keeps what the runs before this one refitted.
                records.append(
                    {
                        "shape": shape.name,
                        "status": "failed",
                        "micro_batch_size": mbs,
                        "why": _short(exc),
                    }
                )
                smaller = [m for m in measured_mbs if m < mbs]
                if _out_of_memory(exc) and smaller:
                    # The probe under-predicted memory (it times layers alone, not
                    # everything a training step holds): this and later shapes run at
                    # the next smaller size, so that their refit of memory (the type's
                    # overhead) keeps plans from the size that did not fit.
                    mbs = smaller[-1]
                    say(f"out of memory: runtime runs go on at micro-batch {mbs}")
                    queue.insert(0, shape)
                continue
            step = check["step"]
            records.append(
                {
                    "shape": shape.name,
                    "status": "ran",
                    "micro_batch_size": mbs,
                    "predicted_step_ms": step["predicted_ms"],
                    "measured_step_ms": step["measured_ms"],
                    # what the step took beyond its measured stage times: the fixed
                    # per-step cost calibration absorbs (0 where noise hides it)
                    "step_overhead_ms": check.get("step_overhead_ms"),
                    # torch.compile's seconds in the first step (None: eager); the
                    # measured step (medians after the first two) is the compiled one
                    "compile_s": check.get("compile_s"),
                }
            )
    return done(current)


_OOM = re.compile(r"outofmemoryerror|cuda out of memory|out of memory(?![?)])")


def _out_of_memory(exc: BaseException) -> bool:
    """Whether a run failed for want of device memory, as torch says it; not a worker
    killed by a signal, which triage only guesses may be memory ("out of memory?")."""
    return _OOM.search(str(exc).lower()) is not None


def _short(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, AutohetError) else f"{type(exc).__name__}: {exc}"
    return text[:500]


def _run(
    plan: Plan,
    cluster: Cluster,
    pool: HostPool,
    tmp: Path,
    options: RunCheckOptions,
    say: Say,
    stop: threading.Event | None = None,
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
    limit_s = options.run_timeout_s or options.start_timeout_s + 5 * options.budget_s
    local = threading.Event()  # set by the caller's stop or by the time limit
    timer = threading.Timer(limit_s, local.set)
    timer.daemon = True
    timer.start()
    finished = threading.Event()

    def follow() -> None:  # the caller's stop (Ctrl-C) stops this run too
        while stop is not None and not finished.wait(0.5):
            if stop.is_set():
                local.set()
                return

    threading.Thread(target=follow, daemon=True).start()
    try:
        outcome = run_job(
            prepared,
            pool,
            run_id=rid,
            # A measurement: no save at all, not even of the last step.
            train_args=[f"--steps={options.steps}", "--checkpoint-every=0", "--no-emergency-save"],
            start_timeout_s=options.start_timeout_s,
            runs_root=tmp / "runs",
            printer=printer,
            stop=local,
            job_choice=JobChoice(job=f"rc-{rid}", key=new_key()),
        )
    finally:
        timer.cancel()
        finished.set()
    check_file = Path(outcome.local_run_dir) / "prediction-check.json"
    interrupted = stop is not None and stop.is_set()
    if outcome.status != "finished" and local.is_set() and not interrupted:
        raise AutohetError(f"the {plan.name} run took over {limit_s:.0f} s and was stopped")
    if outcome.status != "finished" or not check_file.is_file():
        tail = "; ".join(lines[-3:])
        raise AutohetError(f"the {plan.name} run {outcome.status}: {outcome.detail or tail}")
    loaded: dict[str, Any] = json.loads(check_file.read_text(encoding="utf-8"))
    _clean(pool, plan, rid)
    return {**loaded, "run_id": rid, "compile_s": compile_seconds(lines)}


_COMPILED = re.compile(r"torch\.compile on(?:: ([\d.]+) s of the first step)?")


def compile_seconds(lines: Sequence[str]) -> float | None:
    """torch.compile's seconds in the run's first step, from rank 0's startup line
    (``runtime.startup``); 0.0 when compiled but not timed, None when eager."""
    for line in lines:
        if "startup:" in line and (found := _COMPILED.search(line)):
            return float(found.group(1) or 0.0)
    return None


def _clean(pool: HostPool, plan: Plan, rid: str) -> None:
    """Remove what a finished run left on its hosts: its run directory and its job's
    key directory (no checkpoints: it ran with --checkpoint-every 0 --no-emergency-save).
    A failed run's are kept, with its logs, for the user to read. The paths are ours alone (the
    plan name, a fresh run id and job), passed as arguments, never through a shell."""
    for host in plan.hosts():
        for path in (
            f"{pool.workdir(host).rstrip('/')}/runs/{plan.name}.v{plan.version}/{rid}",
            f"{pool.checkpoint_dir(host).rstrip('/')}/{plan.name}/rc-{rid}",
        ):
            try:
                pool.runner(host).run(["rm", "-rf", "--", path], timeout_s=60)
            except AutohetError:
                pass  # leftovers are harmless; the measurement is what matters
