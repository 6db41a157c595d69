"""autohet against the HF reference on this host's GPU: tokens/s, MFU, peak memory.

One run, three trainers, the same recipe: the 1.2B llama of issue 33 (hidden
2048, intermediate 8192, 16 layers, 32 heads, 8 KV heads, vocabulary 128256,
tied), seq 2048, global batch 32, bf16 autocast over fp32 weights, AdamW (fused
on CUDA), clipping at 1.0, random tokens.

- ``autohet``: the planner's plan for one GPU of this type (analytic profile, so
  the planner picks the micro-batch), run by the runtime as ``autohet launch``
  runs it (torch.compile per block on CUDA, the chunked loss);
- ``hf eager`` / ``hf compile``: transformers' ``LlamaForCausalLM`` (sdpa
  attention), the same micro-batch and accumulation, eager and under
  ``torch.compile``; a micro-batch that runs out of memory is halved (and the
  row says so).

Each trainer runs in its own process (clean allocator); 3 warm-up steps, then the
median of ``AUTOHET_BENCH_GPU_STEPS`` (default 8). MFU counts 6N + 12·L·h·s FLOPs
per token against the catalog's bf16 peak. The plan's analytic memory prediction
is printed beside the measured peak (``torch.cuda.max_memory_allocated``): the
target is prediction >= measured. Without a CUDA GPU it says so and returns;
``AUTOHET_BENCH_GPU_SMOKE=1`` runs a tiny llama on the CPU instead (fp32 autocast
off, HF's compile without inductor's code generation: to check the harness, not to
measure).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import machine, table

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
WARMUP = 3
BIG = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "seq": 2048,
    "global_batch": 32,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "seq": 64,
    "global_batch": 8,
}
VARIANTS = ("autohet", "hf eager", "hf compile")


def _smoke() -> bool:
    return os.environ.get("AUTOHET_BENCH_GPU_SMOKE") == "1"


def _shape() -> dict[str, int]:
    return TINY if _smoke() else BIG


def hf_config(shape: dict[str, int]) -> dict[str, Any]:
    """A transformers config.json for the shape (what `autohet plan --model` reads too)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_hidden_layers"],
        "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_key_value_heads"],
        "vocab_size": shape["vocab_size"],
        "max_position_embeddings": shape["seq"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
    }


def flops_per_token(shape: dict[str, int]) -> float:
    """6N + 12·L·h·s (N: parameters, the tied embedding once)."""
    h, f, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    block = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    n = layers * block + shape["vocab_size"] * h + h
    return 6.0 * n + 12.0 * layers * h * shape["seq"]


def _timed_steps(step: Any, steps: int, sync: Any) -> list[float]:
    times = []
    for _ in range(WARMUP + steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


def worker_autohet(plan_path: Path, steps: int) -> dict[str, Any]:
    import torch

    from autohet_cli.plan import load_plan
    from autohet_cli.runtime.trainer import TrainConfig, Trainer

    cuda = torch.cuda.is_available()
    plan = load_plan(plan_path)
    trainer = Trainer(plan, TrainConfig(seed=0, device="cuda" if cuda else "cpu", lr=1e-4))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        times = _timed_steps(lambda: trainer.fit(1), steps, sync)
    finally:
        trainer.close()
    return {"step_s": times, "micro_batch": plan.training.micro_batch_size, **_peaks(cuda)}


def worker_hf(compiled: bool, micro_batch: int, steps: int) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = _shape()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    config = LlamaConfig(**hf_config(shape), attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dev)
    if compiled:
        # The smoke run checks the harness, not inductor: dynamo and AOT autograd
        # without C++ code generation (about half the smoke test's time on 2 cores)
        model.compile(backend="aot_eager" if not cuda and _smoke() else "inductor")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda
    )
    seq, batch = shape["seq"], shape["global_batch"]
    gen = torch.Generator(device=dev).manual_seed(0)
    tokens = torch.randint(0, shape["vocab_size"], (batch, seq), device=dev, generator=gen)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, batch, micro_batch):
            x = tokens[start : start + micro_batch]
            with autocast:
                loss = model(input_ids=x, labels=x).loss
            (loss * x.shape[0] / batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    times = _timed_steps(step, steps, torch.cuda.synchronize if cuda else (lambda: None))
    return {"step_s": times, "micro_batch": micro_batch, **_peaks(cuda)}


def _peaks(cuda: bool) -> dict[str, int]:
    """The allocator's peaks: tensors (allocated) and what it held from the driver
    (reserved: tensors plus its cache and fragmentation, what an OOM is about)."""
    import torch

    if not cuda:
        return {"peak_bytes": 0, "reserved_bytes": 0}
    return {
        "peak_bytes": int(torch.cuda.max_memory_allocated()),
        "reserved_bytes": int(torch.cuda.max_memory_reserved()),
    }


def _env() -> dict[str, str]:
    """This checkout first on the path, and the caller's path kept (packages carried
    beside an image's Python, say)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def _worker(variant: str, out: Path, plan: Path, micro_batch: int, steps: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        *("-m", "benchmarks.gpu_throughput", "--worker", variant),
        *(str(out), str(plan), str(micro_batch), str(steps)),
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        tail = proc.stderr[-2000:]
        if "out of memory" in tail.lower():
            return {"oom": True}
        raise SystemExit(f"{variant} failed ({proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _plan(work: Path, gpu_type: str) -> dict[str, Any]:
    shape = _shape()
    (work / "config.json").write_text(json.dumps(hf_config(shape)))
    (work / "cluster.yaml").write_text(
        "schema: autohet.cluster/v1\nname: gpu-host\nnetwork: {inter_node_gbps: 100}\n"
        "hosts:\n  - {name: localhost, address: localhost, "
        f"gpus: {{type: {gpu_type}, count: 1}}, spot: false}}\n"
    )
    cmd = [
        sys.executable,
        *("-m", "autohet_cli", "plan", "--cluster", str(work / "cluster.yaml")),
        *("--model", str(work / "config.json"), "--global-batch-size", str(shape["global_batch"])),
        *("--seq-len", str(shape["seq"]), "--out-dir", str(work), "--name", "gpu-throughput"),
        *("--precision", "bf16" if gpu_type != "cpu" else "fp32", "--json", "--time-limit", "60"),
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"autohet plan failed:\n{proc.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def main() -> None:
    import torch

    print(__doc__.split("\n\n")[0])
    smoke = os.environ.get("AUTOHET_BENCH_GPU_SMOKE") == "1"
    if not torch.cuda.is_available() and not smoke:
        print("no CUDA GPU on this machine: skipped (AUTOHET_BENCH_GPU_SMOKE=1 checks the harness)")
        return
    from autohet_cli.catalog import CATALOG, canonical_gpu_name

    gpu_type = canonical_gpu_name(torch.cuda.get_device_name(0)) if not smoke else "cpu"
    steps = int(os.environ.get("AUTOHET_BENCH_GPU_STEPS", "2" if smoke else "8"))
    shape = _shape()
    print(machine() + (f", {torch.cuda.get_device_name(0)}" if not smoke else ", CPU smoke run"))
    with tempfile.TemporaryDirectory(prefix="autohet-gpu-bench-") as tmp:
        work = Path(tmp)
        plan = _plan(work, gpu_type)
        mbs = int(plan["micro_batch_size"])
        predicted = max(int(s["predicted"]["mem_bytes"]) for s in _stages(Path(plan["plan_path"])))
        results: dict[str, dict[str, Any]] = {}
        for variant in VARIANTS:
            size = mbs
            while True:
                out = work / f"{variant.replace(' ', '-')}-{size}.json"
                r = _worker(variant, out, Path(plan["plan_path"]), size, steps)
                if not r.get("oom") or variant == "autohet" or size == 1:
                    break
                size //= 2
            r["halved"] = size != mbs
            results[variant] = r
    tokens = shape["global_batch"] * shape["seq"]
    peak_flops = CATALOG[gpu_type].peak_tflops_at("bf16" if not smoke else "fp32") * 1e12
    print(f"MFU against {peak_flops / 1e12:.0f} TFLOP/s (the catalog's {gpu_type})")
    rows = []
    for variant, r in results.items():
        if r.get("oom"):
            rows.append((variant, "-", "out of memory", "-", "-"))
            continue
        step_s = statistics.median(r["step_s"])
        rate = tokens / step_s
        mfu = rate * flops_per_token(shape) / peak_flops
        micro = f"{r['micro_batch']} x {shape['global_batch'] // r['micro_batch']}"
        rows.append(
            (
                variant,
                micro + (" (halved: OOM)" if r["halved"] else ""),
                f"{rate:,.0f}",
                f"{mfu:.1%}",
                f"{r['peak_bytes'] / GIB:.1f} GiB",
            )
        )
    print(table(["trainer", "micro-batch", "tokens/s", "MFU", "peak memory"], rows))
    ours, ref = results["autohet"], results["hf compile"]
    if not ours.get("oom") and not ref.get("oom"):
        ratio = statistics.median(ref["step_s"]) / statistics.median(ours["step_s"])
        print(f"autohet / HF+compile tokens/s: {ratio:.2f}x (target >= 1.05)")
    if not ours.get("oom"):
        # The prediction holds the type's runtime reserve (CUDA context, allocator
        # slack) beside the tensors: tensors against allocated, the whole against reserved.
        reserve = CATALOG[gpu_type].runtime_reserve_bytes
        for what, mine, measured in (
            ("tensors (prediction less the runtime reserve) vs allocated", predicted - reserve,
             ours["peak_bytes"]),
            ("whole prediction vs reserved", predicted, ours["reserved_bytes"]),
        ):  # fmt: skip
            verdict = "ok" if mine >= measured else "UNDER-PREDICTED"
            print(
                f"analytic memory, {what}: {mine / GIB:.1f} GiB vs {measured / GIB:.1f} GiB: "
                f"{verdict} (target: prediction >= measured)"
            )


def _stages(plan_path: Path) -> list[dict[str, Any]]:
    import yaml

    plan = yaml.safe_load(plan_path.read_text())
    return [s for p in plan["pipelines"] for s in p["stages"]]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        variant, out, plan_path, micro, n = sys.argv[2:7]
        if variant == "autohet":
            result = worker_autohet(Path(plan_path), int(n))
        else:
            result = worker_hf(variant == "hf compile", int(micro), int(n))
        Path(out).write_text(json.dumps(result))
    else:
        main()
