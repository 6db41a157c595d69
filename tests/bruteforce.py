"""Exhaustive reference planner for tiny cases (test helper, not shipped).

It enumerates AutoHet's whole search space and scores every plan with the same
``costmodel.evaluate.evaluate`` the planner minimises:

- one TP degree t for the plan; a TP group is t GPUs of one host (so a host with
  n GPUs offers n // t groups); any number of pipelines (data-parallel replicas),
  each an ordered list of TP groups (its stages, any hosts/types, order matters);
- each pipeline splits the layers into contiguous, non-empty, half-open ranges;
- a micro-batch size dividing the global batch B; each pipeline takes >= 1
  micro-batch and they sum to M = B / mbs; GPUs may stay idle.

Symmetry. ``evaluate`` looks at a stage's host (type, memory, links), never at
which GPU of the host it runs on, so a pipeline *shape* is (sequence of hosts,
layer bounds) and a plan is a *multiset* of shapes (pipelines are unordered)
whose host usage fits the hosts' TP-group counts. Devices are assigned at the end.

Decomposition. ``evaluate`` gives iteration = max_p T_p(m_p) + sync + opt, where
the pipeline time T_p and the memory fit of pipeline p depend only on its own
shape and micro-batch count m_p, and sync/opt only on the shapes (all stage
boundaries), not on the m_p. So for each multiset the best micro-batch
distribution is the min-max allocation of M over the T_p (exact: a threshold
search when every T_p is non-decreasing in m, which is checked, else a dynamic
program over all compositions of M), and one ``evaluate`` of the whole plan gives
its exact iteration time. ``naive_brute_force`` skips the decomposition (it
evaluates every composition of M for every multiset) to check it on the tiniest
cases.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations, product

from autohet_cli.cluster import Cluster, cluster_from_dict
from autohet_cli.costmodel.evaluate import PlanEval, evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.models import ModelSpec
from autohet_cli.plan import Device, Pipeline, Stage
from autohet_cli.profiling.schema import EntryKey, LayerTiming, Profile, ProfileEntry
from autohet_cli.settings import TrainingSettings

INF = float("inf")


@dataclass(frozen=True, slots=True, kw_only=True)
class Optimum:
    iteration_ms: float
    tp: int
    mbs: int
    pipelines: list[Pipeline]
    eval: PlanEval
    multisets: int  # plans (multisets of shapes) looked at, over all (tp, mbs)


@dataclass(slots=True)
class _Shape:
    hosts: tuple[int, ...]  # host index per stage
    bounds: tuple[int, ...]  # 0 = b_0 < b_1 < ... < b_S = L
    usage: tuple[int, ...]  # TP groups used per host
    times: list[float] = field(default_factory=list)  # times[m-1] = T(m), inf if it OOMs
    opt_ms: float = 0.0


def describe(pipelines: Sequence[Pipeline]) -> str:
    """Short human form: ``m=3 [A100-40@a0 0:4 | V100-16@v0 4:6]; ...``."""
    parts = []
    for p in pipelines:
        stages = " | ".join(
            f"{s.gpu_type}@{s.host} {s.layer_start}:{s.layer_end}" for s in p.stages
        )
        parts.append(f"m={p.num_microbatches} [{stages}]")
    return "; ".join(parts)


def _materialize(
    cluster: Cluster,
    names: Sequence[str],
    tp: int,
    shapes: Sequence[_Shape],
    ms: Sequence[int],
) -> list[Pipeline]:
    """Concrete pipelines: each stage takes the next free TP group of its host."""
    nxt = [0] * len(names)
    out = []
    for shape, m in zip(shapes, ms, strict=True):
        stages = []
        for s, h in enumerate(shape.hosts):
            g = nxt[h]
            nxt[h] += 1
            host = cluster.host(names[h])
            stages.append(
                Stage(
                    layer_start=shape.bounds[s],
                    layer_end=shape.bounds[s + 1],
                    gpu_type=host.gpu_type,
                    tensor_parallel=tp,
                    devices=tuple(Device(host=host.name, gpu=g * tp + i) for i in range(tp)),
                )
            )
        out.append(Pipeline(num_microbatches=m, stages=tuple(stages)))
    return out


def _host_sequences(caps: Sequence[int], max_len: int) -> Iterator[tuple[int, ...]]:
    """Every ordered sequence of hosts, length 1..max_len, using host h <= caps[h] times."""
    used = [0] * len(caps)
    seq: list[int] = []

    def rec() -> Iterator[tuple[int, ...]]:
        if seq:
            yield tuple(seq)
        if len(seq) == max_len:
            return
        for h, cap in enumerate(caps):
            if used[h] < cap:
                used[h] += 1
                seq.append(h)
                yield from rec()
                seq.pop()
                used[h] -= 1

    yield from rec()


def _shapes(caps: Sequence[int], num_layers: int) -> list[_Shape]:
    out = []
    for hosts in _host_sequences(caps, num_layers):
        usage = tuple(hosts.count(h) for h in range(len(caps)))
        for cuts in combinations(range(1, num_layers), len(hosts) - 1):
            out.append(_Shape(hosts=hosts, bounds=(0, *cuts, num_layers), usage=usage))
    return out


def _multisets(
    shapes: Sequence[_Shape], caps: Sequence[int], max_pipelines: int
) -> Iterator[list[int]]:
    """Multisets of shape indices (non-decreasing) whose usage fits ``caps``."""
    left = list(caps)
    chosen: list[int] = []

    def rec(start: int) -> Iterator[list[int]]:
        if chosen:
            yield chosen
        if len(chosen) == max_pipelines:
            return
        for i in range(start, len(shapes)):
            u = shapes[i].usage
            if all(x <= y for x, y in zip(u, left, strict=True)):
                for h, x in enumerate(u):
                    left[h] -= x
                chosen.append(i)
                yield from rec(i)
                chosen.pop()
                for h, x in enumerate(u):
                    left[h] += x

    yield from rec(0)


def _fill_times(
    shape: _Shape,
    cluster: Cluster,
    names: Sequence[str],
    tables: CostTables,
    tp: int,
    mbs: int,
    max_m: int,
) -> None:
    """T(m) for m = 1..max_m from ``evaluate`` of the pipeline alone (no sync)."""
    while len(shape.times) < max_m:
        m = len(shape.times) + 1
        if shape.times and shape.times[-1] == INF:
            shape.times.append(INF)  # memory only grows with m
            continue
        (p,) = _materialize(cluster, names, tp, [shape], [m])
        ev = evaluate([p], cluster, tables, mbs)
        shape.opt_ms = ev.optimizer_ms
        shape.times.append(ev.pipeline_ms if ev.fits else INF)


def _is_monotone(times: Sequence[float]) -> bool:
    return all(a <= b for a, b in zip(times, times[1:], strict=False))


def _min_max_shares(times: Sequence[Sequence[float]], M: int) -> tuple[float, list[int]] | None:
    """Micro-batches per pipeline (>= 1, summing to M) minimising max_p T_p(m_p)."""
    P = len(times)
    if P > M:
        return None
    if all(_is_monotone(t[: M - P + 1]) for t in times):
        return _threshold(times, M)
    return _dp(times, M)


def _threshold(times: Sequence[Sequence[float]], M: int) -> tuple[float, list[int]] | None:
    P = len(times)
    top = M - P + 1
    if any(t[0] == INF for t in times):
        return None
    values = sorted({x for t in times for x in t[:top] if x < INF})

    def counts(tau: float) -> list[int]:
        return [sum(1 for x in t[:top] if x <= tau) for t in times]

    if sum(counts(values[-1])) < M:
        return None
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(counts(values[mid])) >= M:
            hi = mid
        else:
            lo = mid + 1
    tau = values[lo]
    ms = counts(tau)
    extra = sum(ms) - M
    for i in range(P):  # give back what is not needed; T stays <= tau
        give = min(extra, ms[i] - 1)
        ms[i] -= give
        extra -= give
    return max(t[m - 1] for t, m in zip(times, ms, strict=True)), ms


def _dp(times: Sequence[Sequence[float]], M: int) -> tuple[float, list[int]] | None:
    P = len(times)
    # best[i][r]: min over m_i..m_{P-1} (each >= 1, sum r) of max T
    best = [[INF] * (M + 1) for _ in range(P + 1)]
    pick = [[0] * (M + 1) for _ in range(P + 1)]
    best[P][0] = -INF
    for i in range(P - 1, -1, -1):
        for r in range(1, M + 1):
            for m in range(1, r + 1):
                v = max(times[i][m - 1], best[i + 1][r - m])
                if v < best[i][r]:
                    best[i][r], pick[i][r] = v, m
    if best[0][M] == INF:
        return None
    ms, r = [], M
    for i in range(P):
        ms.append(pick[i][r])
        r -= pick[i][r]
    return best[0][M], ms


def _hosts_for(cluster: Cluster, tp: int) -> tuple[list[str], list[int]]:
    names = [h.name for h in cluster.hosts if h.num_gpus // tp >= 1]
    caps = [cluster.host(n).num_gpus // tp for n in names]
    return names, caps


def brute_force(
    cluster: Cluster,
    tables: CostTables,
    global_batch_size: int,
    *,
    tp_candidates: Sequence[int] = (1, 2, 4, 8),
    mbs_candidates: Sequence[int] = (1, 2, 4, 8),
) -> Optimum | None:
    """The exact optimum of ``evaluate(...).iteration_ms`` over the whole space
    (None when nothing fits)."""
    L = tables.model.num_layers
    best: Optimum | None = None
    looked = 0
    for tp in tp_candidates:
        names, caps = _hosts_for(cluster, tp)
        if not names:
            continue
        for mbs in mbs_candidates:
            if global_batch_size % mbs:
                continue
            M = global_batch_size // mbs
            shapes = _shapes(caps, L)
            for chosen in _multisets(shapes, caps, M):
                looked += 1
                P = len(chosen)
                picked = [shapes[i] for i in chosen]
                for s in picked:
                    _fill_times(s, cluster, names, tables, tp, mbs, M - P + 1)
                solved = _min_max_shares([s.times for s in picked], M)
                if solved is None:
                    continue
                pipe_ms, ms = solved
                lower = pipe_ms + max(s.opt_ms for s in picked)  # sync >= 0
                if best is not None and lower >= best.iteration_ms:
                    continue
                pipelines = _materialize(cluster, names, tp, picked, ms)
                ev = evaluate(pipelines, cluster, tables, mbs)
                assert ev.fits
                assert math.isclose(ev.pipeline_ms, pipe_ms, rel_tol=1e-12, abs_tol=1e-12)
                if best is None or ev.iteration_ms < best.iteration_ms:
                    best = Optimum(
                        iteration_ms=ev.iteration_ms,
                        tp=tp,
                        mbs=mbs,
                        pipelines=pipelines,
                        eval=ev,
                        multisets=0,
                    )
    if best is None:
        return None
    return Optimum(
        iteration_ms=best.iteration_ms,
        tp=best.tp,
        mbs=best.mbs,
        pipelines=best.pipelines,
        eval=best.eval,
        multisets=looked,
    )


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    for cuts in combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


def naive_brute_force(
    cluster: Cluster,
    tables: CostTables,
    global_batch_size: int,
    *,
    tp_candidates: Sequence[int] = (1, 2, 4, 8),
    mbs_candidates: Sequence[int] = (1, 2, 4, 8),
) -> float | None:
    """Like ``brute_force`` but every micro-batch composition is a whole-plan
    ``evaluate``: no decomposition, no bound. Only for the tiniest cases."""
    L = tables.model.num_layers
    best = INF
    for tp, mbs in product(tp_candidates, mbs_candidates):
        names, caps = _hosts_for(cluster, tp)
        if not names or global_batch_size % mbs:
            continue
        M = global_batch_size // mbs
        shapes = _shapes(caps, L)
        for chosen in _multisets(shapes, caps, M):
            picked = [shapes[i] for i in chosen]
            for ms in _compositions(M, len(picked)):
                ev = evaluate(_materialize(cluster, names, tp, picked, ms), cluster, tables, mbs)
                if ev.fits:
                    best = min(best, ev.iteration_ms)
    return None if best == INF else best


# ----------------------------------------------------------------- tiny inputs


def tiny_model(num_blocks: int = 4, name: str | None = None) -> ModelSpec:
    """A GPT with ``num_blocks + 2`` partitionable layers (embedding, blocks, head)."""
    return ModelSpec(
        name=name or f"toy-{num_blocks + 2}",
        family="gpt2",
        num_blocks=num_blocks,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=256,
        vocab_size=256,
        num_positions=64,
        default_seq_len=64,
    )


def synthetic_tables(
    model: ModelSpec,
    block_ms: Mapping[str, float],
    *,
    global_batch_size: int,
    seq_len: int = 64,
    tps: Sequence[int] = (1, 2, 4, 8),
    mbss: Sequence[int] = (1, 2, 4, 8),
    block_params: int = 10_000_000,
    act_mb_per_block: float = 20.0,
    out_mb: float = 4.0,
    head_factor: float = 1.5,
    update_ms_per_block: float = 0.1,
    block_skew: Sequence[float] = (),
) -> CostTables:
    """Hand-made measured profile: per GPU type, forward+backward ms of one block
    at TP 1 and micro-batch 1 (backward = 2 x forward). Larger micro-batches are
    more efficient per sample (mbs ** 0.85), TP divides compute with 15% overhead
    per doubling; the embedding costs 0.3 blocks, the head ``head_factor``
    blocks. ``block_skew`` multiplies individual blocks' times."""
    entries = {}
    for gpu, ms in block_ms.items():
        for tp in tps:
            for mbs in mbss:
                scale = mbs**0.85 / tp * 1.15 ** (tp.bit_length() - 1)
                layers = []
                for layer in model.layers():
                    w = {"embedding": 0.3, "block": 1.0, "head": head_factor}.get(layer.kind, 0.2)
                    if layer.kind == "block" and layer.index - 1 < len(block_skew):
                        w *= block_skew[layer.index - 1]
                    fwd = ms * w * scale / 3.0
                    params = int(block_params * (0.5 if layer.kind != "block" else 1.0)) // tp
                    layers.append(
                        LayerTiming(
                            fwd_ms=fwd,
                            bwd_ms=2.0 * fwd,
                            update_ms=update_ms_per_block * w / tp,
                            num_params=params,
                            act_bytes=act_mb_per_block * 1e6 * w * mbs / tp,
                            output_bytes=out_mb * 1e6 * mbs,
                        )
                    )
                key = EntryKey(
                    model=model.name,
                    gpu_type=gpu,
                    tensor_parallel=tp,
                    micro_batch_size=mbs,
                    seq_len=seq_len,
                )
                entries[key] = ProfileEntry(
                    key=key, source="measured", dtype="bf16", layers=tuple(layers)
                )
    training = TrainingSettings(
        global_batch_size=global_batch_size, micro_batch_size=1, seq_len=seq_len
    )
    return CostTables(model, Profile(entries=entries), training)


def tiny_cluster(
    hosts: Sequence[tuple[str, str, int, float | None]],
    *,
    inter_node_gbps: float = 100.0,
    name: str = "tiny",
) -> Cluster:
    """``hosts``: (name, GPU type, count, mem_gb or None for the catalog's)."""
    raw_hosts = []
    for hname, gpu, count, mem_gb in hosts:
        gpus: dict[str, object] = {"type": gpu, "count": count}
        if mem_gb is not None:
            gpus["mem_gb"] = mem_gb
        raw_hosts.append({"name": hname, "gpus": gpus})
    return cluster_from_dict(
        {
            "schema": "autohet.cluster/v1",
            "name": name,
            "network": {"inter_node_gbps": inter_node_gbps},
            "hosts": raw_hosts,
        },
        name,
    )
