"""Weight-sharded stages on the CPU (issue 48): what each rank holds, measured, against
the memory model, as the number of holders grows.

A one-stage gpt2 plan (8 blocks, hidden 768: 57.7M parameters, AdamW, fp32 on the
CPU: 16 bytes of state per parameter) trained by P = 1 process (replicated), then
by P = 2 and 4 one-stage pipelines whose stage is weight-sharded over them
(``shard: weights``). After two steps each rank counts the bytes it holds for the
stage: its parameters' local shards, their gradients and AdamW's moments (storage
bytes, each storage once). The memory model's term for the same thing is
``costmodel.sharding``'s ``n * state_bytes_per_param / P`` (n: the stage's
parameters per GPU). Printed per P: held and modelled MiB, their ratio, the model's
whole peak (working set, activations and the runtime reserve on top) and the
process's peak RSS.

What is not measured here: the transient part of the peak (gathered layers, one
layer's unsharded gradient, activations). The CPU has no allocator peak counter
(``torch.cuda.max_memory_allocated`` is what ``benchmarks/gpu_throughput`` compares
on a GPU), the peak RSS keeps whatever glibc did not give back (it rose from step to
step while the tensors held stayed the same), and the profiler's memory events miss
what autograd allocates; so the state, which is what sharding divides, is compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from autohet_cli.cluster import load_cluster
from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.models import get_model
from autohet_cli.plan import Device, Pipeline, Plan, Stage, write_plan
from autohet_cli.settings import TrainingSettings
from benchmarks._common import ROOT, table

SPEC = replace(
    get_model("gpt-small"),
    name="gpt-57m",
    hidden_size=768,
    num_heads=12,
    num_kv_heads=12,
    ffn_hidden_size=3072,
)
MBS, SEQ, STEPS = 2, 64, 2
TRAINING = TrainingSettings(
    global_batch_size=4 * MBS,
    micro_batch_size=MBS,
    seq_len=SEQ,
    precision="fp32",
    optimizer="adam",
)
MIB = 2**20


def plan(holders: int) -> Plan:
    gpus = iter(range(8))
    stage = Stage(
        layer_start=0,
        layer_end=SPEC.num_layers,
        gpu_type="cpu",
        tensor_parallel=1,
        devices=(),
        shard="weights" if holders > 1 else "none",
    )
    pipes = tuple(
        Pipeline(
            num_microbatches=4 // holders,
            stages=(replace(stage, devices=(Device(host="localhost", gpu=next(gpus)),)),),
        )
        for _ in range(holders)
    )
    return Plan(
        name=f"mem-{holders}",
        version=1,
        model_name=SPEC.name,
        num_layers=SPEC.num_layers,
        architecture=SPEC,
        tensor_parallel=1,
        training=TRAINING,
        pipelines=pipes,
    )


def worker(plan_path: str, out: str) -> None:
    """Under torchrun: train ``STEPS`` steps, then write what this rank holds."""
    import resource

    import torch
    from torch.distributed.tensor import DTensor

    from autohet_cli.plan import load_plan
    from autohet_cli.runtime.train_config import TrainConfig
    from autohet_cli.runtime.trainer import Trainer

    trainer = Trainer(load_plan(plan_path), TrainConfig(seed=1, device="cpu", lr=1e-4))
    trainer.fit(STEPS)
    seen: set[int] = set()
    held = 0
    tensors = [t for p in trainer.stage.parameters() for t in (p, p.grad)]
    for opt in (trainer.optimizer, trainer.zero_optimizer):
        for state in opt.state.values() if opt is not None else ():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if t is None:
            continue
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held += storage.nbytes()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rank = os.environ.get("RANK", "0")
    Path(out, f"rank{rank}.json").write_text(json.dumps({"held": held, "rss": rss}))


def measured(p: Plan, tmp: Path) -> tuple[int, int]:
    """(largest bytes held, largest peak RSS) over ``p``'s ranks."""
    out = tmp / p.name
    out.mkdir()
    _, path = write_plan(p, out)
    n = len(p.pipelines)
    run = ("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}")
    cmd = [sys.executable, *run, "-m", "benchmarks.fsdp_memory", "--worker", str(path), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    ranks = [json.loads(f.read_text()) for f in out.glob("rank*.json")]
    return max(r["held"] for r in ranks), max(r["rss"] for r in ranks)


def modelled(p: Plan) -> tuple[float, int]:
    """(the memory model's state term, its whole peak) for ``p``'s stage."""
    cluster = load_cluster(str(ROOT / "profiles" / "clusters" / "localhost.yaml"))
    tables = CostTables(SPEC, None, TRAINING, gpu_specs=cluster.gpu_specs)
    gbps = cluster.hosts[0].intra_node_gbps
    n = tables.table("cpu", 1, MBS, gbps).stage(0, SPEC.num_layers).num_params
    state = n * TRAINING.state_bytes_per_param / len(p.pipelines)
    ev = evaluate(list(p.pipelines), cluster, tables, MBS)
    return state, max(int(s.mem_bytes) for pe in ev.pipelines for s in pe.stages)


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="autohet-fsdp-mem-") as tmp:
        for holders in (1, 2, 4):
            p = plan(holders)
            held, rss = measured(p, Path(tmp))
            state, peak = modelled(p)
            rows.append(
                [
                    holders,
                    f"{held / MIB:.0f}",
                    f"{state / MIB:.0f}",
                    f"{held / state:.3f}",
                    f"{peak / MIB:.0f}",
                    f"{rss / MIB:.0f}",
                ]
            )
    print(f"{SPEC.name}: {SPEC.num_params / 1e6:.1f}M parameters, AdamW, fp32 on the CPU\n")
    heads = ["holders", "held MiB", "model MiB", "held/model", "model peak MiB", "peak RSS MiB"]
    print(table(heads, rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
