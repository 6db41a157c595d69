"""The plan's types and the invariants the runtime relies on (pure).

``Plan.validate`` checks what the types cannot (layers covered once, batch sums,
one host per TP group, each GPU used once, a stage's sharding against the other
holders of its layers) and names the field, so a hand-edited
plan fails at load, not later on a GPU; ``check_against_cluster`` checks the same
plan against the hosts of a cluster. Split from ``plan`` by responsibility: the
plain-data form is ``plan.yamlform``, the versioned files ``plan.files``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from autohet_cli.errors import ConfigError, PlanError
from autohet_cli.limits import MAX_BLOCKS, MAX_GPUS_PER_HOST, MAX_TENSOR_PARALLEL, at_most
from autohet_cli.models import ModelSpec
from autohet_cli.names import check_host_name
from autohet_cli.settings import TrainingSettings

SCHEMA = "autohet.plan/v1"
# A stage's ``shard``: "optimizer" is what ``training.zero1`` already says for the plan.
SHARD_MODES = ("none", "optimizer", "weights")


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    host: str
    gpu: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePrediction:
    fwd_ms: float
    bwd_ms: float
    update_ms: float
    mem_bytes: int
    mem_fraction: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    layer_start: int
    layer_end: int
    gpu_type: str
    tensor_parallel: int
    devices: tuple[Device, ...]
    predicted: StagePrediction | None = None
    # Full activation recomputation: the runtime wraps each layer of the stage in a
    # (non-reentrant) torch.utils.checkpoint, keeping only each layer's input per
    # micro-batch in flight and re-running the layer's forward before its backward.
    # Written to YAML only when true, so plans without it keep their bytes and digests.
    recompute: bool = False
    # Partial recomputation (issue 48): only the stage's first N layers recompute
    # (written ``recompute: N``); 0 with ``recompute`` false: none. Never both: a
    # stage that recomputes every layer says ``recompute: true``.
    recompute_layers: int = 0
    # Issue 48: the stage's state over the data-parallel holders of its layers (the
    # stages of the other pipelines with the same cut and TP degree). "none":
    # replicated (``training.zero1`` still shards the optimizer state where it can);
    # "weights": fully sharded (ZeRO-3: weights, gradients and optimizer state), the
    # 16-bit weights gathered per micro-batch before the forward, and again before the
    # backward unless ``reshard_after_forward`` is false (kept from one to the other).
    # Written to YAML only when set, so plans without them keep their bytes.
    shard: str = "none"  # SHARD_MODES
    reshard_after_forward: bool = True

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def host(self) -> str:
        return self.devices[0].host

    @property
    def recomputed(self) -> int:
        """How many of the stage's layers (its first) recompute their activations."""
        if self.recompute:
            return self.num_layers
        return max(0, min(self.recompute_layers, self.num_layers))


@dataclass(frozen=True, slots=True, kw_only=True)
class Pipeline:
    num_microbatches: int
    stages: tuple[Stage, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    iteration_time_s: float
    tokens_per_s: float
    memory_peak_fraction: float
    pipeline_time_s: float
    grad_sync_time_s: float
    optimizer_time_s: float
    closed_form_time_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SolverInfo:
    status: str  # optimal | heuristic | time_limit | baseline
    gap: float  # SCIP's relative gap on the chosen grouping
    time_s: float
    objective: str = "time"
    search_gap: float = 0.0  # against a lower bound over all groupings
    groupings_explored: int = 0
    groupings_pruned: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    name: str
    version: int
    model_name: str
    num_layers: int
    training: TrainingSettings
    tensor_parallel: int
    pipelines: tuple[Pipeline, ...]
    inputs: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    prediction: Prediction | None = None
    solver: SolverInfo | None = None
    baselines: Mapping[str, float | None] = field(default_factory=dict)
    idle: tuple[Mapping[str, Any], ...] = ()
    notes: tuple[str, ...] = ()
    parent: str | None = None
    created: str = ""
    contingency: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # The model itself (``model.architecture``), so workers need no zoo or config.json;
    # None in plans written before plans carried it (workers look the name up).
    architecture: ModelSpec | None = None

    def devices(self) -> list[Device]:
        return [d for p in self.pipelines for s in p.stages for d in s.devices]

    def hosts(self) -> list[str]:
        return list(dict.fromkeys(d.host for d in self.devices()))

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        """The distinct stage TP degrees, ascending (one value: a uniform plan)."""
        return tuple(sorted({s.tensor_parallel for p in self.pipelines for s in p.stages}))

    def validate(self, where: str = "plan") -> None:
        """Every invariant the runtime relies on; errors name the field."""
        t = self.training
        try:  # the name picks folders (plans/, checkpoints, runs): never a path
            validate_name(self.name)
        except ConfigError as exc:
            raise PlanError(f"{where}: name: {exc}") from None
        if not 1 <= self.tensor_parallel <= MAX_TENSOR_PARALLEL:
            raise PlanError(
                f"{where}: tensor_parallel: must be 1 to {MAX_TENSOR_PARALLEL} (the GPUs of one "
                f"host), got {self.tensor_parallel}"
            )
        at_most(
            self.num_layers,
            MAX_BLOCKS + 3,
            f"{where}: model.num_layers",
            "no model has more blocks; 3 more: embedding, final norm, head",
        )
        if not self.pipelines:
            raise PlanError(f"{where}: pipelines: a plan needs at least one pipeline")
        arch = self.architecture
        if arch is not None and arch.num_layers != self.num_layers:
            raise PlanError(
                f"{where}: model.architecture has {arch.num_layers} partitionable layers "
                f"but model.num_layers is {self.num_layers}"
            )
        if t.global_batch_size % t.micro_batch_size:
            raise PlanError(
                f"{where}: training.global_batch_size {t.global_batch_size} is not a multiple "
                f"of micro_batch_size {t.micro_batch_size}"
            )
        total = sum(p.num_microbatches for p in self.pipelines)
        if total * t.micro_batch_size != t.global_batch_size:
            raise PlanError(
                f"{where}: pipelines[*].num_microbatches sum to {total} x micro_batch_size "
                f"{t.micro_batch_size} = {total * t.micro_batch_size}, but "
                f"training.global_batch_size is {t.global_batch_size}"
            )
        seen: dict[Device, str] = {}
        for i, p in enumerate(self.pipelines):
            _validate_pipeline(self, p, f"{where}: pipelines[{i}]", seen)
        _validate_sharded_holders(self, where)
        largest = max(s.tensor_parallel for p in self.pipelines for s in p.stages)
        if largest != self.tensor_parallel:
            raise PlanError(
                f"{where}: tensor_parallel: {self.tensor_parallel}, but the largest stage "
                f"tensor_parallel is {largest}; the plan-level value must be the largest "
                "stage's (stages carry their own)"
            )


def _validate_pipeline(plan: Plan, p: Pipeline, at: str, seen: dict[Device, str]) -> None:
    if p.num_microbatches < 1:
        raise PlanError(f"{at}.num_microbatches: must be at least 1, got {p.num_microbatches}")
    if not p.stages:
        raise PlanError(f"{at}.stages: a pipeline needs at least one stage")
    expect = 0
    for j, s in enumerate(p.stages):
        sat = f"{at}.stages[{j}]"
        if s.layer_start != expect or s.layer_end <= s.layer_start:
            raise PlanError(
                f"{sat}.layers: [{s.layer_start}, {s.layer_end}) must start at {expect} and "
                "be non-empty: stages cover the model's layers in order, exactly once"
            )
        expect = s.layer_end
        if not 1 <= s.tensor_parallel <= plan.tensor_parallel:
            raise PlanError(
                f"{sat}.tensor_parallel: must be 1 to the plan's tensor_parallel "
                f"{plan.tensor_parallel} (the largest stage's), got {s.tensor_parallel}"
            )
        if len(s.devices) != s.tensor_parallel:
            raise PlanError(
                f"{sat}.devices: {len(s.devices)} devices for tensor_parallel {s.tensor_parallel}"
            )
        if len({d.host for d in s.devices}) != 1:
            raise PlanError(f"{sat}.devices: a TP group must sit on one host")
        for d in s.devices:
            check_host_name(d.host, f"{sat}.devices")
            if d.gpu < 0:
                raise PlanError(f"{sat}.devices: gpu index must be >= 0, got {d.gpu}")
            if d.gpu >= MAX_GPUS_PER_HOST:
                raise PlanError(f"{sat}.devices: gpu index {d.gpu}: no host has that many GPUs")
            if d in seen:
                raise PlanError(f"{sat}.devices: {d.host} gpu {d.gpu} is already used by {seen[d]}")
            seen[d] = sat
        validate_recompute(s, sat)
        _validate_shard_fields(plan, s, sat)
    if expect != plan.num_layers:
        raise PlanError(
            f"{at}.stages: layers end at {expect} but the model has {plan.num_layers} layers"
        )


def weight_sharded(pipelines: Iterable[Pipeline]) -> int:
    """How many stages of ``pipelines`` shard their weights (``shard: weights``); 0 for
    a plan (or candidate) without any. The planner, the cost model's callers and the
    runtime ask this one question."""
    return sum(s.shard == "weights" for p in pipelines for s in p.stages)


def shard_mode_error(value: object) -> str | None:
    """Why ``value`` is no stage ``shard`` (None: it is one); the reader and
    ``Plan.validate`` say the same words."""
    if value in SHARD_MODES:
        return None
    return f"{value!r} is not one of {', '.join(SHARD_MODES)}"


def validate_recompute(s: Stage, sat: str) -> None:
    """``recompute``: true (every layer), or N of the stage's first layers."""
    if s.recompute and s.recompute_layers:
        raise PlanError(f"{sat}.recompute: true or a layer count, not both")
    if not 0 <= s.recompute_layers <= s.num_layers:
        raise PlanError(
            f"{sat}.recompute: {s.recompute_layers} layers, but the stage has "
            f"{s.num_layers}; use 1 to {s.num_layers} (its first N layers), true for all"
        )


def _validate_shard_fields(plan: Plan, s: Stage, sat: str) -> None:
    """What one stage's ``shard`` and ``reshard_after_forward`` may say on their own."""
    if (why := shard_mode_error(s.shard)) is not None:
        raise PlanError(f"{sat}.shard: {why}")
    if s.shard == "optimizer" and not plan.training.zero1:
        raise PlanError(
            f"{sat}.shard: optimizer restates training.zero1, which is off; set "
            "training.zero1: true or remove shard from the stage"
        )
    if not s.reshard_after_forward and s.shard != "weights":
        raise PlanError(
            f"{sat}.reshard_after_forward: false keeps gathered weights, which only a "
            f"weight-sharded stage has (shard: weights), and this one is shard: {s.shard}; "
            "remove reshard_after_forward or set shard: weights"
        )


def _validate_sharded_holders(plan: Plan, where: str) -> None:
    """A weight-sharded stage shards over the data-parallel holders of its layers (the
    stages of the other pipelines that hold any of them): each must have exactly its
    cut and TP degree, so that a shard is the same slice of the same tensors on every
    holder, and the same ``shard`` and ``reshard_after_forward``, so that they all
    join the same gathers (a holder that re-gathered before the backward while another
    kept its weights would wait for it forever). GPU types may differ, and so may the
    holders' micro-batch counts: the schema allows unequal counts, and the runtime
    must pad the gathers of the pipelines with fewer micro-batches to the most. Every
    pipeline covers every layer, so a stage's holders are one per pipeline: it needs
    two pipelines at least (with one there is nothing to shard over). One check per
    distinct cut: plans of hundreds of pipelines stay linear."""
    first: dict[tuple[int, int], tuple[str, Stage]] = {}
    for i, p in enumerate(plan.pipelines):
        for j, s in enumerate(p.stages):
            if s.shard == "weights":
                first.setdefault((s.layer_start, s.layer_end), (f"pipelines[{i}].stages[{j}]", s))
    if not first:
        return
    by_cut = [
        {(s.layer_start, s.layer_end): (j, s) for j, s in enumerate(p.stages)}
        for p in plan.pipelines
    ]
    for (start, end), (name, ref) in first.items():
        at, span = f"{where}: {name}.shard: weights", f"layers [{start}, {end})"
        if len(plan.pipelines) < 2:
            raise PlanError(
                f"{at}: no other pipeline holds {span}, so there is nothing to shard "
                "them over; set shard: none (or plan more pipelines)"
            )
        for k, p in enumerate(plan.pipelines):
            if (start, end) not in by_cut[k]:
                cuts = ", ".join(
                    f"[{o.layer_start}, {o.layer_end})"
                    for o in p.stages
                    if o.layer_start < end and o.layer_end > start
                )
                raise PlanError(
                    f"{at}: pipelines[{k}] cuts {span} as {cuts}; every holder of a "
                    "weight-sharded stage's layers needs the same cut: cut the pipelines "
                    "alike there or set shard: none"
                )
            m, o = by_cut[k][(start, end)]
            other = f"pipelines[{k}].stages[{m}]"
            if o.tensor_parallel != ref.tensor_parallel:
                raise PlanError(
                    f"{at}: {other} holds {span} at tensor_parallel {o.tensor_parallel}, this "
                    f"stage at {ref.tensor_parallel}; weight-sharded holders need one TP "
                    "degree: make them equal or set shard: none"
                )
            if (o.shard, o.reshard_after_forward) != (ref.shard, ref.reshard_after_forward):
                said = (
                    f"shard: {o.shard}"
                    if o.shard != ref.shard
                    else (f"reshard_after_forward: {str(o.reshard_after_forward).lower()}")
                )
                raise PlanError(
                    f"{at}: {other} holds {span} with {said}; every holder of a "
                    "weight-sharded stage's layers shards them alike (shard and "
                    "reshard_after_forward): set them the same on all of them"
                )
            if o.recomputed != ref.recomputed:
                # FSDP's gathers in the backward then come in one order on every holder
                raise PlanError(
                    f"{at}: {other} holds {span} recomputing {o.recomputed} of its layers, "
                    f"this stage {ref.recomputed}; weight-sharded holders recompute alike: "
                    "set recompute the same on all of them"
                )


def check_against_cluster(plan: Plan, hosts: Mapping[str, tuple[str, int]], where: str) -> None:
    """``hosts`` maps host name to (gpu_type, num_gpus) of the cluster."""
    for i, p in enumerate(plan.pipelines):
        for j, s in enumerate(p.stages):
            for d in s.devices:
                at = f"{where}: pipelines[{i}].stages[{j}].devices"
                if d.host not in hosts:
                    raise PlanError(f"{at}: host {d.host!r} is not in the cluster")
                gpu_type, count = hosts[d.host]
                if d.gpu >= count:
                    raise PlanError(f"{at}: {d.host} has {count} GPUs, no gpu {d.gpu}")
                if gpu_type != s.gpu_type:
                    raise PlanError(
                        f"{at}: stage says {s.gpu_type} but {d.host} has {gpu_type} GPUs"
                    )


def validate_name(name: str) -> str:
    """A plan name picks folders and files (``plans/<name>.v<N>.yaml``): never a path,
    and never ``.v``, which marks versions."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or ".v" in name:
        raise ConfigError(
            f"plan name {name!r}: use letters, digits, '-', '_' and '.' (no '.v', which "
            "marks versions)"
        )
    return name
