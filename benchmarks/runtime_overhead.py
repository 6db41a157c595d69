"""Step time of the autohet runtime against torch's own DDP and Schedule1F1B (gloo, CPU).

gpt-small (10 partitionable layers, hidden 256), sequence 128, global batch 8 in
micro-batches of 2, AdamW, 2 worker processes under torchrun (one per core,
``OMP_NUM_THREADS=1``):

- data parallel: our plan of two one-stage pipelines (2 micro-batches each) vs
  ``DistributedDataParallel`` over the whole model, each rank accumulating the
  same 2 micro-batches (``no_sync`` on the first);
- pipeline parallel: our plan of one pipeline of two stages, layers [0, 5) and
  [5, 10), 4 micro-batches, vs ``torch.distributed.pipelining``'s
  ``Schedule1F1B`` over the same two stages and micro-batches (plus the tied
  embedding/head gradient all-reduce, which ours does too).

Every variant times the same scope, one whole step as its training loop runs it:
zero_grad, forward/backward of every micro-batch, gradient sync, AdamW step and
an all-reduce of the loss; ours through ``Trainer.fit(1)`` with its heartbeat
hook. Median over 2 launches x 10 steps, each after 3 warm-up steps (rank 0's
clock), launches of ours and the baseline alternating. On a 2-core machine the
spread between launches is about +-10%, so ratios within 0.9-1.1 mean "no
measurable overhead".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autohet_cli.plan import Plan, write_plan
from benchmarks._common import machine, table, worker_times
from tests.planting import plan_of, stage

MODEL, NUM_LAYERS, CUT = "gpt-small", 10, 5
SEQ_LEN, MICRO_BATCH, GLOBAL_BATCH = 128, 2, 8
WARMUP, MEASURED = 3, 10
REPEATS = 2  # launches per variant, alternating
NPROC = 2
SEED = 0


def make_plan(name: str, layout: list[tuple[int, list[tuple[int, int]]]]) -> Plan:
    gpus = iter(range(NPROC))
    return plan_of(
        *([stage(a, b, "localhost", next(gpus)) for a, b in stages] for _, stages in layout),
        microbatches=[m for m, _ in layout],
        micro_batch_size=MICRO_BATCH,
        seq_len=SEQ_LEN,
        precision="fp32",
        model=MODEL,
        num_layers=NUM_LAYERS,
        name=name,
    )


PLANS = {
    "dp": make_plan("bench-dp", [(2, [(0, NUM_LAYERS)]), (2, [(0, NUM_LAYERS)])]),
    "pp": make_plan("bench-pp", [(4, [(0, CUT), (CUT, NUM_LAYERS)])]),
}


# --------------------------------------------------------------------- workers (torchrun)


def _timed_steps(step: Callable[[], None]) -> list[float]:
    import torch.distributed as dist

    times = []
    for _ in range(WARMUP + MEASURED):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


def _loss_all_reduce(loss: Any) -> None:
    import torch
    import torch.distributed as dist

    t = loss.detach().clone() if isinstance(loss, torch.Tensor) else torch.zeros(())
    dist.all_reduce(t)


def worker_ours(plan_path: Path, run_dir: Path) -> list[float]:
    import torch

    from autohet_cli.plan import load_plan
    from autohet_cli.runtime.health import HealthMonitor, init_process_group
    from autohet_cli.runtime.trainer import TrainConfig, Trainer

    init_process_group(torch.device("cpu"), 60.0)
    trainer = Trainer(load_plan(plan_path), TrainConfig(seed=SEED, device="cpu"))
    health = HealthMonitor(trainer.runtime, run_dir=run_dir)
    trainer.hooks.append(health)
    health.start()

    def step() -> None:
        trainer.fit(1)

    try:
        return _timed_steps(step)
    finally:
        health.stop()


def _model(start: int, end: int) -> tuple[Any, Any, Any]:
    """Layers [start, end) of gpt-small named like ours, tied where both ends are held."""
    import torch

    from autohet_cli.runtime.gpt import build
    from autohet_cli.runtime.model_api import ModelRequest, local_layers
    from autohet_cli.runtime.stage import StageModule, tie_parameters

    request = ModelRequest(
        model_name=MODEL,
        num_layers=NUM_LAYERS,
        layer_start=start,
        layer_end=end,
        seed=SEED,
        seq_len=SEQ_LEN,
        micro_batch_size=MICRO_BATCH,
    )
    parts = build(request)
    module = StageModule(local_layers(parts, request))
    tie_parameters(module, parts.tied)
    decay = [p for p in module.parameters() if p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
    )
    return module, optimizer, parts


def _corpus(parts: Any) -> Any:
    from autohet_cli.runtime.data import SyntheticCorpus

    return SyntheticCorpus(vocab_size=parts.vocab_size, seq_len=SEQ_LEN, seed=SEED)


def worker_ddp() -> list[float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module, optimizer, parts = _model(0, NUM_LAYERS)
    model = DistributedDataParallel(module)
    corpus = _corpus(parts)
    share = GLOBAL_BATCH // world
    state = {"step": 0}

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = corpus.global_batch(state["step"], GLOBAL_BATCH)
        total = None
        starts = range(rank * share, (rank + 1) * share, MICRO_BATCH)
        for i, s in enumerate(starts):
            x, y = inputs[s : s + MICRO_BATCH], targets[s : s + MICRO_BATCH]
            last = i == len(starts) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = parts.loss_fn(model(x), y) / GLOBAL_BATCH
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        optimizer.step()
        _loss_all_reduce(total)
        state["step"] += 1

    return _timed_steps(step)


def worker_pipelining() -> list[float]:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    start, end = (0, CUT) if rank == 0 else (CUT, NUM_LAYERS)
    module, optimizer, parts = _model(start, end)
    corpus = _corpus(parts)
    hidden = parts.activation_shape(MICRO_BATCH, SEQ_LEN)
    example = (
        torch.zeros(MICRO_BATCH, SEQ_LEN, dtype=torch.long) if rank == 0 else torch.zeros(hidden)
    )
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), input_args=(example,))
    num_mb = GLOBAL_BATCH // MICRO_BATCH

    def loss_fn(output: Any, target: Any) -> Any:
        return parts.loss_fn(output, target) / GLOBAL_BATCH

    schedule = Schedule1F1B(stage, num_mb, loss_fn=loss_fn, scale_grads=False)
    tied = [p for n, p in module.named_parameters() if n in {"layers.0.wte.weight"}] + [
        p for n, p in module.named_parameters() if n == f"layers.{NUM_LAYERS - 1}.lm_head.weight"
    ]
    state = {"step": 0}

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = corpus.global_batch(state["step"], GLOBAL_BATCH)
        losses: list[Any] = []
        if rank == 0:  # the corpus gives strided windows; the schedule wants them dense
            schedule.step(inputs.contiguous())
        else:
            schedule.step(target=targets.contiguous(), losses=losses)
        for p in tied:  # the tied embedding/head: one gradient over both stages
            assert p.grad is not None
            dist.all_reduce(p.grad)
        optimizer.step()
        _loss_all_reduce(sum(losses) if losses else None)
        state["step"] += 1

    return _timed_steps(step)


def worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", required=True, choices=["ours", "ddp", "pipelining"])
    p.add_argument("--plan", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import torch.distributed as dist

    if args.variant == "ours":
        times = worker_ours(args.plan, args.out.parent / f"run-{args.plan.stem}")
    elif args.variant == "ddp":
        times = worker_ddp()
    else:
        times = worker_pipelining()
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(times))
    dist.destroy_process_group()


# --------------------------------------------------------------------- driver


def _launch(variant: str, out: Path, plan: Path | None = None) -> list[float]:
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *(f"--nproc-per-node={NPROC}", "-m", "benchmarks.runtime_overhead", "--worker"),
        *("--variant", variant, "--out", str(out)),
        *(("--plan", str(plan)) if plan else ()),
    ]
    return worker_times(cmd, variant, out)


def _median(runs: list[list[float]]) -> float:
    return statistics.median(t for run in runs for t in run)


def _ms(median_s: float, runs: list[list[float]]) -> str:
    """``530 (512/548)``: the pooled median and each launch's, in ms."""
    each = "/".join(f"{statistics.median(r) * 1e3:.0f}" for r in runs)
    return f"{median_s * 1e3:.0f} ({each})"


def main() -> None:
    print(
        f"{MODEL}, seq {SEQ_LEN}, global batch {GLOBAL_BATCH} (micro-batch {MICRO_BATCH}), "
        f"AdamW, {NPROC} processes, gloo on CPU; median of {REPEATS} x {MEASURED} steps "
        f"(each launch after {WARMUP} warm-up steps)\n{machine()}"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="autohet-bench-") as tmp:
        root = Path(tmp)
        for kind, baseline, label in (
            ("dp", "ddp", "data parallel: 2 x [0,10), 2 mb each  vs DDP"),
            ("pp", "pipelining", "pipeline: [0,5)+[5,10), 4 mb  vs Schedule1F1B"),
        ):
            _, plan_path = write_plan(PLANS[kind], root)
            ours: list[list[float]] = []
            theirs: list[list[float]] = []
            for i in range(REPEATS):  # alternate, so drift in the machine's load hits both
                ours.append(_launch("ours", root / f"{kind}-ours-{i}.json", plan_path))
                theirs.append(_launch(baseline, root / f"{kind}-{baseline}-{i}.json"))
            a, b = _median(ours), _median(theirs)
            rows.append((label, _ms(a, ours), _ms(b, theirs), f"{a / b:.2f}"))
    print(table(["comparison", "autohet ms/step", "torch ms/step", "ratio"], rows))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:])
    else:
        main()
