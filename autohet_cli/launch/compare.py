"""A run against its plan: predicted and measured step, stage times and memory (pure).

Input: the plan (each stage's ``predicted`` forward and backward milliseconds per
micro-batch and memory; the plan's iteration prediction) and the run report the
runtime's rank 0 printed (``runtime.report``: per rank, medians over the steps
after the first two). A stage's measured forward per micro-batch is its slowest
TP rank's forward time per step over its micro-batch count; its memory is its
largest peak. Ratios are predicted / measured: above 1 the plan was slow to
expect this, below 1 it promised more than the hardware gave. Memory
predicted below measured is flagged: a plan must never under-predict it.

A plan made without a profile (no ``profile`` among its inputs) predicted from
the analytic model alone: catalog figures, fixed costs included, not this
cluster's measurements. The check says so in plain words, with the command that
measures the cluster, so that a ratio far from 1 reads as what it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tabulate import tabulate

from autohet_cli.cluster import Cluster
from autohet_cli.errors import AutohetError
from autohet_cli.plan import Plan, Stage, StagePrediction, weight_sharded

CHECK_SCHEMA = "autohet.prediction-check/v1"


def _ratio(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured


def compare(
    plan: Plan,
    report: Mapping[str, Any],
    send_ms: Sequence[Sequence[float]] | None = None,
    links: Mapping[tuple[int, int], Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """``send_ms``: per pipeline, the predicted transfer time of each stage link (from
    the cluster's link speeds), used to explain the measured step by the measured stage
    times; what is left is the fixed per-step cost (``step_overhead_ms``). ``links``:
    per weight-sharded (pipeline, stage), its collectives' link (``shard_links``), which
    ``profile calibrate`` refits their rate with (``profiling.shardfit``)."""
    ranks: Sequence[Mapping[str, Any]] = report.get("ranks") or []
    stages: list[dict[str, Any]] = []
    # A weight-sharded plan's pipelines all run the most micro-batches of any (the
    # runtime pads the others with zero-weight ones, ``fsdp_stage.
    # padded_microbatches``): the measured sums are over that many.
    most = max((p.num_microbatches for p in plan.pipelines), default=1)
    padded = weight_sharded(plan.pipelines) > 0
    for p, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            mine = [r for r in ranks if r["pipeline"] == p and r["stage"] == s and r["medians"]]
            if not mine:
                continue
            m = most if padded else pipeline.num_microbatches  # as many as ran
            fwd = max(r["medians"]["fwd_ms"] for r in mine) / m
            bwd = max(r["medians"]["bwd_ms"] for r in mine) / m
            mem = max(int(r["peak_mem_bytes"]) for r in mine)
            pred = stage.predicted
            stages.append(
                {
                    "pipeline": p,
                    "stage": s,
                    "gpu_type": stage.gpu_type,
                    "tensor_parallel": stage.tensor_parallel,
                    "layers": [stage.layer_start, stage.layer_end],
                    "recompute": _recorded_recompute(stage),
                    "shard": stage.shard,
                    **(
                        {
                            "reshard_after_forward": stage.reshard_after_forward,
                            "shard_link": dict(links[(p, s)]),
                        }
                        if links and (p, s) in links
                        else {}
                    ),
                    "num_microbatches": m,
                    "predicted": None if pred is None else _predicted(pred),
                    "measured": {
                        "fwd_ms": fwd,
                        "bwd_ms": bwd,
                        "optimizer_ms": max(r["medians"]["optimizer_ms"] for r in mine),
                        "sync_ms": max(r["medians"]["sync_ms"] for r in mine),
                        "p2p_ms": max(r["medians"]["p2p_ms"] for r in mine),
                        "mem_bytes": mem,
                    },
                    "ratio": {
                        "fwd": _ratio(pred.fwd_ms if pred else None, fwd),
                        "bwd": _ratio(pred.bwd_ms if pred else None, bwd),
                        "mem": _ratio(pred.mem_bytes if pred else None, mem),
                    },
                }
            )
    measured_step = max((r["medians"]["step_ms"] for r in ranks if r["medians"]), default=None)
    whole = plan.prediction
    predicted_step = whole.iteration_time_s * 1e3 if whole else None
    under = [
        {"pipeline": st["pipeline"], "stage": st["stage"], **st["measured"]}
        for st in stages
        if st["predicted"] and st["predicted"]["mem_bytes"] < st["measured"]["mem_bytes"]
    ]
    steps = [r["medians"]["steps"] for r in ranks if r["medians"]]
    explained = explained_ms(stages, send_ms) if len(stages) == _num_stages(plan) else None
    t = plan.training
    return {
        "schema": CHECK_SCHEMA,
        "plan": report.get("plan"),
        "prediction_source": prediction_source(plan),
        "model": plan.model_name,
        "micro_batch_size": t.micro_batch_size,
        "seq_len": t.seq_len,
        "precision": t.precision,
        "device": ranks[0].get("device") if ranks else None,
        "steps_measured": int(min(steps)) if steps else 0,
        "explained_ms": explained,
        "send_ms": [list(x) for x in send_ms] if send_ms else None,
        "step_overhead_ms": None
        if explained is None or measured_step is None
        else max(0.0, measured_step - explained),
        "step": {
            "predicted_ms": predicted_step,
            "measured_ms": measured_step,
            "ratio": _ratio(predicted_step, measured_step),
            "predicted_sync_ms": whole.grad_sync_time_s * 1e3 if whole else None,
            "predicted_optimizer_ms": whole.optimizer_time_s * 1e3 if whole else None,
        },
        "stages": stages,
        "memory_under_predicted": under,
    }


def prediction_source(plan: Plan) -> str:
    """``analytic`` for a plan made without a profile, else ``profile``."""
    return "profile" if any(k.startswith("profile") for k in plan.inputs) else "analytic"


def _num_stages(plan: Plan) -> int:
    return sum(len(p.stages) for p in plan.pipelines)


def link_send_ms(plan: Plan, cluster: Cluster, device: str | None) -> list[list[float]] | None:
    """Per pipeline, each stage link's transfer time as the cost model charges it, in
    the dtype the run sent (fp32 on a CPU); None for a model outside the zoo."""
    from autohet_cli.costmodel.evaluate import transfer_ms
    from autohet_cli.models import get_model

    try:
        spec = plan.architecture or get_model(plan.model_name)
    except AutohetError:
        return None
    layers = spec.layers()
    t = plan.training
    dtype_bytes = 4 if device == "cpu" else t.dtype_bytes
    out = []
    for pipeline in plan.pipelines:
        links = []
        for a, b in zip(pipeline.stages, pipeline.stages[1:], strict=False):
            last = layers[a.layer_end - 1]
            nbytes = last.output_bytes(t.seq_len, t.micro_batch_size, dtype_bytes)
            links.append(transfer_ms(nbytes, cluster.link_gbps(a.host, b.host)))
        out.append(links)
    return out


def _recorded_recompute(stage: Stage) -> bool | int:
    """True (every layer, however the plan says it), False, or N (its first N
    layers, fewer than all): what calibrate tells apart."""
    n = stage.recomputed
    return True if n == stage.num_layers else (n or False)


def shard_links(plan: Plan, cluster: Cluster) -> dict[tuple[int, int], dict[str, Any]]:
    """Per weight-sharded (pipeline, stage): what its gathers and reduce-scatters ran
    over, as the cost model counts it (holders, the slowest link among their hosts,
    the TP ranks that share a NIC)."""
    from autohet_cli.costmodel.gradsync import nic_share, ring_gbps
    from autohet_cli.costmodel.sharding import holder_groups, holder_key

    groups = holder_groups(plan.pipelines)
    link = {
        key: {
            "holders": len(stages),
            "gbps": ring_gbps(stages, cluster),
            "nic_share": nic_share(stages, cluster),
        }
        for key, stages in groups.items()
    }
    return {
        (p, s): link[holder_key(st)]
        for p, pipe in enumerate(plan.pipelines)
        for s, st in enumerate(pipe.stages)
        if st.shard == "weights"
    }


def explained_ms(
    stages: Sequence[Mapping[str, Any]],
    send_ms: Sequence[Sequence[float]] | None,
    latency_ms: float = 0.0,
) -> float | None:
    """The 1F1B makespan of the measured stage times (the cost model's own simulator,
    each send costing its predicted transfer plus ``latency_ms``) plus the slowest
    measured gradient sync and optimizer step; None when a stage was not measured."""
    from autohet_cli.costmodel.pipeline import simulate_1f1b

    by_pipeline: dict[int, dict[int, Mapping[str, Any]]] = {}
    for st in stages:
        by_pipeline.setdefault(int(st["pipeline"]), {})[int(st["stage"])] = st
    worst = 0.0
    for p, held in sorted(by_pipeline.items()):
        if sorted(held) != list(range(len(held))):
            return None
        ordered = [held[s] for s in range(len(held))]
        links = list(send_ms[p]) if send_ms and p < len(send_ms) else [0.0] * (len(held) - 1)
        sim = simulate_1f1b(
            [st["measured"]["fwd_ms"] for st in ordered],
            [st["measured"]["bwd_ms"] for st in ordered],
            int(ordered[0]["num_microbatches"]),
            [x + latency_ms for x in links],
        )
        worst = max(worst, sim.makespan_ms)
    opt = max((st["measured"]["optimizer_ms"] for st in stages), default=0.0)
    return worst + collective_sync_ms(stages) + opt


def collective_sync_ms(stages: Sequence[Mapping[str, Any]]) -> float:
    """The gradient all-reduce itself, without waiting for slower replicas.

    A rank's measured sync time includes waiting for the last replica of its layers
    to arrive (an uneven batch share arrives later): that wait is pipeline imbalance,
    which the 1F1B makespan already holds. The last to arrive waits for no one, so
    per layer segment (the runtime's sync groups: layers cut alike in every
    pipeline) the shortest sync among its holders bounds the collective; the
    slowest segment's is the step's."""
    cuts = sorted({0} | {int(st["layers"][1]) for st in stages})
    worst = 0.0
    for a in cuts[:-1]:
        held = [
            float(st["measured"]["sync_ms"])
            for st in stages
            if int(st["layers"][0]) <= a < int(st["layers"][1])
        ]
        if held:
            worst = max(worst, min(held))
    return worst


def _predicted(pred: StagePrediction) -> dict[str, float]:
    return {"fwd_ms": pred.fwd_ms, "bwd_ms": pred.bwd_ms, "mem_bytes": pred.mem_bytes}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def render(check: Mapping[str, Any]) -> str:
    """A few lines for the terminal."""
    step = check["step"]
    lines = [
        f"predicted vs measured ({check['steps_measured']} steps, medians; ratio = "
        "predicted / measured):",
        f"  step: {_ms(step['predicted_ms'])} ms predicted{_source(check)}, "
        f"{_ms(step['measured_ms'])} ms measured ({_x(step['ratio'])}); the measured stage "
        f"times explain {_ms(check['explained_ms'])} ms, the rest is fixed per-step cost",
    ]
    rows = []
    for st in check["stages"]:
        pred, meas, ratio = st["predicted"] or {}, st["measured"], st["ratio"]
        rows.append(
            [
                f"p{st['pipeline']} s{st['stage']}",
                f"{st['gpu_type']} tp{st['tensor_parallel']}",
                f"{_ms(pred.get('fwd_ms'))}/{_ms(meas['fwd_ms'])} ({_x(ratio['fwd'])})",
                f"{_ms(pred.get('bwd_ms'))}/{_ms(meas['bwd_ms'])} ({_x(ratio['bwd'])})",
                f"{_gib(pred.get('mem_bytes'))}/{_gib(meas['mem_bytes'])} ({_x(ratio['mem'])})",
            ]
        )
    headers = ["stage", "gpu", "fwd ms/mb", "bwd ms/mb", "memory GiB"]
    lines += ["  " + line for line in tabulate(rows, headers=headers).splitlines()]
    if check["memory_under_predicted"]:
        lines.append(
            "  warning: memory under-predicted on stage(s) "
            + ", ".join(f"{u['pipeline']}.{u['stage']}" for u in check["memory_under_predicted"])
        )
    return "\n".join(lines)


def _source(check: Mapping[str, Any]) -> str:
    """Where the prediction came from, for the step line (nothing for a check written
    before checks said so)."""
    source = check.get("prediction_source")
    if source == "analytic":
        return (
            " from the analytic model (no measured profile: catalog figures for "
            f"{_device_types(check)}; `autohet profile run` measures this cluster)"
        )
    return " from the measured profile" if source == "profile" else ""


def _device_types(check: Mapping[str, Any]) -> str:
    types = sorted({str(st["gpu_type"]) for st in check.get("stages") or []})
    return ", ".join(types) or "its devices"


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"
