"""The plan's types and the invariants the runtime relies on (pure).

``Plan.validate`` checks what the types cannot (layers covered once, batch sums,
one host per TP group, each GPU used once) and names the field, so a hand-edited
plan fails at load, not later on a GPU; ``check_against_cluster`` checks the same
plan against the hosts of a cluster. Split from ``plan`` by responsibility: the
plain-data form is ``plan.yamlform``, the versioned files ``plan.files``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autohet_cli.errors import ConfigError, PlanError
from autohet_cli.limits import MAX_BLOCKS, MAX_GPUS_PER_HOST, MAX_TENSOR_PARALLEL, at_most
from autohet_cli.models import ModelSpec
from autohet_cli.names import check_host_name
from autohet_cli.settings import TrainingSettings

SCHEMA = "autohet.plan/v1"


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

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def host(self) -> str:
        return self.devices[0].host


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
    if expect != plan.num_layers:
        raise PlanError(
            f"{at}.stages: layers end at {expect} but the model has {plan.num_layers} layers"
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
