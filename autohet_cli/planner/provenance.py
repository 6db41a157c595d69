"""Where the cost model's numbers for each stage of a plan come from (measured,
Sailor's, calibrated or analytic profile entries), and what to run to measure the
ones that rest on estimates: ``--explain``'s source column and summary line, and
``--json``'s ``stages`` and ``unmeasured`` (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autohet_cli.costmodel.tables import CostTables
from autohet_cli.plan import Plan
from autohet_cli.planner.precision import (
    advice,
    cpu_advice,
    measurable,
    measured_as,
    precision_flag,
)

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
