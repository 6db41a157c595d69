"""The plan to resume on after losing hosts (pure).

Candidates
    *contingency*  The old plan's ``contingency`` entry for the lost host (written by
                   ``autohet plan --contingency``): used as is, no solving. Only for
                   exactly one lost host and no hosts added to the cluster file.
    *solved*       Otherwise the planner (``make_plan``) on ``cluster.without(lost)``
                   with the old plan's model and training settings.
    *kept*         Keep what survives: every pipeline untouched by the loss keeps its
                   devices and layers; a pipeline that lost a stage gets that stage on
                   free GPUs of the same type (spares, added hosts) or is dropped; the
                   global batch is re-shared over the pipelines left (cost model).

Stability
    The fraction of the new plan's (host, gpu, layer, TP rank, TP degree) placements
    that the old plan already had, weighted by each layer's state bytes (weights,
    gradients, optimizer state) / TP degree when the model is known. A kept placement
    means that state is already on that GPU's host, so it needs no transfer and no
    reshard. Solved and contingency plans are first relabelled (GPUs permuted within
    each host, which the cost model cannot tell apart) to keep as many placements as
    the same iteration time allows.

Choice
    Among the candidates, the most stable one whose predicted iteration time is
    within ``tolerance`` (default 5%) of the fastest wins; the trade-off is stated in
    the new plan's notes, e.g. "kept 83% of layer state in place at +2.1% iteration
    time". The new plan keeps the old name, has ``parent: <old plan path>`` and
    version 0: ``write_plan`` gives it the next version (writing is the caller's).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import AutohetError, InfeasibleError, TimeLimitReached
from autohet_cli.limits import size_text
from autohet_cli.models import ModelSpec
from autohet_cli.plan import (
    Device,
    Pipeline,
    Plan,
    SolverInfo,
    Stage,
    check_against_cluster,
    pipeline_from_dict,
)
from autohet_cli.planner.api import PlanOutcome, make_plan, with_predictions
from autohet_cli.recovery.errors import RecoveryError
from autohet_cli.recovery.locality import place_near_copies
from autohet_cli.recovery.manifest import Manifest

DEFAULT_TOLERANCE = 0.05
CONTINGENCY = "contingency"
SOLVED = "solved"
KEPT = "kept"
# The search in the old plan's space (``_solve``): seconds at most, whatever the limit.
FIRST_SPACE_S = 1.5


class Planner(Protocol):
    """What ``make_plan`` is to recovery (a stub in tests)."""

    def __call__(
        self,
        *,
        name: str,
        cluster: Cluster,
        model: ModelSpec,
        tables: CostTables,
        global_batch_size: int,
        objective: str = "time",
        time_limit_s: float = 60.0,
        inputs: Mapping[str, Mapping[str, str]] | None = None,
        contingency: bool = False,
        recompute: bool | None = None,
        with_baselines: bool = True,
        incumbent: tuple[tuple[Pipeline, ...], int] | None = None,
        zero1: bool | None = None,
        tp_candidates: Sequence[int] | None = None,
        mbs_candidates: Sequence[int] | None = None,
    ) -> PlanOutcome: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Stability:
    kept_placements: int
    total_placements: int
    kept_state_bytes: float
    total_state_bytes: float

    @property
    def fraction(self) -> float:
        """Kept share of state bytes (of placements when the model is unknown)."""
        if self.total_state_bytes > 0:
            return self.kept_state_bytes / self.total_state_bytes
        return self.kept_placements / self.total_placements if self.total_placements else 1.0

    @property
    def state_bytes_to_move(self) -> float:
        return self.total_state_bytes - self.kept_state_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    kind: str  # contingency | solved | kept
    plan: Plan
    iteration_time_s: float
    stability: Stability


@dataclass(frozen=True, slots=True, kw_only=True)
class Replan:
    plan: Plan  # version 0, parent set: pass to write_plan
    chosen: str  # the kind of the chosen candidate
    candidates: tuple[Candidate, ...]
    solved: bool  # whether the planner ran
    lost: tuple[str, ...]
    added: tuple[str, ...]

    def candidate(self, kind: str) -> Candidate | None:
        return next((c for c in self.candidates if c.kind == kind), None)


# --------------------------------------------------------------------- stability

_Key = tuple[str, int, int, int, int]  # host, gpu, layer, tp rank, tp degree


def _placements(plan: Plan) -> dict[_Key, int]:
    """Placement -> layer index, for every GPU and layer of the plan."""
    out: dict[_Key, int] = {}
    for p in plan.pipelines:
        for s in p.stages:
            for k, d in enumerate(s.devices):
                for layer in range(s.layer_start, s.layer_end):
                    out[(d.host, d.gpu, layer, k, s.tensor_parallel)] = layer
    return out


def layer_state_bytes(tables: CostTables) -> tuple[float, ...]:
    """Weights + gradients + optimizer state of each partitionable layer (whole, not per TP)."""
    per_param = tables.training.state_bytes_per_param
    return tuple(float(layer.num_params * per_param) for layer in tables.model.layers())


def stability(old: Plan, new: Plan, layer_bytes: Sequence[float] | None = None) -> Stability:
    """How much of ``new``'s placement ``old`` already had (see the module doc)."""
    before = _placements(old)
    after = _placements(new)
    kept = [key for key in after if key in before]

    def weight(key: _Key) -> float:
        return layer_bytes[key[2]] / key[4] if layer_bytes is not None else 0.0

    return Stability(
        kept_placements=len(kept),
        total_placements=len(after),
        kept_state_bytes=sum(weight(k) for k in kept),
        total_state_bytes=sum(weight(k) for k in after),
    )


def align_devices(old: Plan, new: Plan, layer_bytes: Sequence[float] | None = None) -> Plan:
    """``new`` with each host's GPU indices permuted to keep the most of ``old``'s
    placements. All GPUs of a host are alike to the cost model, so the predicted
    time does not change. Greedy matching on the overlap per (new GPU, old GPU)."""
    before: dict[tuple[str, int, int, int], set[int]] = {}
    for host, gpu, layer, k, tp in _placements(old):
        before.setdefault((host, layer, k, tp), set()).add(gpu)
    used: dict[str, set[int]] = {}
    overlap: dict[str, dict[tuple[int, int], float]] = {}
    for host, a, layer, k, tp in _placements(new):
        used.setdefault(host, set()).add(a)
        w = layer_bytes[layer] / tp if layer_bytes is not None else 1.0
        pairs = overlap.setdefault(host, {})
        for b in before.get((host, layer, k, tp), ()):
            pairs[(a, b)] = pairs.get((a, b), 0.0) + w
    mapping: dict[tuple[str, int], int] = {}
    for host, gpus in used.items():
        taken: dict[int, int] = {}
        for (a, b), _w in sorted(overlap.get(host, {}).items(), key=lambda x: (-x[1], x[0])):
            if a not in taken and b not in taken.values():
                taken[a] = b
        targets = set(taken.values())
        # Every index here exists on the host: the new plan's or the old plan's.
        pool = sorted((gpus | targets) - targets)
        rest = [a for a in sorted(gpus) if a not in taken]
        for a in rest:  # unmatched GPUs keep their index where it is free
            if a in pool:
                taken[a] = a
                pool.remove(a)
        for a in rest:
            if a not in taken:
                taken[a] = pool.pop(0)
        mapping.update({(host, a): b for a, b in taken.items()})
    return _map_devices(new, lambda d: Device(host=d.host, gpu=mapping[(d.host, d.gpu)]))


def _map_devices(plan: Plan, fn: Callable[[Device], Device]) -> Plan:
    pipelines = tuple(
        replace(
            p,
            stages=tuple(replace(s, devices=tuple(fn(d) for d in s.devices)) for s in p.stages),
        )
        for p in plan.pipelines
    )
    return replace(plan, pipelines=pipelines)


# --------------------------------------------------------------------- replan


def replan(
    old: Plan,
    cluster: Cluster,
    lost: Collection[str],
    *,
    old_path: str,
    tables: CostTables | None = None,
    added: Collection[str] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    planner: Planner = make_plan,
    time_limit_s: float = 30.0,
    contingency: bool = False,
    inputs: Mapping[str, Mapping[str, str]] | None = None,
    created: str | None = None,
    copies: CopyHolders | None = None,
) -> Replan:
    """The plan to resume on after losing ``lost`` (see the module doc).

    ``cluster`` is the cluster file as it is now (lost hosts may still be listed;
    hosts may have been added). ``tables`` are the cost tables of the old plan's
    inputs (model, profile, training settings); without them only the
    contingency entry can be used, as recorded. ``added`` names hosts new to the
    cluster; by default, hosts the old plan neither used nor listed as idle.
    ``copies``: the checkpoint to resume from and which survivors list each of its
    files; solved and contingency plans then run on the alike survivors that hold
    their files (``recovery.locality``).
    """
    lost_t = tuple(sorted(set(lost)))
    survivors = _survivors(old, cluster, lost_t)
    added_t = tuple(sorted(added)) if added is not None else _added(old, survivors)
    if tolerance < 0:
        raise RecoveryError(f"tolerance must be >= 0, got {tolerance}")
    layer_bytes = layer_state_bytes(tables) if tables is not None else None
    notes: list[str] = []
    candidates: list[Candidate] = []
    solved = False
    cont = _from_contingency(old, survivors, lost_t, added_t, tables, notes)
    if cont is not None:
        near = _near_copies(cont[0], survivors, tables, copies, notes)
        aligned = _with_idle(align_devices(old, near, layer_bytes), survivors)
        candidates.append(_candidate(CONTINGENCY, old, aligned, cont[1], layer_bytes))
    infeasible: InfeasibleError | None = None
    kept = keep_survivors(old, survivors, set(lost_t), tables) if tables is not None else None
    if cont is None:
        if tables is None:
            raise RecoveryError(
                f"plan {old.name}.v{old.version}: no usable contingency plan for losing "
                f"{', '.join(lost_t)} ({'; '.join(notes)}), and solving a new plan needs the "
                "plan's inputs (cluster, model, profile)"
            )
        try:
            outcome = _solve(old, survivors, tables, planner, time_limit_s, contingency, kept)
        except InfeasibleError as exc:
            infeasible = exc
            notes.append(f"no plan solved on the survivors: {exc}")
        else:
            solved = True
            near = _near_copies(outcome.plan, survivors, tables, copies, notes)
            aligned = _with_idle(align_devices(old, near, layer_bytes), survivors)
            assert aligned.prediction is not None
            time_s = aligned.prediction.iteration_time_s
            candidates.append(_candidate(SOLVED, old, aligned, time_s, layer_bytes))
    if tables is not None:
        if kept is not None:
            assert kept.prediction is not None
            time_s = kept.prediction.iteration_time_s
            candidates.append(_candidate(KEPT, old, kept, time_s, layer_bytes))
        else:
            notes.append("no pipeline survives whole or with spare GPUs for its lost stages")
    if not candidates:
        if infeasible is not None:
            raise RecoveryError(f"no plan fits the survivors of {', '.join(lost_t)}: {infeasible}")
        raise RecoveryError(f"no plan for the survivors of {', '.join(lost_t)}: {'; '.join(notes)}")
    chosen = choose(candidates, tolerance)
    # Hosts left out that the old plan did not use (an earlier wave's) were no loss now.
    header = f"recovered from the loss of {', '.join(h for h in lost_t if h in old.hosts())}"
    if added_t:
        header += f" (hosts added: {', '.join(added_t)})"
    notes = [header, tradeoff(chosen, candidates, tolerance), *notes]
    plan = replace(
        chosen.plan,
        name=old.name,
        version=0,
        parent=old_path,
        inputs=dict(inputs if inputs is not None else old.inputs),
        created=created or _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        notes=tuple(notes) + tuple(chosen.plan.notes),
        contingency=dict(chosen.plan.contingency) if chosen.kind == SOLVED else {},
    )
    plan.validate(f"recovered plan {plan.name}")
    return Replan(
        plan=plan,
        chosen=chosen.kind,
        candidates=tuple(candidates),
        solved=solved,
        lost=lost_t,
        added=added_t,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyHolders:
    """The checkpoint recover resumes from, and which survivors list each file."""

    manifest: Manifest
    holders: Mapping[str, Collection[str]]  # file -> surviving hosts listing it


def _near_copies(
    plan: Plan,
    survivors: Cluster,
    tables: CostTables | None,
    copies: CopyHolders | None,
    notes: list[str],
) -> Plan:
    """``plan`` on the alike survivors that hold its files (``recovery.locality``)."""
    if copies is None or tables is None:
        return plan

    def time_s(p: Plan) -> float:
        ev = evaluate(p.pipelines, survivors, tables, p.training.micro_batch_size)
        return ev.iteration_ms / 1e3

    placed = place_near_copies(plan, survivors, copies.manifest, copies.holders, time_s)
    if placed.renamed:
        notes.append(
            "stages placed on the survivors that hold their checkpoint files "
            f"({', '.join(f'{a} -> {b}' for a, b in sorted(placed.renamed.items()))}): "
            f"{size_text(placed.bytes_after)} to move instead of "
            f"{size_text(placed.bytes_before)}"
        )
    return placed.plan


def choose(candidates: Sequence[Candidate], tolerance: float) -> Candidate:
    """The most stable candidate within ``tolerance`` of the fastest (ties: faster)."""
    fastest = min(candidates, key=lambda c: c.iteration_time_s)
    limit = fastest.iteration_time_s * (1.0 + tolerance)
    near = [c for c in candidates if c.iteration_time_s <= limit]
    return max(near, key=lambda c: (round(c.stability.fraction, 9), -c.iteration_time_s))


def tradeoff(chosen: Candidate, candidates: Sequence[Candidate], tolerance: float) -> str:
    """One sentence: what the chosen plan keeps in place and what it costs or saves."""
    what = "layer state" if chosen.stability.total_state_bytes > 0 else "layer placements"
    kept = f"kept {chosen.stability.fraction:.0%} of {what} in place"
    others = [c for c in candidates if c is not chosen]
    if not others:
        return f"{chosen.kind} plan: {kept} ({chosen.iteration_time_s:.3f} s/iteration)"
    fastest = min(candidates, key=lambda c: c.iteration_time_s)
    if fastest is not chosen:
        delta = chosen.iteration_time_s / fastest.iteration_time_s - 1.0
        return (
            f"{chosen.kind} plan: {kept} at {delta:+.1%} iteration time "
            f"({chosen.iteration_time_s:.3f} s vs {fastest.iteration_time_s:.3f} s for the "
            f"{fastest.kind} plan, which kept {fastest.stability.fraction:.0%}; "
            f"tolerance {tolerance:.0%})"
        )
    stable = max(others, key=lambda c: c.stability.fraction)
    delta = stable.iteration_time_s / chosen.iteration_time_s - 1.0
    if stable.stability.fraction > chosen.stability.fraction:
        why = (
            f"the {stable.kind} plan would keep {stable.stability.fraction:.0%} in place but "
            f"is {delta:+.1%} slower ({stable.iteration_time_s:.3f} s; tolerance {tolerance:.0%})"
        )
    elif delta < 0.0005:  # "+0.0% slower" reads as a reason; there is none
        why = f"the {stable.kind} plan is as fast and keeps no more in place"
    else:
        why = f"the {stable.kind} plan is {delta:+.1%} slower and keeps no more in place"
    return f"{chosen.kind} plan: {kept} at {chosen.iteration_time_s:.3f} s/iteration; {why}"


def _objective(old: Plan) -> str:
    return old.solver.objective if old.solver is not None else "time"


def _survivors(old: Plan, cluster: Cluster, lost: tuple[str, ...]) -> Cluster:
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


def _added(old: Plan, survivors: Cluster) -> tuple[str, ...]:
    known = set(old.hosts()) | {str(x.get("host")) for x in old.idle}
    return tuple(sorted(h.name for h in survivors.hosts if h.name not in known))


def _candidate(
    kind: str, old: Plan, plan: Plan, time_s: float, layer_bytes: Sequence[float] | None
) -> Candidate:
    return Candidate(
        kind=kind,
        plan=plan,
        iteration_time_s=time_s,
        stability=stability(old, plan, layer_bytes),
    )


def _from_contingency(
    old: Plan,
    survivors: Cluster,
    lost: tuple[str, ...],
    added: tuple[str, ...],
    tables: CostTables | None,
    notes: list[str],
) -> tuple[Plan, float] | None:
    """The old plan's contingency entry for the lost host as a plan, if it applies."""
    if len(lost) != 1:
        notes.append(f"{len(lost)} hosts lost: contingency plans cover one lost host")
        return None
    host = lost[0]
    entry = old.contingency.get(host)
    if entry is None:
        notes.append(
            f"the old plan has no contingency entry for {host} (plan with --contingency "
            "to recover without solving)"
        )
        return None
    if added:
        notes.append(f"hosts were added ({', '.join(added)}): solved to use them")
        return None
    if entry.get("feasible") is not True:
        notes.append(f"the contingency plan for losing {host} is infeasible: {entry.get('reason')}")
        return None
    where = f"plan {old.name}.v{old.version}: contingency.{host}"
    try:
        plan, recorded_s = _plan_from_entry(old, entry, where)
        check_against_cluster(
            plan, {h.name: (h.gpu_type, h.num_gpus) for h in survivors.hosts}, where
        )
    except AutohetError as exc:
        notes.append(f"the contingency plan for losing {host} does not apply: {exc}")
        return None
    plan = replace(
        plan,
        solver=SolverInfo(status=CONTINGENCY, gap=0.0, time_s=0.0, objective=_objective(old)),
    )
    if tables is None:
        return _with_idle(plan, survivors), recorded_s
    ev = evaluate(plan.pipelines, survivors, tables, plan.training.micro_batch_size)
    if not ev.fits:
        notes.append(
            f"the contingency plan for losing {host} no longer fits in memory "
            f"(peak {ev.memory_peak_fraction:.0%} of a GPU)"
        )
        return None
    return _with_idle(with_predictions(plan, ev), survivors), ev.iteration_ms / 1e3


def _plan_from_entry(old: Plan, entry: Mapping[str, Any], where: str) -> tuple[Plan, float]:
    def need(key: str) -> Any:
        if key not in entry:
            raise RecoveryError(f"{where}: missing {key!r}")
        return entry[key]

    raw_pipes = need("pipelines")
    if not isinstance(raw_pipes, list):
        raise RecoveryError(f"{where}.pipelines: expected a list")
    pipelines = tuple(
        pipeline_from_dict(pv, f"{where}.pipelines[{i}]") for i, pv in enumerate(raw_pipes)
    )
    tp, mbs, time_s = need("tensor_parallel"), need("micro_batch_size"), need("iteration_time_s")
    if not isinstance(tp, int) or not isinstance(mbs, int) or not isinstance(time_s, int | float):
        raise RecoveryError(f"{where}: tensor_parallel, micro_batch_size, iteration_time_s")
    plan = replace(
        old,
        version=0,
        training=replace(old.training, micro_batch_size=mbs),
        tensor_parallel=tp,
        pipelines=pipelines,
        prediction=None,
        baselines={},
        idle=(),
        notes=(),
        contingency={},
    )
    plan.validate(where)
    return plan, float(time_s)


def _solve(
    old: Plan,
    survivors: Cluster,
    tables: CostTables,
    planner: Planner,
    time_limit_s: float,
    contingency: bool,
    kept: Plan | None,
) -> PlanOutcome:
    """The planner on the survivors, first in the old plan's space, then in full.

    Recovery time is solve time (issue 32: a replan in 2 s). The survivors are
    the old plan's hardware minus the lost hosts, so the old plan's choices, its
    TP degrees, micro-batch size, ZeRO-1 and whether any stage recomputes, still
    fit them best unless memory says otherwise: the first search keeps them, with
    no baselines, seeded with the survivors kept in place. Only when nothing fits
    that space does the full search run (every degree and size, ZeRO-1 and
    recomputation decided anew). ``autohet plan`` on the survivors' cluster
    searches everything, for a plan to move to at the next restart.

    The first search is anytime and gets ``FIRST_SPACE_S`` when it is seeded (the
    survivors could be kept; else it gets the whole limit, and so does a second try
    when the short one found nothing in time): its seed is a plan that runs, and
    SCIP takes the most promising groupings first, so the rest of a long limit
    bought nothing on the clusters measured (mix-64 and mix-256 minus a host:
    the same plans at 1.5 s as at 30 s, 1.8 s and 2.1 s in all, against 3.1 s and
    4.4 s)."""
    common: dict[str, Any] = {
        "name": old.name,
        "cluster": survivors,
        "model": tables.model,
        "tables": tables,
        "global_batch_size": old.training.global_batch_size,
        "objective": _objective(old),
        "time_limit_s": time_limit_s,
        "inputs": dict(old.inputs),
        "contingency": contingency,
        "with_baselines": False,
        "incumbent": None
        if kept is None
        else (tuple(kept.pipelines), kept.training.micro_batch_size),
    }
    recomputes = any(s.recompute for p in old.pipelines for s in p.stages)
    first: dict[str, Any] = {
        **common,
        "recompute": None if recomputes else False,
        "zero1": old.training.zero1,
        "tp_candidates": sorted({s.tensor_parallel for p in old.pipelines for s in p.stages}),
        "mbs_candidates": [old.training.micro_batch_size],
    }
    capped = kept is not None and time_limit_s > FIRST_SPACE_S  # a seed: anytime is safe
    try:
        try:
            return planner(**({**first, "time_limit_s": FIRST_SPACE_S} if capped else first))
        except TimeLimitReached:
            if not capped:
                raise
            return planner(**first)  # the short search found nothing in time: the whole limit
    except TimeLimitReached:
        raise  # out of time, not of memory: a wider search would not be faster
    except InfeasibleError:
        # The planner decides where memory binds, per stage and GPU type (an old
        # plan's flags were for other GPUs).
        return planner(**common, recompute=None)


def keep_survivors(
    old: Plan, survivors: Cluster, lost: Collection[str], tables: CostTables
) -> Plan | None:
    """The old plan minus what was lost (see *kept* in the module doc), or None.

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
    plan = replace(
        old,
        version=0,
        # the widest stage may have been on a lost host
        tensor_parallel=max(s.tensor_parallel for p in pipelines for s in p.stages),
        pipelines=tuple(pipelines),
        solver=SolverInfo(status=KEPT, gap=0.0, time_s=0.0, objective=_objective(old)),
        baselines={},
        idle=(),
        notes=(),
        contingency={},
    )
    return _with_idle(with_predictions(plan, ev), survivors)


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


def _with_idle(plan: Plan, cluster: Cluster) -> Plan:
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
