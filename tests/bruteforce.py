"""Exhaustive reference planner for tiny cases (test helper, not shipped).

It searches AutoHet's whole plan space and scores plans with the same
``costmodel.evaluate.evaluate`` the planner minimises:

- a TP degree per GPU type (``per_type_tp``; else one degree t per plan); a TP
  group is t GPUs of one host (a host with n GPUs offers n // t groups); any
  number of pipelines (data-parallel replicas), each an ordered list of TP groups
  (its stages: any hosts and types, order matters);
- each pipeline splits the layers into contiguous, non-empty, half-open ranges;
- a micro-batch size dividing the global batch B; each pipeline takes >= 1
  micro-batch and they sum to M = B / mbs; GPUs may stay idle;
- with ``recompute=True``, each stage with or without activation recomputation.
  Exactly: for a fixed layout and micro-batch count a stage's memory depends only
  on its own flag and recomputing only slows it, so the best flags recompute
  exactly the stages that do not fit without it (``_Space.flags``);
- with tables whose ``training.zero1`` is on, ZeRO-1's sharded optimizer state.
  A stage then keeps 1/P of the state of its untied layers, where P is the number
  of pipelines, when every pipeline holds them at the same degree. In a space of one
  degree for every type that is always so, and a stage's memory and update depend
  only on its own shape and P: everything below is keyed by P too and stays exact.
  Where types have different degrees, a segment held at two degrees is not sharded:
  the per-pipeline figures assume it is (a relaxation, so bounds stay bounds), and
  a plan whose whole-plan ``evaluate`` then does not fit has every micro-batch
  composition of its shapes evaluated whole instead (``_whole_plans``).

Symmetry. ``evaluate`` looks at a stage's host (type, memory, links), never at
which GPU of the host it runs on, so a pipeline *shape* is (sequence of hosts,
layer bounds) and a plan is a *multiset* of shapes (pipelines are unordered)
whose host usage fits the hosts' TP-group counts. A *composition* is the
multiset of host sequences alone. Devices are assigned at the end.

Decomposition. ``evaluate`` gives iteration = max_p T_p(m_p) + sync + opt, where
pipeline p's time T_p and memory fit depend only on its own shape and
micro-batch count m_p, while sync and opt depend only on the shapes (all stage
boundaries; opt's fixed step cost on their GPU types and number of GPUs), not on
the m_p. So for each multiset of shapes the best micro-batch
distribution is the min-max allocation of M over the T_p (greedy when every T_p
is non-decreasing in m, else a dynamic program over all compositions of M), and
one ``evaluate`` of that whole plan gives its exact iteration time.

Branch and bound, exact. Compositions are visited in order of a lower bound
and the search stops when the bound reaches the best plan found. Bounds: a
pipeline cannot finish before its stage s has run all m micro-batches forward
and backward after the first forward reached it, and before the last backward
then returns to stage 0 (plus the sends between); memory is checked exactly
with ``stage_memory_bytes``; the optimizer step is the largest stage update;
gradient sync moves at least the whole model's gradients through rings of the
fastest link, spread over a pipeline's stages. Within a composition the fixed
per-step cost is added too (exact: it depends on the composition alone; the
visiting order leaves it out, so that which of equal optima is found does not
change with it), and the gradient sync bound is only computed for the layer
splits the rest of the bound does not already rule out. Every exact pipeline
time computed is checked against its bound, so a wrong bound fails loudly
instead of pruning the optimum. ``prune=False`` turns the pruning off, and
``naive_brute_force`` also skips the decomposition (every composition of M is a
whole-plan ``evaluate``); tests compare the three on small cases.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import combinations, combinations_with_replacement, product
from typing import Any

from autohet_cli.cluster import Cluster, cluster_from_dict
from autohet_cli.costmodel.evaluate import (
    PlanEval,
    evaluate,
    ring_allreduce_ms,
    send_copies,
    stage_memory_bytes,
)
from autohet_cli.costmodel.tables import CostTables, StageCost
from autohet_cli.models import LayerSpec, ModelSpec, get_model
from autohet_cli.plan import Device, Pipeline, Stage
from autohet_cli.profiling.schema import EntryKey, LayerTiming, Profile, ProfileEntry
from autohet_cli.settings import TrainingSettings

INF = float("inf")
Seq = tuple[int, ...]  # host index per stage
Bounds = tuple[int, ...]  # 0 = b_0 < b_1 < ... < b_S = L


@dataclass(frozen=True, slots=True, kw_only=True)
class Optimum:
    iteration_ms: float
    tp: int
    mbs: int
    pipelines: list[Pipeline]
    eval: PlanEval
    compositions: int  # multisets of host sequences, over all (tp, mbs)
    visited: int  # compositions whose layer splits were enumerated
    evaluated: int  # whole plans scored by evaluate
    # shape sets whose per-pipeline figures (ZeRO-1 where degrees mix) were too
    # optimistic, so that every micro-batch composition was evaluated whole
    recounted: int = 0


def describe(pipelines: Sequence[Pipeline]) -> str:
    """Short human form: ``m=3 [A100-40@a0 0:4 | V100-16@v0 4:6]; ...``."""
    parts = []
    for p in pipelines:
        stages = " | ".join(
            f"{s.gpu_type}@{s.host} {s.layer_start}:{s.layer_end}" for s in p.stages
        )
        parts.append(f"m={p.num_microbatches} [{stages}]")
    return "; ".join(parts)


def _host_sequences(caps: Sequence[int], max_len: int) -> Iterator[Seq]:
    """Every ordered sequence of hosts, length 1..max_len, using host h <= caps[h] times."""
    used = [0] * len(caps)
    seq: list[int] = []

    def rec() -> Iterator[Seq]:
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


def _min_max(
    times: Sequence[Sequence[float]], M: int, monotone: bool = False
) -> tuple[float, list[int]] | None:
    """Micro-batches per pipeline (each >= 1, summing to M) minimising max_p T_p(m_p);
    ``times[p][m - 1]`` is T_p(m) for m = 1..M - P + 1 (inf: does not fit); lists
    may run longer, the entries past M - P + 1 are never taken. ``monotone``: the
    caller knows every list is non-decreasing (else it is checked up to M - P + 1)."""
    P = len(times)
    if P > M:
        return None
    if P == 1:  # what the greedy and the dynamic program both give: all M on it
        last = times[0][M - 1]
        return None if last == INF else (last, [M])
    top = M - P + 1
    if monotone or all(all(a <= b for a, b in zip(t[:top], t[1:top], strict=False)) for t in times):
        return _greedy(times, M)
    return _dp(times, M)


def _non_decreasing(values: Sequence[float]) -> bool:
    return all(a <= b for a, b in zip(values, values[1:], strict=False))


def _greedy(times: Sequence[Sequence[float]], M: int) -> tuple[float, list[int]] | None:
    """Exact for non-decreasing T_p: always grow the pipeline whose next value is least."""
    P = len(times)
    ms = [1] * P
    worst = max(t[0] for t in times)
    if worst == INF:
        return None
    heap = [(t[1], p) for p, t in enumerate(times) if len(t) > 1]
    heapq.heapify(heap)
    for _ in range(M - P):
        value, p = heapq.heappop(heap)
        if value == INF:
            return None
        ms[p] += 1
        worst = max(worst, value)
        if ms[p] < len(times[p]):
            heapq.heappush(heap, (times[p][ms[p]], p))
    return worst, ms


def _dp(times: Sequence[Sequence[float]], M: int) -> tuple[float, list[int]] | None:
    P = len(times)
    # best[i][r]: least max T over pipelines i.. taking r micro-batches, each >= 1
    best = [[INF] * (M + 1) for _ in range(P + 1)]
    pick = [[0] * (M + 1) for _ in range(P + 1)]
    best[P][0] = -INF
    for i in range(P - 1, -1, -1):
        for r in range(1, M + 1):
            for m in range(1, min(r, len(times[i])) + 1):
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


def _step_overhead_ms(pipelines: Sequence[Pipeline], tables: CostTables) -> float:
    """``evaluate``'s fixed per-step cost of these pipelines as a whole plan."""
    stages = [s for p in pipelines for s in p.stages]
    world = sum(s.tensor_parallel for s in stages)
    return max(tables.step_overhead_ms(s.gpu_type, s.tensor_parallel, world) for s in stages)


class _Space:
    """One (TP degree per GPU type, micro-batch size): the hosts' TP groups, bounds
    and caches. ``tp``: one degree for every type, or a degree per type.

    The caches are keyed by ``(seq, bounds, Pk)``, where ``Pk`` is the number of
    pipelines where ZeRO-1 shards (it changes memory and update) and 1 elsewhere:
    without sharding a shape's figures do not depend on the plan around it. Below
    them, what one stage costs and whether it fits is kept per (host, layers,
    micro-batches in flight), which many shapes share."""

    def __init__(
        self,
        cluster: Cluster,
        tables: CostTables,
        tp: int | Mapping[str, int],
        mbs: int,
        M: int,
        recompute: bool = False,
    ) -> None:
        degree = {h.gpu_type: tp if isinstance(tp, int) else tp[h.gpu_type] for h in cluster.hosts}
        self.cluster, self.tables, self.mbs, self.M = cluster, tables, mbs, M
        self.recompute = recompute
        self.zero1 = tables.training.zero1
        hosts = [h for h in cluster.hosts if h.num_gpus // degree[h.gpu_type] >= 1]
        self.hosts = hosts
        self.tps = [degree[h.gpu_type] for h in hosts]
        self.tp = max(self.tps, default=1)  # the plan-level degree
        self.degrees = tuple(sorted(degree.items()))
        self.caps = [h.num_gpus // t for h, t in zip(hosts, self.tps, strict=True)]
        self.lt = [
            tables.table(h.gpu_type, t, mbs, h.intra_node_gbps)
            for h, t in zip(hosts, self.tps, strict=True)
        ]
        L = self.L = tables.model.num_layers
        self.splits = {
            S: [(0, *cuts, L) for cuts in combinations(range(1, L), S - 1)] for S in range(1, L + 1)
        }
        self.seqs = list(_host_sequences(self.caps, L)) if hosts else []
        self.one_degree = len(set(self.tps)) <= 1
        Key = tuple[Seq, Bounds, int]
        self._flags: dict[Key, list[tuple[bool, ...] | None]] = {}
        self._lb: dict[Key, list[float]] = {}
        self._opt: dict[Key, float] = {}
        self._monotone: dict[Key, bool] = {}
        self._exact: dict[Key, list[float]] = {}
        self._best_lb: dict[tuple[Seq, int], list[float]] = {}
        self._best_opt: dict[tuple[Seq, int], float] = {}
        self._best_monotone: dict[tuple[Seq, int], bool] = {}
        # per stage: (host, start, end, recompute) -> cost; (host, start, end,
        # stages to the end, Pk) -> whether it fits (``_fits``); (host, start, end,
        # Pk) -> update less ZeRO-1's share; (host, start, end, next host) -> send
        self._costs: dict[tuple[int, int, int, bool], StageCost] = {}
        self._fits_of: dict[tuple[int, int, int, int, int], tuple[int, ...]] = {}
        self._updates: dict[tuple[int, int, int, int], float] = {}
        self._sends: dict[tuple[int, int, int, int], float] = {}
        # sync bounds: layer -> stage of a split; (hosts, a, b, P) -> a segment's time
        self._stage_of: dict[Bounds, tuple[int, ...]] = {}
        self._segments: dict[tuple[tuple[int, ...], int, int, int], float] = {}
        self._steps: dict[tuple[frozenset[int], int], float] = {}
        model = tables.model
        tied = {i for i, layer in enumerate(model.layers()) if layer.kind in ("embedding", "head")}
        self.tied = tied if model.tied_embeddings else set()
        # Sync bounds: each layer's gradients as the lightest type reports them.
        grad = tables.training.grad_bytes_per_param
        self.grad_prefix = [0.0]
        for i in range(L):
            least = min(t.params(i, i + 1) for t in self.lt) if hosts else 0
            self.grad_prefix.append(self.grad_prefix[-1] + least * grad)

    # ---------------------------------------------------------------- bounds

    def _pk(self, P: int) -> int:
        """The pipeline count a shape's figures depend on: P where ZeRO-1 shards."""
        return P if self.zero1 and P > 1 else 1

    def _cost(self, h: int, a: int, b: int, recompute: bool) -> StageCost:
        key = (h, a, b, recompute)
        got = self._costs.get(key)
        if got is None:
            got = self._costs[key] = self.lt[h].stage(a, b, recompute=recompute)
        return got

    def _stage_costs(
        self, seq: Seq, bounds: Bounds, flags: Sequence[bool] | None = None
    ) -> list[StageCost]:
        return [
            self._cost(h, bounds[s], bounds[s + 1], bool(flags and flags[s]))
            for s, h in enumerate(seq)
        ]

    def _sharded(self, h: int, a: int, b: int, P: int) -> float:
        if not self.zero1 or P < 2:
            return 0.0
        lt = self.lt[h]
        untied = (i for i in range(a, b) if i not in self.tied)
        return sum(lt.params(i, i + 1) for i in untied) * (1 - 1 / P)

    def sharded_params(self, seq: Seq, bounds: Bounds, s: int, P: int) -> float:
        """Parameters per GPU of stage ``s`` whose optimizer state ZeRO-1 takes off
        it with ``P`` pipelines (its untied layers; all of them shard in a space of
        one degree, at most all of them otherwise)."""
        return self._sharded(seq[s], bounds[s], bounds[s + 1], P)

    def _fits(self, h: int, a: int, b: int, depth: int, Pk: int) -> tuple[int, ...]:
        """Whether a stage on host ``h`` holding [a, b), ``depth`` stages from the
        end of its pipeline, fits with k = 1..depth micro-batches in flight: 0 plain,
        1 only recomputing (when allowed), -1 neither. Under 1F1B it has
        min(depth, m) in flight at m micro-batches, and its memory depends on m only
        through that."""
        key = (h, a, b, depth, Pk)
        got = self._fits_of.get(key)
        if got is None:
            host = self.hosts[h]
            per_param = self.tables.training.optimizer_bytes_per_param
            freed = int(self._sharded(h, a, b, Pk) * per_param)
            options = [False, True] if self.recompute else [False]
            codes = []
            for k in range(1, depth + 1):
                fit = [
                    stage_memory_bytes(
                        self._cost(h, a, b, rc), self.tables, host.gpu_type, 0, depth, k
                    )
                    - freed
                    <= host.gpu_mem_bytes
                    for rc in options
                ]
                codes.append((0 if fit[0] else 1) if any(fit) else -1)
            got = self._fits_of[key] = tuple(codes)
        return got

    def flags(self, seq: Seq, bounds: Bounds, P: int = 1) -> list[tuple[bool, ...] | None]:
        """Per micro-batch count m = 1..M, each stage's recomputation: off where the
        plain stage fits, on where only recomputation fits (when allowed); None
        where some stage fits neither way. ``P``: the plan's pipelines (ZeRO-1).
        From m = S on, every stage has all it can hold in flight: the same flags."""
        key = (seq, bounds, Pk := self._pk(P))
        got = self._flags.get(key)
        if got is not None:
            return got
        S = len(seq)
        fits = [self._fits(h, bounds[s], bounds[s + 1], S - s, Pk) for s, h in enumerate(seq)]
        out: list[tuple[bool, ...] | None] = []
        for m in range(1, min(S, self.M) + 1):
            codes = [f[min(len(f), m) - 1] for f in fits]
            out.append(None if -1 in codes else tuple(c == 1 for c in codes))
        out.extend([out[-1]] * (self.M - len(out)))
        self._flags[key] = out
        return out

    def _send_ms(self, h: int, a: int, b: int, nxt: int) -> float:
        """The bound's send from stage [a, b) on host ``h`` to the next on ``nxt``."""
        key = (h, a, b, nxt)
        got = self._sends.get(key)
        if got is None:
            copies = send_copies(self.tps[h], self.tps[nxt])
            gbps = self.cluster.link_gbps(self.hosts[h].name, self.hosts[nxt].name)
            out = self._cost(h, a, b, False).output_bytes
            got = self._sends[key] = out * copies / (gbps * 1e9 / 8) * 1e3
        return got

    def _update(self, h: int, a: int, b: int, Pk: int) -> float:
        """A stage's update, less ZeRO-1's share (at most, where degrees mix)."""
        key = (h, a, b, Pk)
        got = self._updates.get(key)
        if got is None:
            x = self._cost(h, a, b, False)
            got = self._updates[key] = (
                x.update_ms * (1 - self._sharded(h, a, b, Pk) / x.num_params)
                if x.num_params > 0
                else x.update_ms
            )
        return got

    def lb_times(self, seq: Seq, bounds: Bounds, P: int = 1) -> list[float]:
        """Lower bound of T(m), m = 1..M (inf: does not fit at m), in a plan of
        ``P`` pipelines."""
        key = (seq, bounds, Pk := self._pk(P))
        got = self._lb.get(key)
        if got is not None:
            return got
        S = len(seq)
        flags = self.flags(seq, bounds, P)
        sends = [self._send_ms(seq[s], bounds[s], bounds[s + 1], seq[s + 1]) for s in range(S - 1)]
        # (start offset, per micro-batch time) per stage, per choice of flags
        by_flags: dict[tuple[bool, ...], list[tuple[float, float]]] = {}
        out = []
        for m in range(1, self.M + 1):
            chosen = flags[m - 1]
            if chosen is None:
                out.append(INF)
                continue
            terms = by_flags.get(chosen)
            if terms is None:
                c = self._stage_costs(seq, bounds, chosen)
                t = [x.fwd_ms + x.bwd_ms for x in c]
                pre = [0.0] * S
                for s in range(1, S):
                    pre[s] = pre[s - 1] + t[s - 1] + 2 * sends[s - 1]
                terms = by_flags[chosen] = list(zip(pre, t, strict=True))
            out.append(max(p + m * x for p, x in terms))
        self._lb[key] = out
        self._monotone[key] = _non_decreasing(out)
        # the largest stage update, less ZeRO-1's share (at most, where degrees mix)
        self._opt[key] = max(
            self._update(h, bounds[s], bounds[s + 1], Pk) for s, h in enumerate(seq)
        )
        return out

    def bound(self, seq: Seq, bounds: Bounds, P: int) -> tuple[list[float], float, bool]:
        """``lb_times``, ``opt_ms`` and whether those times are non-decreasing."""
        key = (seq, bounds, self._pk(P))
        got = self._lb.get(key)
        if got is None:
            got = self.lb_times(seq, bounds, P)
        return got, self._opt[key], self._monotone[key]

    def opt_ms(self, seq: Seq, bounds: Bounds, P: int = 1) -> float:
        return self.bound(seq, bounds, P)[1]

    def best_lb(self, seq: Seq, P: int = 1) -> list[float]:
        key = (seq, self._pk(P))
        got = self._best_lb.get(key)
        if got is None:
            found = [self.bound(seq, b, P) for b in self.splits[len(seq)]]
            got = self._best_lb[key] = [
                min(col) for col in zip(*(f[0] for f in found), strict=True)
            ]
            self._best_opt[key] = min(f[1] for f in found)
            self._best_monotone[key] = _non_decreasing(got)
        return got

    def best_opt(self, seq: Seq, P: int = 1) -> float:
        self.best_lb(seq, P)
        return self._best_opt[(seq, self._pk(P))]

    def _link(self, a: int, b: int) -> float:
        return self.cluster.link_gbps(self.hosts[a].name, self.hosts[b].name)

    def composition_sync_lb(self, comp: Sequence[Seq]) -> float:
        """Every segment's ring runs inside one host (only a host every pipeline
        uses) or over some link between the composition's hosts, times the TP ranks
        that share a NIC (the fewest: a full-gradient sync moves at least that); the segments
        cover the model, and a pipeline of S stages syncs them on S stages."""
        P = len(comp)
        if P < 2:
            return 0.0
        used = sorted(set().union(*comp))
        common = set.intersection(*(set(s) for s in comp))
        per_byte = [ring_allreduce_ms(1.0, P, self.hosts[h].intra_node_gbps) for h in common]
        links = [self._link(a, b) for a in used for b in used if a < b]
        if links:
            least = min(self.hosts[h].nic_share(self.tps[h]) for h in used)
            per_byte.append(least * ring_allreduce_ms(1.0, P, max(links)))
        return min(per_byte) * self.grad_prefix[-1] / min(len(s) for s in comp)

    def _stages_of(self, bounds: Bounds) -> tuple[int, ...]:
        """The stage of a split that holds each layer."""
        got = self._stage_of.get(bounds)
        if got is None:
            got = self._stage_of[bounds] = tuple(
                s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])
            )
        return got

    def _segment_lb(self, hosts: tuple[int, ...], a: int, b: int, P: int) -> float:
        key = (hosts, a, b, P)
        got = self._segments.get(key)
        if got is None:
            nbytes = self.grad_prefix[b] - self.grad_prefix[a]
            if len(hosts) == 1:
                gbps = self.hosts[hosts[0]].intra_node_gbps
            else:
                gbps = min(self._link(x, y) for x in hosts for y in hosts if x < y)
                nbytes *= min(self.hosts[h].nic_share(self.tps[h]) for h in hosts)
            got = self._segments[key] = ring_allreduce_ms(nbytes, P, gbps)
        return got

    def sync_lb(self, shapes: Sequence[tuple[Seq, Bounds]]) -> float:
        """``evaluate``'s gradient sync with each layer at its lightest type's size."""
        P = len(shapes)
        if P < 2:
            return 0.0
        cuts = sorted({b for _, bounds in shapes for b in bounds})
        seqs = [seq for seq, _ in shapes]
        where = [self._stages_of(bounds) for _, bounds in shapes]
        busy = [[0.0] * len(seq) for seq in seqs]
        for a, b in zip(cuts, cuts[1:], strict=False):
            holders = [w[a] for w in where]
            hosts = tuple(sorted({seq[s] for seq, s in zip(seqs, holders, strict=True)}))
            t = self._segment_lb(hosts, a, b, P)
            for row, s in zip(busy, holders, strict=True):
                row[s] += t
        return max(max(row) for row in busy)

    def step_ms(self, comp: Sequence[Seq]) -> float:
        """``evaluate``'s fixed per-step cost of any plan of this composition: it
        depends on the stages' types and degrees and the GPUs in use, not on the
        layers (exact, so pruning with it drops only plans no faster)."""
        used = frozenset(h for seq in comp for h in seq)
        world = sum(self.tps[h] for seq in comp for h in seq)
        got = self._steps.get((used, world))
        if got is None:
            got = self._steps[(used, world)] = max(
                self.tables.step_overhead_ms(self.hosts[h].gpu_type, self.tps[h], world)
                for h in used
            )
        return got

    def composition_lb(self, comp: Sequence[Seq]) -> float:
        P = len(comp)
        lists = [self.best_lb(s, P) for s in comp]
        monotone = all(self._best_monotone[(s, self._pk(P))] for s in comp)
        solved = _min_max(lists, self.M, monotone)
        if solved is None:
            return INF
        opt = max(self.best_opt(s, P) for s in comp)
        return solved[0] + opt + self.composition_sync_lb(comp)

    # ---------------------------------------------------------------- exact

    def exact_times(self, seq: Seq, bounds: Bounds, upto: int, P: int = 1) -> list[float]:
        """T(m) for m = 1..upto (or more: the list is shared by every P of the same
        ``Pk``) from ``evaluate`` of the pipeline alone (its memory as one of ``P``
        pipelines: with ZeRO-1, ``flags`` says whether it fits)."""
        key = (seq, bounds, self._pk(P))
        times = self._exact.setdefault(key, [])
        if len(times) >= upto:
            return times
        lb = self.lb_times(seq, bounds, P)
        sharding = self.zero1 and P > 1
        while len(times) < upto:
            m = len(times) + 1
            (p,) = self.materialize([(seq, bounds)], [m], P)
            ev = evaluate([p], self.cluster, self.tables, self.mbs)
            fits = self.flags(seq, bounds, P)[m - 1] is not None if sharding else ev.fits
            t = ev.pipeline_ms if fits else INF
            # The bound must hold, else pruning could drop the optimum.
            assert lb[m - 1] <= t * (1 + 1e-9) + 1e-9, (seq, bounds, m, lb[m - 1], t)
            assert (lb[m - 1] == INF) == (t == INF), (seq, bounds, m, lb[m - 1], t)
            if not sharding:  # alone, nothing is sharded; plus the fixed step cost
                step = _step_overhead_ms([p], self.tables)
                assert math.isclose(
                    ev.optimizer_ms, self._opt[key] + step, rel_tol=1e-9, abs_tol=1e-12
                )
            times.append(t)
        return times

    def materialize(
        self, shapes: Sequence[tuple[Seq, Bounds]], ms: Sequence[int], P: int | None = None
    ) -> list[Pipeline]:
        """Concrete pipelines: each stage takes the next free TP group of its host;
        ``P``: the plan's pipelines (ZeRO-1's memory), ``len(shapes)`` by default."""
        nxt = [0] * len(self.hosts)
        out = []
        for (seq, bounds), m in zip(shapes, ms, strict=True):
            stages = []
            chosen = self.flags(seq, bounds, P or len(shapes))[m - 1] or (False,) * len(seq)
            for s, h in enumerate(seq):
                g = nxt[h]
                nxt[h] += 1
                host = self.hosts[h]
                stages.append(
                    Stage(
                        layer_start=bounds[s],
                        layer_end=bounds[s + 1],
                        gpu_type=host.gpu_type,
                        tensor_parallel=(t := self.tps[h]),
                        devices=tuple(Device(host=host.name, gpu=g * t + i) for i in range(t)),
                        recompute=chosen[s],
                    )
                )
            out.append(Pipeline(num_microbatches=m, stages=tuple(stages)))
        return out

    # ---------------------------------------------------------------- enumeration

    def compositions(self) -> Iterator[tuple[Seq, ...]]:
        """Multisets of host sequences fitting the hosts, at most M of them."""
        by_usage: dict[tuple[int, ...], list[Seq]] = {}
        for seq in self.seqs:
            usage = tuple(seq.count(h) for h in range(len(self.caps)))
            by_usage.setdefault(usage, []).append(seq)
        usages = list(by_usage)
        left = list(self.caps)
        counts = [0] * len(usages)

        def rec(start: int, total: int) -> Iterator[tuple[Seq, ...]]:
            if total:
                groups = [
                    combinations_with_replacement(by_usage[u], k)
                    for u, k in zip(usages, counts, strict=True)
                    if k
                ]
                for combo in product(*groups):
                    yield tuple(s for g in combo for s in g)
            if total == self.M:
                return
            for i in range(start, len(usages)):
                u = usages[i]
                if all(x <= y for x, y in zip(u, left, strict=True)):
                    for h, x in enumerate(u):
                        left[h] -= x
                    counts[i] += 1
                    yield from rec(i, total + 1)
                    counts[i] -= 1
                    for h, x in enumerate(u):
                        left[h] += x

        yield from rec(0, 0)

    def layer_splits(self, comp: Sequence[Seq]) -> Iterator[list[tuple[Seq, Bounds]]]:
        """Every assignment of layer bounds to the pipelines of a composition, up
        to swapping pipelines with the same host sequence."""
        groups = list(Counter(comp).items())
        choices = [combinations_with_replacement(self.splits[len(seq)], k) for seq, k in groups]
        for combo in product(*choices):
            yield [(seq, b) for (seq, _), bs in zip(groups, combo, strict=True) for b in bs]


def _spaces(
    cluster: Cluster,
    tables: CostTables,
    global_batch_size: int,
    tp_candidates: Sequence[int],
    mbs_candidates: Sequence[int],
    recompute: bool = False,
    per_type_tp: bool = False,
) -> Iterator[_Space]:
    """One degree for all types; or with ``per_type_tp`` every combination of a
    degree per type (a type's degree no host of it can hold leaves it idle, which
    every combination can do anyway, so those are skipped)."""
    degrees: list[int | dict[str, int]]
    if per_type_tp:
        types = sorted({h.gpu_type for h in cluster.hosts})
        options = [
            [
                t
                for t in tp_candidates
                if any(h.num_gpus >= t for h in cluster.hosts if h.gpu_type == g)
            ]
            for g in types
        ]
        degrees = [dict(zip(types, c, strict=True)) for c in product(*options)]
    else:
        degrees = [t for t in tp_candidates if any(h.num_gpus >= t for h in cluster.hosts)]
    for tp in degrees:
        for mbs in mbs_candidates:
            if global_batch_size % mbs == 0:
                yield _Space(cluster, tables, tp, mbs, global_batch_size // mbs, recompute)


def brute_force(
    cluster: Cluster,
    tables: CostTables,
    global_batch_size: int,
    *,
    tp_candidates: Sequence[int] = (1, 2, 4, 8),
    mbs_candidates: Sequence[int] = (1, 2, 4, 8),
    prune: bool = True,
    recompute: bool = False,
    per_type_tp: bool = True,
) -> Optimum | None:
    """The exact minimum of ``evaluate(...).iteration_ms`` over the whole space
    (None when no plan fits in memory); ``recompute``: stages may recompute;
    ``per_type_tp``: each GPU type has its own TP degree (else one for all)."""
    queue: list[tuple[float, int, _Space, tuple[Seq, ...]]] = []
    total = 0
    spaces = _spaces(
        cluster,
        tables,
        global_batch_size,
        tp_candidates,
        mbs_candidates,
        recompute,
        per_type_tp,
    )
    for space in spaces:
        for comp in space.compositions():
            total += 1
            lb = space.composition_lb(comp) if prune else 0.0
            if lb < INF:
                queue.append((lb, len(queue), space, comp))
    queue.sort(key=lambda x: (x[0], x[1]))
    best: tuple[float, _Space, list[Pipeline], PlanEval] | None = None
    visited = evaluated = recounted = 0
    for lb, _, space, comp in queue:
        if best is not None and lb >= best[0]:
            break
        # the fixed step cost is the same for every plan of the composition
        step = space.step_ms(comp) if prune else 0.0
        if best is not None and lb + step >= best[0]:
            continue
        visited += 1
        M = space.M
        top = M - len(comp) + 1
        P = len(comp)
        for shapes in space.layer_splits(comp):
            figures = [space.bound(*sh, P) for sh in shapes]
            opt = max(f[1] for f in figures)
            sync_lb = 0.0
            if prune:
                bound = _min_max([f[0] for f in figures], M, all(f[2] for f in figures))
                if bound is None:
                    continue
                if best is not None:
                    least = bound[0] + opt + step  # the sync below only adds to it
                    if least >= best[0]:
                        continue
                    sync_lb = space.sync_lb(shapes)
                    if least + sync_lb >= best[0]:
                        continue
                else:
                    sync_lb = space.sync_lb(shapes)
            solved = _min_max([space.exact_times(*sh, top, P) for sh in shapes], M)
            if solved is None:
                continue
            pipe_ms, ms = solved
            if prune and best is not None and pipe_ms + opt + step + sync_lb >= best[0]:
                continue
            pipelines = space.materialize(shapes, ms)
            ev = evaluate(pipelines, cluster, tables, space.mbs)
            evaluated += 1
            if not ev.fits:
                # ZeRO-1 where degrees mix: a segment at two degrees is not sharded,
                # which the per-pipeline figures assumed; every composition, whole
                assert space.zero1 and not space.one_degree and P > 1
                recounted += 1
                found = _whole_plans(space, shapes)
                evaluated += found[0]
                if found[1] is None:
                    continue
                pipelines, ev = found[1]
            else:
                assert math.isclose(ev.pipeline_ms, pipe_ms, rel_tol=1e-12, abs_tol=1e-12)
            assert ev.grad_sync_ms >= sync_lb * (1 - 1e-9), (ev.grad_sync_ms, sync_lb)
            assert ev.optimizer_ms >= (opt + step) * (1 - 1e-9), (ev.optimizer_ms, opt, step)
            if best is None or ev.iteration_ms < best[0]:
                best = (ev.iteration_ms, space, pipelines, ev)
    if best is None:
        return None
    value, space, pipelines, ev = best
    tp = max(s.tensor_parallel for p in pipelines for s in p.stages)
    counts: dict[str, Any] = {"visited": visited, "evaluated": evaluated, "recounted": recounted}
    chosen: dict[str, Any] = {"tp": tp, "mbs": space.mbs, "pipelines": pipelines, "eval": ev}
    return Optimum(iteration_ms=value, compositions=total, **chosen, **counts)


def _whole_plans(
    space: _Space, shapes: Sequence[tuple[Seq, Bounds]]
) -> tuple[int, tuple[list[Pipeline], PlanEval] | None]:
    """The fastest fitting micro-batch composition of ``shapes``, each evaluated
    whole, and how many evaluations that took. With recomputation allowed, a plan
    recomputes exactly the stages that do not fit without it (exact, as in
    ``_Space.flags``: with the layout fixed, a stage's memory depends on its flag
    alone)."""
    best: tuple[list[Pipeline], PlanEval] | None = None
    count = 0
    for ms in _compositions_of(space.M, len(shapes)):
        plain = [
            replace(p, stages=tuple(replace(st, recompute=False) for st in p.stages))
            for p in space.materialize(shapes, ms)
        ]
        ev = evaluate(plain, space.cluster, space.tables, space.mbs)
        count += 1
        pipelines = plain
        if not ev.fits and space.recompute:
            pipelines = [
                replace(
                    p,
                    stages=tuple(
                        replace(st, recompute=pe.stages[s].mem_fraction > 1.0)
                        for s, st in enumerate(p.stages)
                    ),
                )
                for p, pe in zip(plain, ev.pipelines, strict=True)
            ]
            ev = evaluate(pipelines, space.cluster, space.tables, space.mbs)
            count += 1
        if ev.fits and (best is None or ev.iteration_ms < best[1].iteration_ms):
            best = (pipelines, ev)
    return count, best


def _compositions_of(total: int, parts: int) -> Iterator[tuple[int, ...]]:
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
    recompute: bool = False,
    per_type_tp: bool = True,
) -> float | None:
    """No decomposition, no bound: every multiset of shapes with every composition
    of M is one whole-plan ``evaluate``. Only for the tiniest cases. With
    ``recompute`` every stage also tries every flag (2**stages plans per split), so
    that ``_Space.flags``'s shortcut is checked, not assumed."""
    best = INF
    spaces = _spaces(
        cluster, tables, global_batch_size, tp_candidates, mbs_candidates, per_type_tp=per_type_tp
    )
    for space in spaces:
        for comp in space.compositions():
            for shapes in space.layer_splits(comp):
                for ms in _compositions_of(space.M, len(shapes)):
                    plain = space.materialize(shapes, ms)
                    stages = sum(len(p.stages) for p in plain)
                    for bits in product((False, True), repeat=stages if recompute else 0):
                        flags = iter(bits)
                        pipelines = [
                            replace(
                                p,
                                stages=tuple(
                                    replace(st, recompute=next(flags, False)) for st in p.stages
                                ),
                            )
                            for p in plain
                        ]
                        ev = evaluate(pipelines, cluster, tables, space.mbs)
                        if ev.fits:
                            best = min(best, ev.iteration_ms)
    return None if best == INF else best


# ----------------------------------------------------------------- tiny inputs


def tiny_model(num_blocks: int = 4, name: str | None = None) -> ModelSpec:
    """The zoo's gpt-tiny with ``num_blocks + 2`` partitionable layers (embedding,
    blocks, head)."""
    return replace(
        get_model("gpt-tiny"), name=name or f"toy-{num_blocks + 2}", num_blocks=num_blocks
    )


def synthetic_tables(
    model: ModelSpec,
    block_ms: Mapping[str, float],
    *,
    global_batch_size: int,
    seq_len: int = 64,
    tps: Sequence[int] = (1, 2, 4, 8),
    mbss: Sequence[int] = (1, 2, 4, 8),
    block_params: int = 2_000_000,
    act_mb_per_block: float = 20.0,
    mbs_exponent: float = 0.95,
    tp_overhead: float = 1.3,
    out_mb: float = 4.0,
    head_factor: float = 1.5,
    update_ms_per_block: float = 0.1,
    block_skew: Sequence[float] = (),
) -> CostTables:
    """Hand-made measured profile: per GPU type, forward+backward ms of one block
    at TP 1 and micro-batch 1 (backward = 2 x forward). A micro-batch of b costs
    b ** ``mbs_exponent`` times one sample; TP t divides compute by t and
    multiplies it by ``tp_overhead`` per doubling; the embedding costs 0.3 blocks,
    the head ``head_factor`` blocks; ``block_skew`` scales individual blocks.
    Embedding and head hold half a block's parameters; activations kept and
    bytes sent grow with the micro-batch."""
    weight = {"embedding": 0.3, "block": 1.0, "head": head_factor}

    def timing(layer: LayerSpec, ms: float, scale: float, tp: int, mbs: int) -> LayerTiming:
        w = weight.get(layer.kind, 0.2)
        if layer.kind == "block" and layer.index - 1 < len(block_skew):
            w *= block_skew[layer.index - 1]
        fwd = ms * w * scale / 3.0
        params = int(block_params * (0.5 if layer.kind != "block" else 1.0)) // tp
        held = {
            "act_bytes": act_mb_per_block * 1e6 * w * mbs / tp,
            "output_bytes": out_mb * 1e6 * mbs,
        }
        update_ms = update_ms_per_block * w / tp
        return LayerTiming(
            fwd_ms=fwd, bwd_ms=2.0 * fwd, update_ms=update_ms, num_params=params, **held
        )

    entries = {}
    names: dict[str, Any] = {"model": model.name, "seq_len": seq_len}
    for gpu, ms in block_ms.items():
        for tp, mbs in product(tps, mbss):
            scale = mbs**mbs_exponent / tp * tp_overhead ** (tp.bit_length() - 1)
            layers = tuple(timing(layer, ms, scale, tp, mbs) for layer in model.layers())
            key = EntryKey(gpu_type=gpu, tensor_parallel=tp, micro_batch_size=mbs, **names)
            entries[key] = ProfileEntry(key=key, source="measured", dtype="bf16", layers=layers)
    training = TrainingSettings(
        global_batch_size=global_batch_size, micro_batch_size=1, seq_len=seq_len
    )
    return CostTables(model, Profile(entries=entries), training)


def tiny_cluster(
    hosts: Sequence[tuple[str, str, int, float | None]],
    *,
    inter_node_gbps: float = 100.0,
    pairs: Sequence[tuple[str, str, float]] = (),
    name: str = "tiny",
) -> Cluster:
    """``hosts``: (name, GPU type, count, mem_gb or None for the catalog's);
    ``pairs``: (host, host, Gbit/s) link overrides."""
    raw_hosts = []
    for hname, gpu, count, mem_gb in hosts:
        gpus: dict[str, object] = {"type": gpu, "count": count}
        if mem_gb is not None:
            gpus["mem_gb"] = mem_gb
        raw_hosts.append({"name": hname, "gpus": gpus})
    network: dict[str, object] = {"inter_node_gbps": inter_node_gbps}
    if pairs:
        network["pairs"] = [{"hosts": [a, b], "gbps": g} for a, b, g in pairs]
    return cluster_from_dict(
        {"schema": "autohet.cluster/v1", "name": name, "network": network, "hosts": raw_hosts},
        name,
    )
