"""Render a plan and its evaluation for people (--explain) and scripts (--json) (pure).

Explain reads what the search produced and what the cost model says about it;
it never re-solves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.evaluate import PlanEval
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.plan import Plan, SolverInfo
from autohet_cli.planner.precision import (
    advice,
    cpu_advice,
    measurable,
    measured_as,
    precision_flag,
)

GIB = float(1 << 30)
MEASURED_SOURCES = ("measured", "sailor")


@dataclass(frozen=True, slots=True, kw_only=True)
class EntrySource:
    """Where the cost model's numbers for one (GPU type, TP, micro-batch size) come
    from: ``measured``, ``sailor``, ``calibrated`` (an estimate scaled to the
    measurement at ``anchor``, its (TP, micro-batch size)) or ``analytic``.
    ``measured_precision``: the profile measured this very combination, but in
    another precision than the plan's; ``anchor_precision``: the anchor's, where
    it is not the plan's."""

    gpu_type: str
    tensor_parallel: int
    micro_batch_size: int
    source: str
    anchor: tuple[int, int] | None = None
    measured_precision: str | None = None
    anchor_precision: str | None = None

    @property
    def from_runs(self) -> bool:
        """A stored calibrated entry: refitted to measured runs (profile calibrate)."""
        return self.source == "calibrated" and self.anchor is None

    @property
    def measured(self) -> bool:
        return self.source in MEASURED_SOURCES or self.from_runs

    @property
    def label(self) -> str:
        if self.from_runs:
            return "calibrated from runs"
        if self.anchor is None:
            return self.source
        dtype = f" in {self.anchor_precision}" if self.anchor_precision else ""
        return f"calibrated from tp={self.anchor[0]} mbs={self.anchor[1]}{dtype}"

    @property
    def combination(self) -> str:
        return f"{self.gpu_type} tp{self.tensor_parallel} mbs{self.micro_batch_size}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_type": self.gpu_type,
            "tensor_parallel": self.tensor_parallel,
            "micro_batch_size": self.micro_batch_size,
            "source": self.source,
            "measured_precision": self.measured_precision,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Provenance:
    """The source of every stage's times (per pipeline, per stage), as the cost
    tables the plan was judged with say; ``profiled`` is False when no profile
    entry was given at all (every time is then analytic)."""

    stages: tuple[tuple[EntrySource, ...], ...]
    profiled: bool
    model_ref: str  # what `autohet profile run --model` takes for this model
    seq_len: int | None  # for --seq-len, when not the model's default
    model_name: str
    precision: str  # the plan's

    def unmeasured(self) -> list[EntrySource]:
        """Distinct unmeasured combinations, in stage order."""
        return list(dict.fromkeys(e for p in self.stages for e in p if not e.measured))

    def num_unmeasured_stages(self) -> int:
        return sum(not e.measured for p in self.stages for e in p)


def provenance(plan: Plan, tables: CostTables) -> Provenance:
    """Look up the entry behind each stage of ``plan`` (its micro-batch size, each
    stage's GPU type and TP degree) in ``tables``."""
    mbs = plan.training.micro_batch_size
    seen: dict[tuple[str, int], EntrySource] = {}
    for s in (s for p in plan.pipelines for s in p.stages):
        key = (s.gpu_type, s.tensor_parallel)
        if key not in seen:
            anchor = tables.calibration_anchor(s.gpu_type, s.tensor_parallel, mbs)
            seen[key] = EntrySource(
                gpu_type=s.gpu_type,
                tensor_parallel=s.tensor_parallel,
                micro_batch_size=mbs,
                source=tables.entry(s.gpu_type, s.tensor_parallel, mbs).source,
                anchor=None
                if anchor is None
                else (anchor.key.tensor_parallel, anchor.key.micro_batch_size),
                measured_precision=measured_as(tables, s.gpu_type, s.tensor_parallel, mbs),
                anchor_precision=None
                if anchor is None or anchor.dtype == tables.training.precision
                else anchor.dtype,
            )
    seq_len = tables.training.seq_len
    return Provenance(
        stages=tuple(
            tuple(seen[(s.gpu_type, s.tensor_parallel)] for s in p.stages) for p in plan.pipelines
        ),
        profiled=bool(tables.profile.entries),
        model_ref=plan.inputs.get("model", {}).get("path") or plan.model_name,
        seq_len=None if seq_len == tables.model.default_seq_len else seq_len,
        model_name=tables.model.name,
        precision=tables.training.precision,
    )


def profile_command(prov: Provenance, entries: list[EntrySource], *, always: bool = False) -> str:
    """The `autohet profile run` that measures ``entries`` in the plan's precision
    (--precision where its default would not, or ``always``)."""
    tps = ",".join(str(t) for t in sorted({e.tensor_parallel for e in entries}))
    mbss = ",".join(str(m) for m in sorted({e.micro_batch_size for e in entries}))
    seq = "" if prov.seq_len is None else f" --seq-len {prov.seq_len}"
    flag = precision_flag(prov.precision, (e.gpu_type for e in entries), always=always)
    return (
        f"autohet profile run CLUSTER --model {prov.model_ref} --tp {tps} "
        f"--micro-batch-sizes {mbss}{seq}{flag}"
    )


def source_lines(prov: Provenance) -> list[str]:
    """What rests on unmeasured entries; nothing when every stage is measured."""
    unmeasured = prov.unmeasured()
    if not unmeasured:
        return []
    elsewhere = [e for e in unmeasured if e.measured_precision is not None]
    rest = [e for e in unmeasured if e.measured_precision is None]
    cpus = cpu_advice((e.gpu_type for e in rest), prov.precision)
    if not prov.profiled:
        command = profile_command(prov, unmeasured)
        return [
            "Source: no profile was given, so every stage time is an analytic estimate "
            f"from the GPU catalog; measure them with `{command}` and plan with "
            f"--profile{cpus}."
        ]
    total = sum(len(p) for p in prov.stages)
    listed = "; ".join(f"{e.combination}: {e.label}" for e in unmeasured)
    head = f"Stages {prov.num_unmeasured_stages()} of {total} rest on unmeasured entries"
    if not elsewhere:
        command = profile_command(prov, unmeasured)
        return [
            f"{head} ({listed}): their times are estimates; profile them with `{command}` "
            f"or plan with --measured-only{cpus}."
        ]
    # Measured, but in another precision: measuring again as before would not help.
    again = [e for e in elsewhere if measurable(e.gpu_type, prov.precision)]
    found = {e.gpu_type: e.measured_precision or "" for e in elsewhere}
    measure = profile_command(prov, again, always=True) if again else None
    text = f"{head} ({listed}): {advice(prov.model_name, prov.precision, found, measure)}."
    if rest:
        others = "; ".join(e.combination for e in rest)
        text += f" The others ({others}): profile them with `{profile_command(prov, rest)}`{cpus}."
    return [text]


def sources_json(plan: Plan, prov: Provenance) -> dict[str, Any]:
    """The per-stage ``stages`` (with ``source``) and top-level ``unmeasured`` of --json."""
    return {
        "stages": [
            {
                "pipeline": i,
                "stage": j,
                "layer_start": s.layer_start,
                "layer_end": s.layer_end,
                **e.to_dict(),
                "calibrated_from": None
                if e.anchor is None
                else {"tensor_parallel": e.anchor[0], "micro_batch_size": e.anchor[1]},
            }
            for i, (p, pe) in enumerate(zip(plan.pipelines, prov.stages, strict=True))
            for j, (s, e) in enumerate(zip(p.stages, pe, strict=True))
        ],
        "unmeasured": [e.to_dict() for e in prov.unmeasured()],
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


def recompute_count(plan: Plan) -> tuple[int, int]:
    """(stages that recompute their activations, all stages) over every pipeline."""
    stages = [s for p in plan.pipelines for s in p.stages]
    return sum(s.recompute for s in stages), len(stages)


def recompute_line(plan: Plan) -> str | None:
    """What recomputation costs and saves here; None when no stage recomputes."""
    n, total = recompute_count(plan)
    if not n:
        return None
    if n == total:
        which = "every stage re-runs its forward before its backward"
    else:
        which = f"{n} of {total} stages (marked R) re-run their forward before the backward"
    return (
        f"Recompute: {which} (included in bwd ms), keeping only each layer's input "
        "per micro-batch in flight"
    )


def zero1_line(plan: Plan) -> str | None:
    """What ZeRO-1 does in this plan; None without it."""
    if not plan.training.zero1:
        return None
    if len(plan.pipelines) < 2:
        return "ZeRO-1: on, but one pipeline holds every layer, so nothing is sharded"
    return (
        f"ZeRO-1: the {len(plan.pipelines)} pipelines shard the optimizer state of each "
        "segment they hold at one TP degree (reduce-scatter, each steps its slice, "
        "all-gather; tied weights stay replicated)"
    )


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
                row.append("R" if s.recompute else "")
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
    lines += [x for x in (recompute_line(plan), zero1_line(plan)) if x is not None]
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


def _alike_runs(plan: Plan, ev: PlanEval) -> list[tuple[int, int]]:
    """Consecutive pipelines with the same layers, GPU types, batch share and time."""

    def signature(i: int) -> tuple[object, ...]:
        p = plan.pipelines[i]
        return (
            p.num_microbatches,
            round(ev.pipelines[i].time_ms, 6),
            tuple((s.layer_start, s.layer_end, s.gpu_type, s.recompute) for s in p.stages),
        )

    runs: list[tuple[int, int]] = []
    for i in range(len(plan.pipelines)):
        if runs and signature(runs[-1][0]) == signature(i):
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


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
