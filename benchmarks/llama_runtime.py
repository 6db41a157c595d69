"""Tokens/s of the runtime training a small LLaMA on one CPU device vs a plain torch loop.

The model: the built-in LLaMA family (GQA 8/4 heads, hidden 256, 4 blocks,
SwiGLU 688, vocabulary 8000, RoPE), sequence 256, global batch 8 in 2
micro-batches of 4, AdamW, fp32, one process with ``OMP_NUM_THREADS=1``.

- ours: a one-device plan through ``Trainer.fit(1)`` (1F1B loop, gradient sync,
  optimizer, loss all-reduce: what a real run executes);
- plain: the same layers in ``nn.Sequential`` with the same initial weights, the
  same data and AdamW groups, in the loop everyone writes (zero_grad, forward and
  backward per micro-batch, step).

Median over 3 launches x 10 steps (after 3 warm-up steps), launches alternating;
the target is ours within 10% of plain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from autohet_cli.plan import write_plan
from benchmarks._common import machine, table, worker_times
from tests.model_specs import llama
from tests.planting import plan_of, stage

SEQ_LEN, MICRO_BATCH, GLOBAL_BATCH = 256, 4, 8
WARMUP, MEASURED, REPEATS = 3, 10, 3
SPEC = llama("bench-llama", (4, 256, 8, 4, 688, 8000), activation="silu", default_seq_len=SEQ_LEN)
PLAN = plan_of(
    [stage(0, SPEC.num_layers, "localhost")],
    microbatches=GLOBAL_BATCH // MICRO_BATCH,
    micro_batch_size=MICRO_BATCH,
    seq_len=SEQ_LEN,
    precision="fp32",
    model=SPEC,
    name="bench-llama",
)


def _timed(step: Any) -> list[float]:
    times = []
    for _ in range(WARMUP + MEASURED):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


def worker_ours(plan_path: Path) -> list[float]:
    from autohet_cli.plan import load_plan
    from autohet_cli.runtime.trainer import TrainConfig, Trainer

    trainer = Trainer(load_plan(plan_path), TrainConfig(seed=0, device="cpu"))
    try:
        return _timed(lambda: trainer.fit(1))
    finally:
        trainer.close()


def worker_plain() -> list[float]:
    import torch

    from autohet_cli.runtime.data import SyntheticCorpus
    from autohet_cli.runtime.models import build
    from tests.hf_reference import model_request

    parts = build(model_request(SPEC, seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH))
    model = torch.nn.Sequential(*parts.layers)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
    )
    corpus = SyntheticCorpus(vocab_size=SPEC.vocab_size, seq_len=SEQ_LEN, seed=0)
    state = {"step": 0}

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = corpus.global_batch(state["step"], GLOBAL_BATCH)
        for s in range(0, GLOBAL_BATCH, MICRO_BATCH):
            x, y = inputs[s : s + MICRO_BATCH], targets[s : s + MICRO_BATCH]
            (parts.loss_fn(model(x), y) / GLOBAL_BATCH).backward()
        optimizer.step()
        state["step"] += 1

    return _timed(step)


def _launch(variant: str, out: Path, plan: Path) -> list[float]:
    cmd = [sys.executable, "-m", "benchmarks.llama_runtime", "--worker", variant, str(out)]
    return worker_times(cmd, variant, out, {"AUTOHET_BENCH_PLAN": str(plan)})


def main() -> None:
    tokens = GLOBAL_BATCH * SEQ_LEN
    print(
        f"{SPEC.name}: {SPEC.num_params / 1e6:.1f} M parameters, seq {SEQ_LEN}, global batch "
        f"{GLOBAL_BATCH} ({GLOBAL_BATCH // MICRO_BATCH} micro-batches), AdamW, fp32, one CPU "
        f"process (OMP_NUM_THREADS=1); median of {REPEATS} x {MEASURED} steps\n{machine()}"
    )
    runs: dict[str, list[float]] = {"ours": [], "plain": []}
    with tempfile.TemporaryDirectory(prefix="autohet-bench-") as tmp:
        _, plan = write_plan(PLAN, tmp)
        for i in range(REPEATS):  # alternate, so drift in the machine's load hits both
            for variant in runs:
                runs[variant] += _launch(variant, Path(tmp) / f"{variant}-{i}.json", plan)
    med = {k: statistics.median(v) for k, v in runs.items()}
    rows = [
        (k, f"{med[k] * 1e3:.0f}", f"{tokens / med[k]:,.0f}", f"{med['plain'] / med[k]:.2f}")
        for k in runs
    ]
    print(table(["variant", "ms/step (median)", "tokens/s", "tokens/s vs plain"], rows))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        p = argparse.ArgumentParser()
        p.add_argument("variant", choices=["ours", "plain"])
        p.add_argument("out", type=Path)
        a = p.parse_args(sys.argv[2:])
        result = (
            worker_ours(Path(os.environ["AUTOHET_BENCH_PLAN"]))
            if a.variant == "ours"
            else worker_plain()
        )
        a.out.write_text(json.dumps(result))
    else:
        main()
