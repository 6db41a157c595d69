"""Gradient all-reduce in fp32 instead of bf16: what the cost model now predicts.

settings.py charges the data-parallel gradient all-reduce 4 bytes per parameter
(fp32, as Megatron-LM and torchtitan reduce bf16 runs) where it charged 2 (the
compute dtype); stage-to-stage sends and TP all-reduces stay at 2 bytes under
bf16. This prints the predicted iteration time under both charges, with
``TrainingSettings.grad_bytes_per_param`` patched to 2 for the old one:

(a) the same fixed plan, estimated under each charge: the plan the planner picks
    with 4 bytes (today) and the one it picked with 2, and the Megatron-style
    uniform baseline (planner/baselines.py: one TP degree, depth and data-parallel
    width everywhere), and plain data parallelism over the 8 A100s (one whole-model
    stage per GPU, its ring across the two A100 hosts: the case the charge hits);
(b) the plan the planner picks under each charge, each scored by its own charge.

Inputs (all in this repository): paper-mix (8x A100-40, 8x V100-16, 8x RTX-3090
on six hosts) with Sailor's measured OPT-350M profile, bf16, Adam, global batch 64;
once with the links as shipped (100 Gbit/s, 200 between the A100 hosts) and once
with every host-to-host link at 5 Gbit/s, about what Sailor measured between GCP
regions (tests/data/sailor/network/multizone_bandwidths_het.json: 4.2-6.2 Gbit/s
between us-west1-b and us-central1 zones). Planner time limit 20 s per plan, so
the picks can differ a little with the machine's load.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.evaluate import PlanEval, evaluate
from autohet_cli.inputs import Inputs, load_inputs, tables_for
from autohet_cli.plan import Device, Pipeline, Stage
from autohet_cli.planner.api import training_for
from autohet_cli.planner.baselines import uniform_baseline
from autohet_cli.planner.search import SearchRequest
from autohet_cli.settings import TrainingSettings
from benchmarks._common import describe, table
from tests.planning import plan_inputs

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "profiles" / "clusters" / "paper-mix.yaml"
PROFILE = ROOT / "profiles" / "sailor" / "OPT-350M.yaml"
MODEL = "OPT-350M"
BATCH = 64
SLOW_GBPS = 5.0
TIME_LIMIT_S = 20.0
CHARGES = (2, 4)  # bytes per parameter of the gradient all-reduce: bf16 (old), fp32 (now)


@contextmanager
def grad_bytes(nbytes: int) -> Iterator[None]:
    """Charge the gradient all-reduce ``nbytes`` per parameter inside the block."""
    saved = TrainingSettings.__dict__["grad_bytes_per_param"]
    TrainingSettings.grad_bytes_per_param = property(lambda _self: nbytes)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        TrainingSettings.grad_bytes_per_param = saved  # type: ignore[method-assign]


def _slow(cluster: Cluster) -> Cluster:
    return replace(
        cluster, name=f"{cluster.name}@{SLOW_GBPS:g}G", inter_node_gbps=SLOW_GBPS, pair_gbps={}
    )


def _score(inputs: Inputs, pipelines: list[Pipeline], mbs: int, nbytes: int) -> PlanEval:
    training = training_for(BATCH, inputs.model.default_seq_len, "bf16", "adam")
    with grad_bytes(nbytes):
        return evaluate(pipelines, inputs.cluster, tables_for(inputs, training), mbs)


def _pick(inputs: Inputs, nbytes: int) -> tuple[list[Pipeline], int]:
    training = training_for(BATCH, inputs.model.default_seq_len, "bf16", "adam")
    with grad_bytes(nbytes):
        options = {"time_limit_s": TIME_LIMIT_S, "with_baselines": False}
        out = plan_inputs(inputs, training, name="comm-dtype", **options)
    return list(out.plan.pipelines), out.plan.training.micro_batch_size


def _megatron(inputs: Inputs, nbytes: int) -> tuple[list[Pipeline], int]:
    training = training_for(BATCH, inputs.model.default_seq_len, "bf16", "adam")
    req = SearchRequest(
        cluster=inputs.cluster,
        model=inputs.model,
        tables=tables_for(inputs, training),
        global_batch_size=BATCH,
        time_limit_s=TIME_LIMIT_S,
    )
    with grad_bytes(nbytes):
        cand = uniform_baseline(req, proportional=False)
    assert cand is not None, "no uniform plan fits"
    return cand.pipelines, cand.mbs


def _a100_data_parallel(inputs: Inputs) -> tuple[list[Pipeline], int]:
    gpus = [
        Device(host=h.name, gpu=g)
        for h in inputs.cluster.hosts
        if h.gpu_type == "A100-40"
        for g in range(h.num_gpus)
    ]
    whole = inputs.model.num_layers
    return [
        Pipeline(
            num_microbatches=BATCH // len(gpus),
            stages=(
                Stage(
                    layer_start=0,
                    layer_end=whole,
                    gpu_type="A100-40",
                    tensor_parallel=1,
                    devices=(d,),
                ),
            ),
        )
        for d in gpus
    ], 1


def _cell(ev: PlanEval) -> str:
    return f"{ev.iteration_ms / 1e3:.3f} (sync {ev.grad_sync_ms / 1e3:.3f})"


def main() -> None:
    base = load_inputs(str(CLUSTER), MODEL, [str(PROFILE)])
    print(
        f"{MODEL} bf16, global batch {BATCH}, predicted iteration s (gradient sync s in "
        "brackets); grad all-reduce charged 2 B/param (bf16, old) vs 4 B/param (fp32, now)\n"
    )
    rows, shapes = [], []
    for inputs in (base, replace(base, cluster=_slow(base.cluster))):
        name = inputs.cluster.name
        picks = {n: _pick(inputs, n) for n in CHARGES}
        fixed = [(f"picked with {n} B", pick) for n, pick in picks.items()]
        fixed.append(("megatron, picked with 4 B", _megatron(inputs, 4)))
        fixed.append(("data parallel, 8 A100s", _a100_data_parallel(inputs)))
        for label, (pipes, mbs) in fixed:  # (a) one fixed plan under both charges
            old, new = (_score(inputs, pipes, mbs, c) for c in CHARGES)
            rows.append(
                [
                    name,
                    f"(a) fixed: {label}",
                    _cell(old),
                    _cell(new),
                    f"{new.iteration_ms / old.iteration_ms:.3f}",
                ]
            )
            shapes.append(f"{name}, {label}: mbs={mbs} {describe(pipes)}")
        old = _score(inputs, *picks[2], 2)  # (b) each charge's own pick
        new = _score(inputs, *picks[4], 4)
        rows.append(
            [
                name,
                "(b) planner's pick",
                _cell(old),
                _cell(new),
                f"{new.iteration_ms / old.iteration_ms:.3f}",
            ]
        )
    print(table(["cluster", "plan", "2 B/param", "4 B/param", "4 B / 2 B"], rows))
    print()
    for s in shapes:
        print(s)


if __name__ == "__main__":
    main()
