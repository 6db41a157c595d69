"""Refit a profile from a run against its plan (pure): ``autohet profile calibrate``.

Input: a run's ``prediction-check.json`` (``launch.compare``: per stage the
measured forward and backward milliseconds per micro-batch, optimizer
milliseconds and peak memory; the step time the measured stage times do not
explain) and the profile to refit. Per (GPU type, TP degree, micro-batch size)
of the run, each term is scaled by measured / predicted, summed over the stages
of that key: forward, backward and optimizer update separately, so a card that
is slow on backward only is fitted as such. A stage that recomputed its
activations refits the recomputation times (``LayerTiming.recompute_*``), not the
plain ones: its forward and backward are not the plain forward and backward, and
fitting one to the other would make every plain plan look that much slower. A
run of plain stages only scales the recomputation times by its own ratios. The
entry is written with source ``calibrated`` (in the run's compute dtype: fp32 on
a CPU) and the next plan uses it. The per-step cost the stage times leave
unexplained, and the memory a stage held beyond the model's prediction (plus a
margin, so memory is never under-predicted), become the GPU type's ``Overhead``.
A run directory calibrates a profile once: the profile's meta lists the runs it
has absorbed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from autohet_cli.costmodel.evaluate import stage_memory_bytes
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import ConfigError
from autohet_cli.estimates.profile import (
    RC_FITTED,
    LayerTiming,
    Overhead,
    Profile,
    ProfileEntry,
    rc_mark,
)
from autohet_cli.models import ModelSpec
from autohet_cli.profiling.shardfit import shard_factor
from autohet_cli.settings import TrainingSettings

MEM_MARGIN = 0.05  # of the measured peak: run-to-run spread of allocator and RSS peaks


def left_out(stage: Mapping[str, Any]) -> str | None:
    """Why a measured stage refits nothing (None: it refits): ``sharded`` weights,
    or ``partial`` recomputation (``recompute: N``, recorded as the count)."""
    if stage.get("shard", "none") == "weights":
        return "sharded"
    rc = stage.get("recompute", False)
    if isinstance(rc, int) and not isinstance(rc, bool) and rc > 0:
        return "partial"
    return None


def calibrate(
    profile: Profile,
    check: Mapping[str, Any],
    model: ModelSpec,
    *,
    run_id: str,
    global_batch_size: int,
) -> tuple[Profile, list[dict[str, Any]]]:
    """The refitted profile and one row per refitted key (for the user)."""
    runs = list(profile.meta.get("calibrated_from", []))
    if run_id in runs:
        raise ConfigError(f"the profile is already calibrated from {run_id}: nothing to add")
    stages: Sequence[Mapping[str, Any]] = check.get("stages") or []
    if not stages:
        raise ConfigError("the run report has no measured stages (did the run finish?)")
    precision = "fp32" if check.get("device") == "cpu" else str(check["precision"])
    training = TrainingSettings(
        global_batch_size=global_batch_size,
        micro_batch_size=int(check["micro_batch_size"]),
        seq_len=int(check["seq_len"]),
        precision=precision,
    )
    tables = CostTables(model, profile, training)
    # A weight-sharded stage's times hold FSDP's exposed gathers and reduce-scatters,
    # and its memory 1/P of the state: fitting the per-layer profile or the GPU type's
    # overhead to them would spread the collectives over every plan's layers; they
    # refit the collectives' factor instead (``shardfit``). A stage that recomputes
    # only its first N layers mixes plain and recomputation times in one
    # measurement, which neither fit can take apart.
    sharded = [st for st in stages if left_out(st) == "sharded"]
    kept = [st for st in stages if not left_out(st)]
    if not kept:
        shard_x = shard_factor(sharded, tables) if sharded else None
        if shard_x is None:
            raise ConfigError(
                "every stage of this run shards its weights (shard: weights) or recomputes "
                "only some of its layers (recompute: N), and no sharded stage's collectives "
                "could be refitted (their links were not recorded, or the compute hid "
                "them): there is nothing to refit; calibrate from a run of a plan without "
                "them (autohet plan --no-shard-weights)"
            )
        return _with_shard_x(profile, {str(st["gpu_type"]) for st in sharded}, shard_x, run_id), []
    stages = kept
    mbs = training.micro_batch_size
    sums: dict[tuple[str, int, bool], list[float]] = {}
    mem_extra: dict[str, int] = {}
    depth: dict[int, int] = {}
    for st in stages:
        depth[st["pipeline"]] = max(depth.get(st["pipeline"], 0), st["stage"] + 1)
    for st in stages:
        gpu, tp = str(st["gpu_type"]), int(st["tensor_parallel"])
        a, b = st["layers"]
        rc = bool(st.get("recompute", False))
        table = tables.table(gpu, tp, mbs, tables.spec(gpu).intra_node_gbps)
        cost = table.stage(a, b, recompute=rc)
        meas = st["measured"]
        acc = sums.setdefault((gpu, tp, rc), [0.0] * 6)
        for i, (m, p) in enumerate(
            [
                (meas["fwd_ms"], cost.fwd_ms),
                (meas["bwd_ms"], cost.bwd_ms),
                (meas["optimizer_ms"], cost.update_ms),
            ]
        ):
            acc[2 * i] += float(m)
            acc[2 * i + 1] += p
        predicted_mem = stage_memory_bytes(
            cost, tables, gpu, st["stage"], depth[st["pipeline"]], st["num_microbatches"]
        )
        gap = int(meas["mem_bytes"] * (1 + MEM_MARGIN)) - predicted_mem
        mem_extra[gpu] = max(mem_extra.get(gpu, 0), gap)
    entries, rows = [], []
    fitted = set(profile.meta.get(RC_FITTED, []))
    for gpu, tp in sorted({(g, t) for g, t, _ in sums}):
        plain_sums, rc_sums = sums.get((gpu, tp, False)), sums.get((gpu, tp, True))
        base = tables.with_tp_comm(tables.entry(gpu, tp, mbs), tp, mbs)
        plain_x = _ratios(plain_sums) if plain_sums else None
        mark = rc_mark(base.key)
        rc_x = _ratios(rc_sums) if rc_sums else None
        rc_scale = rc_x
        if rc_x is not None:
            fitted.add(mark)
        elif mark in fitted and plain_x is not None:
            # recomputation times a recompute run fitted stay as that run measured them
            rc_scale = [1.0, 1.0, plain_x[2]]
        entries.append(_scaled(base, plain_x, precision, recompute=rc_scale))
        for x, recomputed in ((plain_x, False), (rc_x, True)):
            if x is not None:
                rows.append(
                    {
                        "gpu_type": gpu,
                        "tensor_parallel": tp,
                        "micro_batch_size": mbs,
                        "recompute": recomputed,
                        "was": base.source,
                        "fwd_x": x[0],
                        "bwd_x": x[1],
                        "update_x": x[2],
                    }
                )
    # The collectives' factor against the layer times this run's plain stages just
    # refitted: against the old ones it would take their error for the collectives'.
    refitted = CostTables(model, profile.with_entries(entries), training)
    shard_x = shard_factor(sharded, refitted) if sharded else None
    shard_gpus = {str(st["gpu_type"]) for st in sharded} if shard_x is not None else set()
    overheads = dict(profile.overheads)
    step_ms = float(check.get("step_overhead_ms") or 0.0)
    sync_x = _sync_ratio(check, stages)
    gpus = sorted({str(st["gpu_type"]) for st in stages})
    tp_run = max(int(st["tensor_parallel"]) for st in stages)
    known = [overheads[g] for g in gpus if g in overheads]
    latency = None
    if len(known) == len(gpus) and _pipelined(stages):
        # The fixed step cost is known from earlier runs: what a pipelined run spends
        # beyond it and its measured stage times is the exchanges' latency.
        latency = _fit_latency(check, stages, max(o.step_cost_ms(tp_run) for o in known))
    for gpu in gpus:
        old = overheads.get(gpu)
        mem = max(0, (old.mem_bytes if old else 0) + mem_extra.get(gpu, 0))
        if old is None:
            overheads[gpu] = Overhead(
                step_ms=step_ms,
                mem_bytes=mem,
                sync_x=sync_x or 1.0,
                shard_x=shard_x if gpu in shard_gpus and shard_x else 1.0,
            )
            continue
        # The mean over the runs absorbed so far (a run without gradient sync, one
        # pipeline, says nothing of its rate and keeps the old factor; a pipelined run
        # measures the exchange latency instead of the step cost; a TP run, what TP
        # adds to the TP 1 step cost).
        n = old.runs
        new_step, tp_step = old.step_ms, dict(old.tp_step_ms)
        if latency is None and tp_run == 1:
            new_step = (old.step_ms * n + step_ms) / (n + 1)
        elif latency is None:
            extra = max(0.0, step_ms - old.step_ms)
            tp_step[tp_run] = (tp_step[tp_run] + extra) / 2 if tp_run in tp_step else extra
        overheads[gpu] = Overhead(
            step_ms=new_step,
            mem_bytes=mem,
            sync_x=old.sync_x if sync_x is None else old.sync_x * sync_x,
            shard_x=shard_x if gpu in shard_gpus and shard_x else old.shard_x,
            p2p_ms=old.p2p_ms if latency is None else latency,
            runs=n + 1,
            tp_step_ms=tp_step,
        )
    for gpu in shard_gpus - set(gpus):  # sharded stages only on this type
        overheads[gpu] = replace(overheads.get(gpu) or Overhead(), shard_x=shard_x or 1.0)
    meta = {**profile.meta, "calibrated_from": [*runs, run_id]}
    if fitted:
        meta[RC_FITTED] = sorted(fitted)
    refit = replace(profile.with_entries(entries), overheads=overheads, meta=meta)
    return refit, rows


def _with_shard_x(profile: Profile, gpus: set[str], x: float, run_id: str) -> Profile:
    """``profile`` with the sharded collectives' factor of ``gpus`` refitted to ``x``
    (a run of weight-sharded stages only: nothing else to refit)."""
    overheads = dict(profile.overheads)
    for gpu in gpus:
        overheads[gpu] = replace(overheads.get(gpu) or Overhead(), shard_x=x)
    runs = list(profile.meta.get("calibrated_from", []))
    meta = {**profile.meta, "calibrated_from": [*runs, run_id]}
    return replace(profile, overheads=overheads, meta=meta)


def _pipelined(stages: Sequence[Mapping[str, Any]]) -> bool:
    return any(int(st["stage"]) > 0 for st in stages)


def _fit_latency(
    check: Mapping[str, Any], stages: Sequence[Mapping[str, Any]], step_overhead_ms: float
) -> float | None:
    """The per-exchange latency L >= 0 with which the simulated 1F1B of the measured
    stage times, plus the known fixed step cost, gives the measured step (bisection:
    the makespan grows with L)."""
    from autohet_cli.launch.compare import explained_ms

    measured = check.get("step", {}).get("measured_ms")
    sends = check.get("send_ms")
    if measured is None:
        return None

    def gap(latency: float) -> float:
        explained = explained_ms(stages, sends, latency)
        return float("nan") if explained is None else explained + step_overhead_ms - measured

    if not gap(0.0) < 0:  # already explained (or unmeasurable): no latency to add
        return 0.0
    lo, hi = 0.0, 1.0
    while gap(hi) < 0 and hi < 1e6:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return hi


def _sync_ratio(check: Mapping[str, Any], stages: Sequence[Mapping[str, Any]]) -> float | None:
    """Measured / predicted gradient all-reduce: the collective itself (without the
    wait for slower replicas, ``compare.collective_sync_ms``) against the plan's (the
    prediction already carries the profile's current factor, so factors compose)."""
    from autohet_cli.launch.compare import collective_sync_ms

    predicted = float(check.get("step", {}).get("predicted_sync_ms") or 0.0)
    measured = collective_sync_ms(stages)
    if predicted <= 0 or measured <= 0:
        return None
    return measured / predicted


def _ratios(acc: Sequence[float]) -> list[float]:
    """Measured / predicted forward, backward and update from a key's sums."""
    return [acc[2 * i] / acc[2 * i + 1] if acc[2 * i + 1] > 0 else 1.0 for i in range(3)]


def _scaled(
    entry: ProfileEntry,
    ratios: Sequence[float] | None,
    dtype: str,
    *,
    recompute: Sequence[float] | None = None,
) -> ProfileEntry:
    """``entry`` with its plain times scaled by ``ratios`` and its recomputation
    times by ``recompute`` (each None: not run; the recomputation times then follow
    the plain ratios, the best evidence of how this card runs the model). The
    update ratio comes from plain stages when the run had any."""
    f, b, u = ratios if ratios is not None else (1.0, 1.0, 1.0)
    rf, rb, ru = recompute if recompute is not None else (f, b, u)
    if ratios is None:
        u = ru
    layers = tuple(
        LayerTiming(
            fwd_ms=lt.fwd_ms * f,
            bwd_ms=lt.bwd_ms * b,
            update_ms=lt.update_ms * u,
            num_params=lt.num_params,
            act_bytes=lt.act_bytes,
            output_bytes=lt.output_bytes,
            **(
                {}  # nothing measured either way: they keep following the plain times
                if recompute is None and lt.recompute_fwd_ms is None
                else {"recompute_fwd_ms": lt.rc_fwd_ms * rf, "recompute_bwd_ms": lt.rc_bwd_ms * rb}
            ),
        )
        for lt in entry.layers
    )
    return replace(entry, layers=layers, source="calibrated", dtype=dtype)


def spread(profile: Profile, original: Profile) -> Profile:
    """Carry each run-refitted (GPU type, TP degree) ratio to that type and degree's
    other micro-batch sizes that were only probed.

    A run refits the one micro-batch size it ran. Left alone, the probed sizes
    beside it would look as fast as the probe's isolated layers, and the planner
    would favour them for that alone. Per term (forward, backward, update), the
    ratio is refitted over ``original``'s entry (the probe's), summed over layers.
    """
    refitted = [
        (k, e)
        for k, e in profile.entries.items()
        if e.source == "calibrated" and k in original.entries
    ]
    out: list[ProfileEntry] = []
    for k, e in refitted:
        base = original.entries[k]
        for k2, e2 in profile.entries.items():
            same = (k2.model, k2.gpu_type, k2.tensor_parallel, k2.seq_len) == (
                k.model,
                k.gpu_type,
                k.tensor_parallel,
                k.seq_len,
            )
            if same and k2 != k and e2.source == "measured" and e2.dtype == e.dtype:
                out.append(_carried(e2, e, base))
    return profile.with_entries(out)


def carry_to_tp(profile: Profile, original: Profile, tps: Sequence[int]) -> Profile:
    """Carry the TP 1 refit to TP degrees ``tps`` whose own run failed.

    Left alone, a failed TP run leaves that degree at the probe's isolated times
    while TP 1 has been refitted slower, and the planner would favour TP for that
    alone. TP 1's ratios (per term, over ``original``'s probe entry at the same
    micro-batch size) are the least a TP run is slower than its probe: TP only adds
    collectives the probe timed apart."""
    out: list[ProfileEntry] = []
    for k, e in profile.entries.items():
        if k.tensor_parallel not in tps or e.source != "measured":
            continue
        k1 = replace(k, tensor_parallel=1)
        refit, base = profile.entries.get(k1), original.entries.get(k1)
        if refit is None or base is None or refit.source != "calibrated":
            continue
        if refit.dtype != e.dtype:
            continue
        out.append(_carried(e, refit, base))
    return profile.with_entries(out)


def _carried(target: ProfileEntry, refit: ProfileEntry, base: ProfileEntry) -> ProfileEntry:
    """``target`` scaled per term by how a run refitted ``base`` into ``refit``
    (summed over layers); recomputation times only where one of them measured them,
    so derived ones stay derived."""
    ratios = [_sum_ratio(refit.layers, base.layers, t) for t in ("fwd_ms", "bwd_ms", "update_ms")]
    rc = [_sum_ratio(refit.layers, base.layers, t) for t in ("rc_fwd_ms", "rc_bwd_ms")]
    carried = [*rc, ratios[2]] if _has_rc(refit) or _has_rc(base) else None
    return _scaled(target, ratios, target.dtype, recompute=carried)


def _has_rc(entry: ProfileEntry) -> bool:
    """Whether ``entry`` holds recomputation times of its own (not derived ones)."""
    return any(lt.recompute_fwd_ms is not None for lt in entry.layers)


def _sum_ratio(refit: Sequence[LayerTiming], base: Sequence[LayerTiming], term: str) -> float:
    num = sum(getattr(lt, term) for lt in refit)
    den = sum(getattr(lt, term) for lt in base)
    return num / den if den > 0 and num > 0 else 1.0
