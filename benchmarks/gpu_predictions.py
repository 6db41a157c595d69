"""Predicted against measured step time and memory on this machine's GPUs, in bf16.

The ``predictions`` benchmark on the GPUs of this host instead of CPU devices:
``autohet profile run`` probes the model's layers on the GPU (CUDA-event timing)
and runs the runtime for a few steps, then each plan shape is launched for 12
steps with ``autohet launch`` and its measured step (median of the steps after
the first two) and peak memory are compared with three predictions: the probe
alone, the profile run ("before calibration"), and the profile refitted from the
shape's own run ("after one calibration run").

Shapes on one GPU: the whole model, and the whole model with every layer
recomputed. With two GPUs or more: data parallel, two stages and TP 2 as well.
Model and sequence length: ``AUTOHET_BENCH_GPU_MODEL`` (default GPT-1.3B) and
``AUTOHET_BENCH_GPU_SEQ`` (1024). ``AUTOHET_BENCH_WORK`` keeps the profiles, plans
and run reports in that directory. Without a CUDA GPU it prints so and returns.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from autohet_cli.catalog import canonical_gpu_name
from autohet_cli.models import get_model
from benchmarks import predictions
from benchmarks._common import machine, table


def _cluster(gpu_type: str, count: int) -> str:
    return f"""schema: autohet.cluster/v1
name: gpu-host
network: {{inter_node_gbps: 100}}
hosts:
  - {{name: localhost, address: localhost, gpus: {{type: {gpu_type}, count: {count}}}, spot: false}}
"""


def _shapes(num_layers: int, gpus: int) -> predictions.Shapes:
    whole = [(8, [(0, num_layers)])]
    out: predictions.Shapes = {"one GPU": (whole, 1), "one GPU, recompute": (whole, 1)}
    if gpus >= 2:
        both = predictions.shapes(num_layers)
        for name in ("data parallel 2", "2 stages even", "TP 2"):
            out[name] = both[name]
    return out


def main() -> None:
    print(__doc__.split("\n\n")[0])
    if not torch.cuda.is_available():
        print("no CUDA GPU on this machine: skipped")
        return
    name = torch.cuda.get_device_name(0)
    gpu_type = canonical_gpu_name(name)
    count = torch.cuda.device_count()
    model = os.environ.get("AUTOHET_BENCH_GPU_MODEL", "GPT-1.3B")
    seq = int(os.environ.get("AUTOHET_BENCH_GPU_SEQ", "1024"))
    print(f"{count} x {name} ({gpu_type}), torch {torch.__version__}; {model}, seq {seq}")
    keep = os.environ.get("AUTOHET_BENCH_WORK")
    with tempfile.TemporaryDirectory(prefix="autohet-bench-gpu-") as tmp:
        work = Path(keep) if keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        cluster = work / "gpu-host.yaml"
        cluster.write_text(_cluster(gpu_type, count))
        rows = predictions.run_model(
            model,
            seq,
            work,
            str(cluster),
            which=_shapes(get_model(model).num_layers, count),
            precision="bf16",
            tp="1,2" if count >= 2 else "1",
        )
    print(table(predictions.HEADERS, rows))
    print(machine())


if __name__ == "__main__":
    main()
