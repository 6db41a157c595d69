"""Fixed costs in the analytic model (issue 31.6): per op, per message, per step.

A small model is not predicted as free: its layers pay their ops' dispatch (on
top of the arithmetic on the CPU, as a floor under it on a GPU), its collectives
their messages' latency, its step the trainer's loop; measured figures replace
the catalog's, and a calibrated step cost replaces both.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from autohet_cli import catalog
from autohet_cli.cluster import load_cluster
from autohet_cli.costmodel.evaluate import evaluate, ring_allreduce_ms
from autohet_cli.costmodel.fixed import (
    TP_COLLECTIVES,
    layer_ops,
    param_tensors,
    ring_latency_ms,
    small_allreduce_ms,
)
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.defaults import resolve_cluster_path
from autohet_cli.models import ModelSpec, get_model
from autohet_cli.plan import Device, Pipeline, Stage
from autohet_cli.profiling.analytic import analytic_entry
from autohet_cli.profiling.schema import DeviceFacts, Overhead, Profile, ProfileEntry
from autohet_cli.settings import TrainingSettings

LLAMA = get_model("llama-tiny")
GPT13 = get_model("GPT-1.3B")
FP32 = TrainingSettings(global_batch_size=8, micro_batch_size=4, seq_len=128, precision="fp32")
CPU = catalog.CATALOG["cpu"]
LOCALHOST = load_cluster(resolve_cluster_path(None))


def _entry(
    model: ModelSpec = LLAMA,
    spec: catalog.GpuSpec = CPU,
    *,
    tp: int = 1,
    mbs: int = 4,
    seq: int = 128,
    measured: DeviceFacts | None = None,
    precision: str = "fp32",
) -> ProfileEntry:
    return analytic_entry(
        model,
        spec,
        tp=tp,
        micro_batch_size=mbs,
        seq_len=seq,
        precision=precision,
        optimizer="adam",
        measured=measured,
    )


def _bare(spec: catalog.GpuSpec) -> catalog.GpuSpec:
    none = replace(spec.fixed, op_us=0.0, tp_op_us=0.0, optimizer_ops_per_tensor=0.0)
    return replace(spec, fixed=none)


def _stage(a: int, b: int, gpu: int, tp: int = 1, host: str = "localhost") -> Stage:
    return Stage(
        layer_start=a,
        layer_end=b,
        gpu_type="cpu",
        tensor_parallel=tp,
        devices=tuple(Device(host=host, gpu=gpu + i) for i in range(tp)),
    )


def test_op_counts_follow_the_block_architecture() -> None:
    block = next(x for x in LLAMA.layers() if x.kind == "block")
    gpt = get_model("gpt-tiny")
    gpt_block = next(x for x in gpt.layers() if x.kind == "block")
    # RMSNorm, rotary embeddings and a gated MLP: each adds ops to a GPT-2 block's
    assert layer_ops(block, LLAMA) == (38 + 12 + 23 + 2, 64 + 30 + 14 + 3)
    assert layer_ops(gpt_block, gpt) == (38 + 2, 64 + 12)  # LayerNorm, biases
    assert param_tensors(block, LLAMA) == 2 + 4 + 3  # two RMSNorm weights, 7 linears
    assert param_tensors(gpt_block, gpt) == 4 + 2 * 6


def test_a_cpu_layer_pays_its_ops_on_top_of_its_arithmetic() -> None:
    full, bare = _entry(), _entry(spec=_bare(CPU))
    for layer, x, y in zip(LLAMA.layers(), full.layers, bare.layers, strict=True):
        fwd, bwd = layer_ops(layer, LLAMA)
        assert x.fwd_ms == pytest.approx(y.fwd_ms + fwd * CPU.fixed.op_us / 1e3)
        assert x.bwd_ms == pytest.approx(y.bwd_ms + bwd * CPU.fixed.op_us / 1e3)
        per_tensor = CPU.fixed.optimizer_ops_per_tensor * param_tensors(layer, LLAMA)
        assert x.update_ms == pytest.approx(y.update_ms + per_tensor * CPU.fixed.op_us / 1e3)
    # under TP every op also pays DTensor's host work, the optimizer's too (the CPU's
    # Adam steps tensor by tensor)
    tp2, bare2 = _entry(tp=2), _entry(spec=_bare(CPU), tp=2)
    per_op = (CPU.fixed.op_us + CPU.fixed.tp_op_us) / 1e3
    fwd, _ = layer_ops(LLAMA.layers()[1], LLAMA)
    assert tp2.layers[1].fwd_ms == pytest.approx(bare2.layers[1].fwd_ms + fwd * per_op)


def test_a_gpu_layer_takes_the_longer_of_its_launches_and_its_arithmetic() -> None:
    h100 = catalog.CATALOG["H100-80"]
    tiny, tiny_bare = _entry(spec=h100, mbs=1), _entry(spec=_bare(h100), mbs=1)
    big, big_bare = (
        _entry(GPT13, spec, mbs=4, seq=2048, precision="bf16") for spec in (h100, _bare(h100))
    )
    for layer, x, y in zip(LLAMA.layers(), tiny.layers, tiny_bare.layers, strict=True):
        fwd, _ = layer_ops(layer, LLAMA)
        # launch-bound: the ops' host time, not the (tiny) arithmetic
        assert x.fwd_ms == pytest.approx(max(y.fwd_ms, fwd * h100.fixed.op_us / 1e3))
        assert x.fwd_ms > y.fwd_ms
    # a large model's arithmetic hides its launches: nothing changes
    blocks = [i for i, layer in enumerate(GPT13.layers()) if layer.kind == "block"]
    for i in blocks:
        assert big.layers[i].fwd_ms == big_bare.layers[i].fwd_ms


def test_a_measured_op_time_replaces_the_catalogs() -> None:
    layer_tflops = CPU.peak_tflops * CPU.matmul_efficiency
    facts = DeviceFacts(
        gpu_type="cpu",
        mem_bytes=4 << 30,
        matmul_tflops=layer_tflops / 0.85,  # the catalog's layer rate: only op_us differs
        mem_bandwidth_gbytes_s=CPU.mem_bandwidth_gbytes_s,
        source="measured",
        op_us=10.0,
    )
    catalog_us, measured = _entry(), _entry(measured=facts)
    fwd, _ = layer_ops(LLAMA.layers()[1], LLAMA)
    gap = catalog_us.layers[1].fwd_ms - measured.layers[1].fwd_ms
    assert gap == pytest.approx(fwd * (CPU.fixed.op_us - 10.0) / 1e3)


def test_tp_collectives_and_gradient_rings_pay_their_messages() -> None:
    tables = CostTables(LLAMA, None, FP32, gpu_specs=LOCALHOST.gpu_specs)
    hop = CPU.fixed.hop_us / 1e3
    assert tables.hop_ms("cpu") == hop
    for i, layer in enumerate(LLAMA.layers()):
        fwd, bwd = TP_COLLECTIVES[layer.kind]
        bytes_only = tables._tp_comm_ms(i, 2, 4, 4.0)
        assert tables._tp_comm_ms(i, 2, 4, 4.0, hop) == pytest.approx(
            bytes_only + (fwd + bwd) / 2 * 2 * hop
        )
    # two data-parallel replicas: the ring's 2(P-1) messages on top of its bytes
    dp = [Pipeline(num_microbatches=1, stages=(_stage(0, 7, g),)) for g in (0, 1)]
    ev = evaluate(dp, LOCALHOST, tables, 4)
    grads = sum(lt.num_params for lt in tables.entry("cpu", 1, 4).layers) * 4  # fp32
    gbps = LOCALHOST.host("localhost").intra_node_gbps
    assert ev.grad_sync_ms == pytest.approx(ring_allreduce_ms(grads, 2, gbps) + 2 * hop)
    assert ring_latency_ms(hop, 1) == 0.0 and ring_latency_ms(hop, 4) == 6 * hop


def test_a_pipeline_send_pays_one_message_until_a_run_calibrates_it() -> None:
    tables = CostTables(LLAMA, None, FP32)
    assert tables.p2p_latency_ms("cpu", "cpu") == CPU.fixed.hop_us / 1e3
    calibrated = Profile(overheads={"cpu": Overhead(step_ms=5.0, p2p_ms=0.25)})
    assert CostTables(LLAMA, calibrated, FP32).p2p_latency_ms("cpu", "cpu") == 0.25


def test_the_step_cost_is_the_catalogs_then_the_probes_then_a_runs() -> None:
    fixed = CPU.fixed
    world_allreduces = 2 * small_allreduce_ms(fixed.hop_us / 1e3, 4)
    tables = CostTables(LLAMA, None, FP32)
    assert tables.step_overhead_ms("cpu", 1, 1) == fixed.step_us / 1e3
    assert tables.step_overhead_ms("cpu", 1, 4) == pytest.approx(
        fixed.step_us / 1e3 + world_allreduces
    )
    assert small_allreduce_ms(1.0, 4) == 4.0  # up and down two levels of a tree
    probed = DeviceFacts(
        gpu_type="cpu",
        mem_bytes=4 << 30,
        matmul_tflops=0.05,
        mem_bandwidth_gbytes_s=20.0,
        source="measured",
        step_ms=3.0,
    )
    with_probe = CostTables(LLAMA, Profile(devices={"cpu": probed}), FP32)
    assert with_probe.step_overhead_ms("cpu", 1, 4) == pytest.approx(3.0 + world_allreduces)
    ran = Profile(devices={"cpu": probed}, overheads={"cpu": Overhead(step_ms=40.0)})
    assert CostTables(LLAMA, ran, FP32).step_overhead_ms("cpu", 1, 4) == 40.0


def test_a_small_model_is_not_predicted_as_free() -> None:
    """Two data-parallel replicas of llama-tiny on the CPU stand-in (the demo's plan,
    without ZeRO-1): 37 ms predicted before fixed costs; the development machine
    measured 126 ms quiet, 200-320 ms busy (the e2e test launches the demo)."""
    tables = CostTables(LLAMA, None, FP32, gpu_specs=LOCALHOST.gpu_specs)
    dp = [Pipeline(num_microbatches=1, stages=(_stage(0, 7, g),)) for g in (0, 1)]
    ev = evaluate(dp, LOCALHOST, tables, 4)
    bare = {"cpu": _bare(CPU)}
    compute = evaluate(dp, LOCALHOST, CostTables(LLAMA, None, FP32, gpu_specs=bare), 4)
    ops = sum(sum(layer_ops(layer, LLAMA)) for layer in LLAMA.layers())
    assert ev.iteration_ms > compute.iteration_ms + ops * CPU.fixed.op_us / 1e3
    assert 126.0 / 1.5 < ev.iteration_ms < 126.0 * 1.5


def test_more_micro_batches_pay_more_dispatch() -> None:
    """The pipeline/micro-batch trade-off fixed costs change: the same samples in
    eight micro-batches of one dispatch every op eight times."""
    tables = {m: CostTables(LLAMA, None, replace(FP32, micro_batch_size=m)) for m in (1, 8)}
    one = [Pipeline(num_microbatches=1, stages=(_stage(0, 7, 0),))]
    eight = [Pipeline(num_microbatches=8, stages=(_stage(0, 7, 0),))]
    big = evaluate(one, LOCALHOST, tables[8], 8)
    small = evaluate(eight, LOCALHOST, tables[1], 1)
    ops = sum(sum(layer_ops(layer, LLAMA)) for layer in LLAMA.layers())
    assert small.pipeline_ms - big.pipeline_ms == pytest.approx(
        7 * ops * CPU.fixed.op_us / 1e3, rel=0.05
    )
