"""The short runs ``autohet profile run`` launches to measure what layer timings miss (pure).

The probe times each layer kind alone, in one process. A training step also
pays what only the runtime shows: a fixed cost per step (optimizer launch,
framework, the step's small collectives), the latency of each stage-to-stage
exchange, the collective library's real gradient all-reduce rate, TP as the
runtime runs it (DTensor collectives, not a local shard plus separately timed
all-reduces) and the memory the process really holds. Rather than fit these to
a model of the runtime, ``profile run`` runs the runtime itself, on one host per
GPU type, for a few steps of a few plan shapes, and lets
``profiling.calibrate`` refit the fresh profile from each run's report. The
shapes are chosen so each term is measured by the run that isolates it:

1. data parallel over every device (one device on a one-GPU host): the step
   cost, the layer times at TP 1, the gradient-sync rate;
2. every measured TP degree > 1 that fits the host: TP as the runtime runs it;
3. two pipeline stages (two devices, two layers at least): the exchange latency,
   told apart from the step cost that run 1 measured;
4. run 1's replicas with their weights sharded over them (``shard: weights``, two
   devices at least): the per-layer gathers and reduce-scatters FSDP leaves
   exposed, as a factor on the model's (``profiling.shardfit``), from the layer
   times runs 1-3 refitted.

Each run fills the host with replicas (``shapes_for`` says why).

All shapes use one micro-batch size: the largest measured one whose run fits
the time budget and the device's memory, so the refitted entries stay
comparable across shapes (``calibrate.spread`` carries the ratios to the
other micro-batch sizes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from autohet_cli.cluster import Cluster, Host
from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.estimates.profile import Profile
from autohet_cli.models import ModelSpec
from autohet_cli.plan import Device, Pipeline, Plan, Stage
from autohet_cli.planner.api import with_predictions
from autohet_cli.settings import TrainingSettings

MICROBATCHES = 8  # per run: enough for a 1F1B pipeline to fill, few enough to be quick


Layout = tuple[int, tuple[tuple[int, int], ...]]  # (micro-batches, stages' layer ranges)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """One run: ``layout`` is per pipeline (micro-batches, [(first, end) layer of
    each stage]); every stage has ``tp`` devices."""

    name: str
    layout: tuple[Layout, ...]
    tp: int
    measures: str  # what the run is for, for the user
    shard: str = "none"  # every stage's (Stage.shard)

    @property
    def devices(self) -> int:
        return self.tp * sum(len(stages) for _, stages in self.layout)


def shapes_for(num_layers: int, num_gpus: int, tps: Sequence[int]) -> list[Shape]:
    """The runs for a host of ``num_gpus`` devices, in the order calibration needs
    them (the step cost before the latency that is told apart from it).

    Every run fills the host with data-parallel replicas, as real plans do: what
    the devices of one host share (a CPU's cores and memory bandwidth, a GPU
    host's PCIe switches and launch threads) slows each of them, and a run with
    idle neighbours would time them faster than any plan will run them."""
    whole = ((0, num_layers),)

    def replicas(width: int, stages: tuple[tuple[int, int], ...]) -> tuple[Layout, ...]:
        r = max(1, num_gpus // width)
        each = max(2, MICROBATCHES // r) if len(stages) == 1 else MICROBATCHES
        return tuple((each, stages) for _ in range(r))

    out: list[Shape] = []
    data_parallel = Shape(
        name=f"data-parallel-{num_gpus}",
        layout=replicas(1, whole),
        tp=1,
        measures="step cost, layer times at TP 1, gradient-sync rate",
    )
    if num_gpus >= 2:
        out.append(data_parallel)
    else:
        out.append(
            Shape(
                name="one-device",
                layout=((MICROBATCHES, whole),),
                tp=1,
                measures="step cost, layer times at TP 1",
            )
        )
    for t in sorted({t for t in tps if 1 < t <= num_gpus}):
        out.append(
            Shape(
                name=f"tp-{t}",
                layout=replicas(t, whole),
                tp=t,
                measures=f"TP {t} as the runtime runs it",
            )
        )
    if num_gpus >= 2 and num_layers >= 2:
        cut = num_layers // 2
        out.append(
            Shape(
                name="two-stages",
                layout=replicas(2, ((0, cut), (cut, num_layers))),
                tp=1,
                measures="stage-to-stage exchange latency",
            )
        )
    if num_gpus >= 2:  # run 1's replicas, their weights sharded over them
        out.append(
            replace(
                data_parallel,
                name=f"sharded-weights-{num_gpus}",
                measures="sharded weights' gathers and reduce-scatters",
                shard="weights",
            )
        )
    return out


def shape_plan(
    shape: Shape, model: ModelSpec, host: Host, *, mbs: int, seq_len: int, precision: str
) -> Plan:
    """The plan of ``shape`` on ``host``'s first devices (no predictions yet)."""
    gpus = iter(range(host.num_gpus))
    batch = mbs * sum(m for m, _ in shape.layout)
    return Plan(
        name=f"runcheck-{shape.name}",
        version=1,
        model_name=model.name,
        num_layers=model.num_layers,
        training=TrainingSettings(
            global_batch_size=batch, micro_batch_size=mbs, seq_len=seq_len, precision=precision
        ),
        tensor_parallel=shape.tp,
        pipelines=tuple(
            Pipeline(
                num_microbatches=m,
                stages=tuple(
                    Stage(
                        layer_start=a,
                        layer_end=b,
                        gpu_type=host.gpu_type,
                        tensor_parallel=shape.tp,
                        devices=tuple(
                            Device(host=host.name, gpu=next(gpus)) for _ in range(shape.tp)
                        ),
                        shard=shape.shard,
                    )
                    for a, b in stages
                ),
            )
            for m, stages in shape.layout
        ),
        architecture=model,
    )


def predicted(plan: Plan, cluster: Cluster, profile: Profile, model: ModelSpec) -> Plan:
    """``plan`` with the predictions ``profile`` makes for it (what its run is compared to;
    its inputs name the profile, so the comparison does not call them analytic)."""
    tables = CostTables(model, profile, plan.training, gpu_specs=cluster.gpu_specs)
    ev = evaluate(plan.pipelines, cluster, tables, plan.training.micro_batch_size)
    inputs = {**plan.inputs, "profile": {"path": "(the probe's, being refitted)"}}
    return replace(with_predictions(plan, ev), inputs=inputs)


def fits(plan: Plan, steps: int, budget_s: float) -> str | None:
    """Why a predicted plan should not run (None: it should): over the device's
    memory, or ``steps`` steps predicted beyond the time budget."""
    assert plan.prediction is not None
    for p in plan.pipelines:
        for s in p.stages:
            if s.predicted is not None and s.predicted.mem_fraction > 1.0:
                return f"needs {s.predicted.mem_fraction:.0%} of a device's memory"
    seconds = plan.prediction.iteration_time_s * steps
    if seconds > budget_s:
        return f"{steps} steps predicted at {seconds:.0f} s, over the {budget_s:.0f} s budget"
    return None
