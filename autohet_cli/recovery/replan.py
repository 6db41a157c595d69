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

This module runs the steps; each lives below it: ``survivors`` (the survivors, the
hosts added, the *kept* plan), ``contingency``, ``survivor_search`` (*solved*),
``stability`` and ``choice``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import InfeasibleError
from autohet_cli.limits import size_text
from autohet_cli.plan import Plan
from autohet_cli.planner.api import Planner, make_plan
from autohet_cli.planner.assemble import created_now
from autohet_cli.recovery.choice import (
    CONTINGENCY,
    KEPT,
    SOLVED,
    Candidate,
    candidate,
    choose,
    tradeoff,
)
from autohet_cli.recovery.contingency import from_contingency
from autohet_cli.recovery.errors import RecoveryError
from autohet_cli.recovery.locality import place_near_copies
from autohet_cli.recovery.manifest import Manifest
from autohet_cli.recovery.stability import (
    Stability,
    align_devices,
    layer_state_bytes,
    stability,
)
from autohet_cli.recovery.survivor_search import FIRST_SPACE_S, solve_on_survivors
from autohet_cli.recovery.survivors import added_hosts, keep_survivors, survivors_of, with_idle

# What callers import from here; each lives in the helper module named above.
__all__ = [
    "CONTINGENCY",
    "DEFAULT_TOLERANCE",
    "FIRST_SPACE_S",
    "KEPT",
    "SOLVED",
    "Candidate",
    "CopyHolders",
    "Replan",
    "Stability",
    "align_devices",
    "choose",
    "keep_survivors",
    "layer_state_bytes",
    "replan",
    "stability",
    "tradeoff",
]

DEFAULT_TOLERANCE = 0.05


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
    survivors = survivors_of(old, cluster, lost_t)
    added_t = tuple(sorted(added)) if added is not None else added_hosts(old, survivors)
    if tolerance < 0:
        raise RecoveryError(f"tolerance must be >= 0, got {tolerance}")
    layer_bytes = layer_state_bytes(tables) if tables is not None else None
    notes: list[str] = []
    candidates: list[Candidate] = []
    solved = False
    cont = from_contingency(old, survivors, lost_t, added_t, tables, notes)
    if cont is not None:
        near = _near_copies(cont[0], survivors, tables, copies, notes)
        aligned = with_idle(align_devices(old, near, layer_bytes), survivors)
        candidates.append(candidate(CONTINGENCY, old, aligned, cont[1], layer_bytes))
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
            outcome = solve_on_survivors(
                old, survivors, tables, planner, time_limit_s, contingency, kept
            )
        except InfeasibleError as exc:
            infeasible = exc
            notes.append(f"no plan solved on the survivors: {exc}")
        else:
            solved = True
            near = _near_copies(outcome.plan, survivors, tables, copies, notes)
            aligned = with_idle(align_devices(old, near, layer_bytes), survivors)
            assert aligned.prediction is not None
            time_s = aligned.prediction.iteration_time_s
            candidates.append(candidate(SOLVED, old, aligned, time_s, layer_bytes))
    if tables is not None:
        if kept is not None:
            assert kept.prediction is not None
            time_s = kept.prediction.iteration_time_s
            candidates.append(candidate(KEPT, old, kept, time_s, layer_bytes))
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
        created=created or created_now(),
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
class Replan:
    plan: Plan  # version 0, parent set: pass to write_plan
    chosen: str  # the kind of the chosen candidate
    candidates: tuple[Candidate, ...]
    solved: bool  # whether the planner ran
    lost: tuple[str, ...]
    added: tuple[str, ...]

    def candidate(self, kind: str) -> Candidate | None:
        return next((c for c in self.candidates if c.kind == kind), None)


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
