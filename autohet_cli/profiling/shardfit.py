"""Refit the collectives of weight-sharded stages from a run (pure; issue 48).

A weight-sharded stage's measured forward and backward hold its layers' compute
and whatever of FSDP's per-layer gathers and reduce-scatters the compute did not
hide (``costmodel.sharding``). The run's prediction check records, for each such
stage, the link its collectives ran over (``launch.compare.shard_links``: holders,
Gbit/s, the TP ranks sharing a NIC); ``shard_factor`` then finds the one factor x
on the collectives' time with which the cost model's forward + backward of every
sharded stage of the run, summed, equals the measured sum. Exposed time grows with
x (each term is a ``max(0, collective - compute)``), so bisection finds it.

The factor is what ``CostTables.shard_factor`` multiplies the collectives by
(``Overhead.shard_x``): it absorbs the library's real rate, how much of the
overlap the runtime really gets (none on a CPU, where gloo runs in the compute's
threads) and FSDP's own copies in and out of its flat buffers. It is found with
the profile's current layer times: calibrate from the run of a plan whose plain
layers that profile measured.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autohet_cli.costmodel.sharding import WeightShard, sharded_stage_cost
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.plan import Device, Stage

X_MIN, X_MAX = 0.01, 100.0  # what the bisection searches; beyond it the run says little


def shard_factor(stages: Sequence[Mapping[str, Any]], tables: CostTables) -> float | None:
    """The factor (see the module doc) for these measured weight-sharded stages of a
    prediction check; None when they say nothing of it: no link recorded, or the
    compute alone already explains what was measured (the collectives were hidden)."""
    rows = [row for st in stages if (row := _row(st, tables)) is not None]
    if not rows:
        return None
    measured = sum(m for m, _ in rows)

    def predicted(x: float) -> float:
        return sum(f(x) for _, f in rows)

    if predicted(X_MIN) >= measured:
        return None
    if predicted(X_MAX) <= measured:
        return X_MAX
    lo, hi = X_MIN, X_MAX
    for _ in range(50):
        mid = (lo * hi) ** 0.5  # geometric: the factor spans orders of magnitude
        lo, hi = (mid, hi) if predicted(mid) < measured else (lo, mid)
    return hi


def _row(
    st: Mapping[str, Any], tables: CostTables
) -> tuple[float, Callable[[float], float]] | None:
    """(measured fwd + bwd ms per micro-batch, predicted as a function of x)."""
    link = st.get("shard_link")
    if not link:
        return None
    gpu, tp = str(st["gpu_type"]), int(st["tensor_parallel"])
    a, b = (int(x) for x in st["layers"])
    rc = st.get("recompute", False)
    if not isinstance(rc, int) or rc < 0:  # true, false or a count (bool is an int)
        raise ValueError(f"a stage's recompute is {rc!r}: true, false or a layer count")
    stage = Stage(
        layer_start=a,
        layer_end=b,
        gpu_type=gpu,
        tensor_parallel=tp,
        devices=tuple(Device(host="measured", gpu=i) for i in range(tp)),
        recompute=rc is True,
        recompute_layers=0 if isinstance(rc, bool) else int(rc),
        shard="weights",
        reshard_after_forward=bool(st.get("reshard_after_forward", True)),
    )
    mbs = tables.training.micro_batch_size
    table = tables.table(gpu, tp, mbs, tables.spec(gpu).intra_node_gbps)
    cost = table.stage(a, b, recompute_first=stage.recomputed)
    hop = tables.hop_ms(gpu)
    holders, gbps, share = int(link["holders"]), float(link["gbps"]), int(link["nic_share"])

    def predicted(x: float) -> float:
        shard = WeightShard(holders=holders, gbps=gbps, nic_share=share, hop_ms=hop, rate_factor=x)
        c = sharded_stage_cost(cost, table, stage, shard, tables)
        return c.fwd_ms + c.bwd_ms

    meas = st["measured"]
    return float(meas["fwd_ms"]) + float(meas["bwd_ms"]), predicted
