"""What survives a loss: the survivors' cluster, the hosts added since the old plan,
and the old plan kept on them (*kept* in ``recovery.replan``) (pure)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.plan import Device, Pipeline, Plan, SolverInfo, Stage
from autohet_cli.planner.assemble import with_predictions
from autohet_cli.recovery.choice import KEPT
from autohet_cli.recovery.errors import RecoveryError


def survivors_of(old: Plan, cluster: Cluster, lost: tuple[str, ...]) -> Cluster:
    """``cluster`` without ``lost``, once the loss is one ``old`` can recover from."""
    if not lost:
        raise RecoveryError("no lost host given; nothing to recover")
    hit = [h for h in lost if h in old.hosts()]
    if not hit:
        raise RecoveryError(
            f"plan {old.name}.v{old.version} uses none of {', '.join(lost)} "
            f"(it runs on {', '.join(old.hosts())}); nothing to recover"
        )
    keep = {h.name for h in cluster.hosts} - set(lost)
    if not keep:
        raise RecoveryError(f"every host of cluster {cluster.name!r} is lost")
    survivors = cluster.without(set(lost))
    gone = [h for h in old.hosts() if h not in lost and h not in keep]
    if gone:
        raise RecoveryError(
            f"plan {old.name}.v{old.version} runs on {', '.join(gone)}, which the cluster file "
            f"no longer lists; name them as lost or restore them in the cluster file"
        )
    return survivors


def added_hosts(old: Plan, survivors: Cluster) -> tuple[str, ...]:
    """Survivors the old plan neither used nor listed as idle."""
    known = set(old.hosts()) | {str(x.get("host")) for x in old.idle}
    return tuple(sorted(h.name for h in survivors.hosts if h.name not in known))


def keep_survivors(
    old: Plan, survivors: Cluster, lost: Collection[str], tables: CostTables
) -> Plan | None:
    """The old plan minus what was lost (see *kept* in ``recovery.replan``), or None.

    Pipelines untouched by the loss stay as they are. A pipeline that lost stages
    gets each on free GPUs of the same type and count on one surviving host
    (preferring hosts the pipeline already uses), or is dropped. The global batch
    is then shared over the pipelines left by water-filling on the simulator's
    pipeline times (each next micro-batch to the pipeline that finishes first).
    """
    gone = set(lost)
    busy = {(d.host, d.gpu) for d in old.devices() if d.host not in gone}
    free = {
        h.name: [g for g in range(h.num_gpus) if (h.name, g) not in busy] for h in survivors.hosts
    }
    kept: list[Pipeline] = []
    for p in old.pipelines:
        if all(s.host not in gone for s in p.stages):
            kept.append(p)
            continue
        trial = {h: list(v) for h, v in free.items()}
        prefer = [s.host for s in p.stages if s.host not in gone]
        stages: list[Stage] = []
        for s in p.stages:
            devices = s.devices if s.host not in gone else _spare(s, trial, survivors, prefer)
            if devices is None:
                break
            stages.append(replace(s, devices=devices, predicted=None) if s.host in gone else s)
        else:
            free = trial
            kept.append(replace(p, stages=tuple(stages)))
    mbs = old.training.micro_batch_size
    total = old.training.global_batch_size // mbs
    if not kept or len(kept) > total:
        return None
    shares = _water_fill(kept, total, survivors, tables, mbs)
    pipelines = [replace(p, num_microbatches=m) for p, m in zip(kept, shares, strict=True)]
    ev = evaluate(pipelines, survivors, tables, mbs)
    if not ev.fits:
        return None
    plan = derived_plan(
        old,
        # the widest stage may have been on a lost host
        tensor_parallel=max(s.tensor_parallel for p in pipelines for s in p.stages),
        pipelines=tuple(pipelines),
        solver=unsolved(KEPT, old),
    )
    return with_idle(with_predictions(plan, ev), survivors)


def derived_plan(old: Plan, **changes: Any) -> Plan:
    """``old`` with ``changes``, as the start of a new version: version 0 and none of
    what was the old plan's alone (its baselines, idle list, notes, contingency)."""
    return replace(old, version=0, baselines={}, idle=(), notes=(), contingency={}, **changes)


def unsolved(kind: str, old: Plan) -> SolverInfo:
    """The solver record of a plan recovery made without solving (``kind``)."""
    return SolverInfo(status=kind, gap=0.0, time_s=0.0, objective=objective_of(old))


def objective_of(old: Plan) -> str:
    return old.solver.objective if old.solver is not None else "time"


def with_idle(plan: Plan, cluster: Cluster) -> Plan:
    """The plan's idle list recomputed for its devices, keeping recorded reasons."""
    reasons = {str(x.get("host")): str(x.get("reason", "")) for x in plan.idle}
    used: dict[str, set[int]] = {}
    for d in plan.devices():
        used.setdefault(d.host, set()).add(d.gpu)
    idle: list[Mapping[str, Any]] = []
    for h in cluster.hosts:
        gpus = [g for g in range(h.num_gpus) if g not in used.get(h.name, set())]
        if gpus:
            why = reasons.get(h.name) or "not used by the recovered plan"
            idle.append({"host": h.name, "gpus": gpus, "reason": why})
    return replace(plan, idle=tuple(idle))


def _spare(
    s: Stage, free: dict[str, list[int]], cluster: Cluster, prefer: Sequence[str]
) -> tuple[Device, ...] | None:
    order = list(dict.fromkeys([*prefer, *(h.name for h in cluster.hosts)]))
    for name in order:
        host = cluster.host(name)
        if host.gpu_type == s.gpu_type and len(free[name]) >= s.tensor_parallel:
            gpus, free[name] = free[name][: s.tensor_parallel], free[name][s.tensor_parallel :]
            return tuple(Device(host=name, gpu=g) for g in gpus)
    return None


def _water_fill(
    pipelines: Sequence[Pipeline], total: int, cluster: Cluster, tables: CostTables, mbs: int
) -> list[int]:
    """Micro-batches per pipeline minimising the slowest pipeline's simulated time
    (optimal for per-pipeline times that grow with their micro-batch count)."""

    def time_ms(i: int, m: int) -> float:
        p = replace(pipelines[i], num_microbatches=m)
        return evaluate([p], cluster, tables, mbs).pipelines[0].time_ms

    shares = [1] * len(pipelines)
    nxt = [time_ms(i, 2) for i in range(len(pipelines))]
    for _ in range(total - len(pipelines)):
        i = min(range(len(pipelines)), key=lambda j: (nxt[j], j))
        shares[i] += 1
        nxt[i] = time_ms(i, shares[i] + 1)
    return shares
