"""Render a plan and its evaluation for people (--explain) and scripts (--json) (pure).

Explain reads what the search produced and what the cost model says about it;
it never re-solves. Where each stage's numbers come from is ``planner.provenance``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.evaluate import PlanEval
from autohet_cli.plan import Plan, SolverInfo, weight_sharded
from autohet_cli.planner.explain_modes import (
    recompute_cell,
    recompute_count,
    recompute_line,
    shard_cell,
    shard_line,
    zero1_line,
)
from autohet_cli.planner.provenance import Provenance, provenance, source_lines, sources_json

__all__ = [
    "binding_constraints",
    "dollars_per_million_tokens",
    "explain_text",
    "price_per_hour",
    "provenance",  # planner.provenance's, imported from here by the commands
    "recompute_count",
    "recompute_line",
    "shard_line",
    "solver_lines",
    "source_lines",  # planner.provenance's
    "summary_json",
    "zero1_line",
]

GIB = float(1 << 30)


def explain_text(
    plan: Plan,
    ev: PlanEval,
    cluster: Cluster,
    *,
    solved_now: bool = True,
    sources: Provenance | None = None,
) -> str:
    """The plan for people; ``solved_now`` False when the plan is only re-estimated.
    With ``sources``, stages on unmeasured profile entries are marked (a source
    column, where a profile was given) and summed up in one line."""
    from tabulate import tabulate  # here: every plan imports this module, few explain

    marked = recompute_count(plan)[0] > 0  # an R column only where it says something
    sharded = weight_sharded(plan.pipelines)  # a shard column likewise
    # A source column only where some stage is unmeasured and a profile was given
    # (without one, a single line says that everything is analytic).
    by_stage = sources.stages if sources and sources.profiled and sources.unmeasured() else None
    lines = [
        f"Plan {plan.name} v{plan.version}: {plan.model_name}, global batch "
        f"{plan.training.global_batch_size} x seq {plan.training.seq_len}, micro-batch "
        f"{plan.training.micro_batch_size}, tensor parallel {_degrees(plan)}, "
        f"{len(plan.pipelines)} pipeline(s)",
        "",
    ]
    for first, last in _alike_runs(plan, ev):
        p, pe = plan.pipelines[first], ev.pipelines[first]
        title = (
            f"Pipeline {first}"
            if first == last
            else (
                f"Pipelines {first}-{last} ({last - first + 1} alike; devices of pipeline {first})"
            )
        )
        lines.append(
            f"{title}: {p.num_microbatches} micro-batches, {pe.time_ms:.1f} ms "
            f"(closed form {pe.closed_form_ms:.1f} ms), bubble {pe.idle_fraction:.0%}, "
            f"bottleneck stage {pe.bottleneck}"
        )
        rows = []
        for j, (s, se) in enumerate(zip(p.stages, pe.stages, strict=True)):
            gpus = ",".join(str(d.gpu) for d in s.devices)
            row: list[object] = [
                j,
                f"{s.host}:{gpus}",
                s.gpu_type,
                f"[{s.layer_start}, {s.layer_end})",
                f"{se.cost.fwd_ms:.1f}",
                f"{se.cost.bwd_ms:.1f}",
                f"{se.send_ms:.2f}",
                f"{se.mem_bytes / GIB:.1f}",
                f"{se.mem_fraction:.0%}",
                "*" if j == pe.bottleneck else "",
            ]
            if marked:
                row.append(recompute_cell(s))
            if sharded:
                row.append(shard_cell(s))
            if by_stage is not None:
                row.append(by_stage[first][j].label)
            rows.append(row)
        headers = [
            "stage",
            "devices",
            "gpu",
            "layers",
            "fwd ms",
            "bwd ms",
            "send ms",
            "mem GiB",
            "mem %",
            "slow",
        ]
        if marked:
            headers.append("recompute")
        if sharded:
            headers.append("shard")
        if by_stage is not None:
            headers.append("source")
        lines.append(tabulate(rows, headers=headers, tablefmt="simple"))
        lines.append("")
    tok = ev.tokens_per_s
    lines.append(
        f"Iteration {ev.iteration_ms / 1e3:.3f} s = pipelines {ev.pipeline_ms:.1f} ms + "
        f"gradient sync {ev.grad_sync_ms:.1f} ms + optimizer {ev.optimizer_ms:.1f} ms; "
        f"{tok:,.0f} tokens/s; peak memory {ev.memory_peak_fraction:.0%}"
    )
    lines += [
        x
        for x in (recompute_line(plan), shard_line(plan, cluster), zero1_line(plan))
        if x is not None
    ]
    if sources is not None:
        lines += source_lines(sources)
    price = price_per_hour(plan, cluster)
    per_m = dollars_per_million_tokens(plan, cluster, tok)
    if price > 0 and per_m is not None:
        lines.append(f"Cost: ${price:.2f}/hour for the hosts in use, ${per_m:.3f} per 1M tokens")
    lines.append("Binding: " + "; ".join(binding_constraints(plan, ev)))
    if plan.solver:
        lines += solver_lines(plan.solver, solved_now=solved_now, iteration_s=ev.iteration_ms / 1e3)
    if plan.baselines:
        lines.append("")
        rows = []
        for bname, t in plan.baselines.items():
            if t is None:
                rows.append([bname, "does not fit", "-"])
            else:
                rows.append([bname, f"{t:.3f}", f"{t / (ev.iteration_ms / 1e3):.2f}x"])
        lines.append(
            tabulate(rows, headers=["baseline", "iteration s", "plan speed-up"], tablefmt="simple")
        )
    for idle in plan.idle:
        lines.append(f"Idle: {idle['host']} GPUs {idle['gpus']}: {idle['reason']}")
    for note in plan.notes:
        lines.append(f"Note: {note}")
    return "\n".join(lines)


def summary_json(
    plan: Plan,
    ev: PlanEval,
    cluster: Cluster,
    plan_path: str | None,
    *,
    sources: Provenance | None = None,
) -> dict[str, Any]:
    solver: Mapping[str, Any] = {}
    if plan.solver:
        solver = {
            "status": plan.solver.status,
            "gap": plan.solver.gap,
            "time_s": plan.solver.time_s,
        }
    return {
        "plan_path": plan_path,
        "name": plan.name,
        "version": plan.version,
        "iteration_time_s": ev.iteration_ms / 1e3,
        "tokens_per_s": ev.tokens_per_s,
        "memory_peak_fraction": ev.memory_peak_fraction,
        "tensor_parallel": plan.tensor_parallel,
        "micro_batch_size": plan.training.micro_batch_size,
        "num_pipelines": len(plan.pipelines),
        "recompute_stages": recompute_count(plan)[0],
        "weight_sharded_stages": weight_sharded(plan.pipelines),
        "zero1": plan.training.zero1,
        "solver": dict(solver),
        "baselines": dict(plan.baselines),
        "price_per_hour": price_per_hour(plan, cluster),
        "dollars_per_million_tokens": dollars_per_million_tokens(plan, cluster, ev.tokens_per_s),
        "binding": binding_constraints(plan, ev),
        "idle": [dict(x) for x in plan.idle],
        "notes": list(plan.notes),  # what was decided, and what the time limit left out
        **(sources_json(plan, sources) if sources is not None else {}),
    }


def price_per_hour(plan: Plan, cluster: Cluster) -> float:
    """Hosts the plan uses are paid for; unused hosts can be released."""
    return sum(cluster.host(h).price_per_hour for h in plan.hosts())


def dollars_per_million_tokens(plan: Plan, cluster: Cluster, tokens_per_s: float) -> float | None:
    price = price_per_hour(plan, cluster)
    if price <= 0 or tokens_per_s <= 0:
        return None
    return price / 3600.0 / tokens_per_s * 1e6


def binding_constraints(plan: Plan, ev: PlanEval) -> list[str]:
    """What stops the plan from being faster, in the words an engineer uses."""
    out = []
    peak = ev.memory_peak_fraction
    if peak >= 0.85:
        out.append(
            f"memory: the fullest GPU is at {peak:.0%} of its card; more layers or "
            "micro-batches in flight would not fit"
        )
    times = [p.time_ms for p in ev.pipelines]
    if len(times) > 1:
        slow = max(range(len(times)), key=lambda i: times[i])
        per_mb = times[slow] / max(1, plan.pipelines[slow].num_microbatches)
        spread = max(times) - min(times)
        if spread > 0.5 * per_mb:
            out.append(
                f"batch granularity: pipelines finish {spread:.0f} ms apart but one "
                f"micro-batch costs ~{per_mb:.0f} ms, so no move of a micro-batch helps"
            )
    comm = ev.grad_sync_ms + max(
        (sum(st.send_ms for st in p.stages) * 2 for p in ev.pipelines), default=0.0
    )
    if comm > 0.15 * ev.iteration_ms:
        out.append(
            f"bandwidth: gradient sync and stage-to-stage sends take {comm:.0f} ms "
            f"of {ev.iteration_ms:.0f} ms"
        )
    if not out:
        out.append("compute: the bottleneck stages are busy; only faster GPUs would help")
    return out


def solver_lines(
    sv: SolverInfo, *, solved_now: bool = True, iteration_s: float | None = None
) -> list[str]:
    """What the search proved, in words that cannot be misread.

    SCIP's gap is about the chosen grouping only; the search gap compares the plan
    with a lower bound over every grouping, which is weak (it ignores most of the
    pipeline bubble), so it is stated as a ceiling, not as the distance to the
    optimum. ``solved_now`` is False for ``estimate``, which re-solves nothing and
    so reports no solve time of its own.
    """
    proof = (
        f"SCIP proved this grouping optimal (gap {sv.gap:.2%})"
        if sv.gap <= 1e-3
        else f"SCIP's gap on this grouping is {sv.gap:.2%}"
    )
    what = {
        "optimal": f"optimal: {proof}, and every other grouping was solved or ruled out "
        "by its lower bound",
        "heuristic": f"best of the groupings searched: {proof}; groupings a quick estimate "
        "judged slower were not solved",
        "time_limit": f"best found before the time limit: {proof}; not every grouping was "
        "searched (raise --time-limit to search more)",
        "baseline": "a baseline layout, not searched",
    }.get(sv.status, f"{sv.status}: {proof}")
    counts = (
        f"{_count(sv.groupings_explored, 'grouping')} solved, {sv.groupings_pruned} ruled "
        "out by their lower bound"
    )
    if solved_now:
        lines = [f"Solver: {what}. {sv.time_s:.2f} s, {counts}."]
    else:
        lines = [f"When planned: {what}."]
    if sv.search_gap > 5e-4 and sv.status != "baseline":
        floor = (
            f"{_duration((1 - sv.search_gap) * iteration_s)} (this plan: {_duration(iteration_s)})"
            if iteration_s is not None
            else f"{1 - sv.search_gap:.0%} of this plan's time"
        )
        lines.append(
            f"Bound: proven that no plan on this cluster runs an iteration in under {floor}. "
            "The proof is loose (it leaves out most of the pipeline bubble), so the best "
            "possible plan is likely much closer to this one than to that floor."
        )
    return lines


def _duration(s: float) -> str:
    """Three significant figures in the unit that reads best (1.215 s, 352 ms, 41.5 us)."""
    if s >= 1:
        return f"{s:.3f} s"
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _alike_runs(plan: Plan, ev: PlanEval) -> list[tuple[int, int]]:
    """Consecutive pipelines with the same layers, GPU types, batch share and time."""

    def signature(i: int) -> tuple[object, ...]:
        p = plan.pipelines[i]
        return (
            p.num_microbatches,
            round(ev.pipelines[i].time_ms, 6),
            tuple(
                (s.layer_start, s.layer_end, s.gpu_type, s.recomputed, shard_cell(s))
                for s in p.stages
            ),
        )

    runs: list[tuple[int, int]] = []
    for i in range(len(plan.pipelines)):
        if runs and signature(runs[-1][0]) == signature(i):
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _degrees(plan: Plan) -> str:
    """``2``, or the degree per GPU type (``1 on A100-40, 2 on V100-16``) where
    stages differ; ``per stage`` where one type has several."""
    if len(plan.tp_degrees) == 1:
        return str(plan.tp_degrees[0])
    by_type: dict[str, set[int]] = {}
    for p in plan.pipelines:
        for s in p.stages:
            by_type.setdefault(s.gpu_type, set()).add(s.tensor_parallel)
    if any(len(v) > 1 for v in by_type.values()):
        return "per stage (" + ", ".join(str(t) for t in plan.tp_degrees) + ")"
    return ", ".join(f"{next(iter(v))} on {g}" for g, v in by_type.items())
