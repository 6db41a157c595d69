"""Device groupings: the discrete half of the planner's search (pure).

Notation. A *class* c is a set of interchangeable hosts (same GPU type, memory
and intra-host bandwidth) at one TP degree t_c (each GPU type has its own degree
in a search context). A host with n GPUs offers floor(n/t_c) *TP groups*; class
c offers G_c of them. A *template* is the ordered list of classes of a
pipeline's stages; a *grouping* is (degrees, micro-batch size, [(template, k)]):
k identical pipelines per template, using at most G_c groups of each class (the
rest idle).

The continuous half (layer split, batch shares) is solved by SCIP per grouping
(milp.py). This module generates groupings and bounds them from below so that
the search never sends a hopeless grouping to the solver.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations, permutations, product
from typing import Any

from autohet_cli.cluster import Cluster, Host
from autohet_cli.costmodel.tables import LayerTable
from autohet_cli.models import ModelSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceClass:
    index: int
    gpu_type: str
    mem_bytes: int
    intra_node_gbps: float
    hosts: tuple[str, ...]
    groups_per_host: tuple[int, ...]  # TP groups of ``tp`` GPUs per host
    tp: int = 1
    # The most TP ranks of one group that share an inter-node NIC on any of its
    # hosts (``Host.nic_share``): what a ring across hosts multiplies its bytes by.
    nic_share: int = 1

    @property
    def num_groups(self) -> int:
        return sum(self.groups_per_host)

    @property
    def label(self) -> str:
        return f"{self.gpu_type}#{self.index}"


def device_classes(cluster: Cluster, tp: int | Mapping[str, int]) -> list[DeviceClass]:
    """Classes with at least one TP group at their degree (order: first appearance).

    ``tp``: one degree for every GPU type, or a degree per GPU type (a type left
    out of the mapping is left out of the classes)."""
    keyed: dict[tuple[str, int, float], list[Host]] = {}
    for h in cluster.hosts:
        keyed.setdefault((h.gpu_type, h.gpu_mem_bytes, h.intra_node_gbps), []).append(h)
    out: list[DeviceClass] = []
    for (gpu, mem, intra), hosts in keyed.items():
        degree = tp if isinstance(tp, int) else tp.get(gpu)
        if degree is None:
            continue
        usable = [h for h in hosts if h.num_gpus >= degree]
        if usable:
            out.append(
                DeviceClass(
                    index=len(out),
                    gpu_type=gpu,
                    mem_bytes=mem,
                    intra_node_gbps=intra,
                    hosts=tuple(h.name for h in usable),
                    groups_per_host=tuple(h.num_gpus // degree for h in usable),
                    tp=degree,
                    nic_share=max(h.nic_share(degree) for h in usable),
                )
            )
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStats:
    """A class's per-micro-batch costs split into the layers before the first
    block (head part), the blocks (as a mean, and the max for memory), and the
    layers after the last block (tail part).

    Built for recompute stages or plain ones (``block_stats(..., recompute=)``):
    with recompute, times carry the re-run forward, ``*_act`` are the layers'
    inputs kept per micro-batch in flight, and ``*_work_bytes`` the largest one
    layer's activations of the part, held once during that layer's backward
    (0 without recompute)."""

    head_ms: float
    block_ms: float
    tail_ms: float
    head_fwd_ms: float
    block_fwd_ms: float
    tail_fwd_ms: float
    head_params: int
    block_params: int  # the largest block, so memory checks stay safe
    tail_params: int
    head_act: float
    block_act: float
    tail_act: float
    head_upd_ms: float
    block_upd_ms: float
    tail_upd_ms: float
    out_bytes: float
    total_ms: float
    total_upd_ms: float
    head_work_bytes: float = 0.0
    block_work_bytes: float = 0.0
    tail_work_bytes: float = 0.0
    recompute: bool = False
    # autocast's 16-bit weight copies of a plain stage, held once (StageCost.cast_bytes)
    head_cast: float = 0.0
    block_cast: float = 0.0  # the largest block's
    tail_cast: float = 0.0

    def cast_bytes(self, n: Any, *, head: bool, tail: bool) -> Any:
        """The weight copies of a stage of ``n`` blocks (a number or a MILP variable)."""
        return (
            (self.head_cast if head else 0.0)
            + n * self.block_cast
            + (self.tail_cast if tail else 0.0)
        )

    def work_bytes(self, *, head: bool, tail: bool) -> float:
        """Transient bytes of a stage holding the head part, blocks, the tail part:
        the largest of the parts it may hold (safe whatever its block count)."""
        return max(
            self.block_work_bytes,
            self.head_work_bytes if head else 0.0,
            self.tail_work_bytes if tail else 0.0,
        )


def block_range(model: ModelSpec) -> tuple[int, int]:
    kinds = [layer.kind for layer in model.layers()]
    first = kinds.index("block")
    last = len(kinds) - 1 - kinds[::-1].index("block")
    return first, last + 1


def block_stats(table: LayerTable, model: ModelSpec, *, recompute: bool = False) -> BlockStats:
    a, b = block_range(model)
    n = b - a
    L = table.num_layers
    r = recompute
    head = table.stage(0, a, recompute=r) if a else None
    blocks = table.stage(a, b, recompute=r)
    tail = table.stage(b, L, recompute=r) if b < L else None
    max_params = max(table.params(i, i + 1) for i in range(a, b))
    max_act = max(table.stage(i, i + 1, recompute=r).act_bytes for i in range(a, b))
    whole = table.stage(0, L, recompute=r)
    return BlockStats(
        head_ms=(head.fwd_ms + head.bwd_ms) if head else 0.0,
        block_ms=(blocks.fwd_ms + blocks.bwd_ms) / n,
        tail_ms=(tail.fwd_ms + tail.bwd_ms) if tail else 0.0,
        head_fwd_ms=head.fwd_ms if head else 0.0,
        block_fwd_ms=blocks.fwd_ms / n,
        tail_fwd_ms=tail.fwd_ms if tail else 0.0,
        head_params=head.num_params if head else 0,
        block_params=max_params,
        tail_params=tail.num_params if tail else 0,
        head_act=head.act_bytes if head else 0.0,
        block_act=max_act,
        tail_act=tail.act_bytes if tail else 0.0,
        head_upd_ms=head.update_ms if head else 0.0,
        block_upd_ms=blocks.update_ms / n,
        tail_upd_ms=tail.update_ms if tail else 0.0,
        out_bytes=blocks.output_bytes,
        total_ms=whole.fwd_ms + whole.bwd_ms,
        total_upd_ms=whole.update_ms,
        head_work_bytes=head.transient_bytes if head else 0.0,
        block_work_bytes=blocks.transient_bytes,
        tail_work_bytes=tail.transient_bytes if tail else 0.0,
        recompute=recompute,
        head_cast=head.cast_bytes if head else 0.0,
        block_cast=max(table.stage(i, i + 1, recompute=r).cast_bytes for i in range(a, b)),
        tail_cast=tail.cast_bytes if tail else 0.0,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Template:
    classes: tuple[int, ...]  # class index per stage, in stage order
    hosts: tuple[str, ...] = ()  # host per stage for host-aligned pipelines, else empty

    @property
    def num_stages(self) -> int:
        return len(self.classes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Grouping:
    tp: int  # the largest degree of its classes
    mbs: int
    parts: tuple[tuple[Template, int], ...]  # (template, number of pipelines)
    lower_bound_ms: float = 0.0

    @property
    def num_pipelines(self) -> int:
        return sum(k for _, k in self.parts)

    def groups_used(self, num_classes: int) -> list[int]:
        used = [0] * num_classes
        for tpl, k in self.parts:
            for c in tpl.classes:
                used[c] += k
        return used


def min_depth(stats: BlockStats, capacity: float, state_bytes: int, num_blocks: int) -> int | None:
    """Fewest stages of one class that can hold the model (greedy fill is optimal
    here: a stage's block capacity depends only on its position)."""
    for depth in range(1, num_blocks + 3):
        if _fits(stats, capacity, state_bytes, num_blocks, depth):
            return depth
    return None


def _fits(stats: BlockStats, cap: float, state: int, n: int, depth: int) -> bool:
    left = n
    for s in range(depth):
        in_flight = depth - s
        fixed = 2 * stats.out_bytes + stats.work_bytes(head=s == 0, tail=s == depth - 1)
        fixed += stats.cast_bytes(0, head=s == 0, tail=s == depth - 1)
        if s == 0:
            fixed += stats.head_params * state + stats.head_act * in_flight
        if s == depth - 1:
            fixed += stats.tail_params * state + stats.tail_act * in_flight
        per_block = stats.block_params * state + stats.block_act * in_flight + stats.block_cast
        room = cap - fixed
        if room < 0:
            return False
        take = min(left, int(room // per_block)) if per_block > 0 else left
        if s == depth - 1:
            return take >= left
        if take < 1 and 0 < s:
            return False
        left -= take
    return left == 0


def homogeneous_options(num_groups: int, d_min: int) -> list[tuple[int, int]]:
    """(depth, pipelines) pairs worth trying for one class: for each depth the
    most pipelines that fit in the class, deduplicated (more pipelines of the
    same depth use more GPUs). Ordered from most data parallelism down."""
    best: dict[int, int] = {}
    for k in range(1, num_groups + 1):
        depth = num_groups // k
        if depth >= d_min:
            best[depth] = max(best.get(depth, 0), k)
    return sorted(best.items(), key=lambda x: (-x[1], x[0]))


def lower_bound_ms(
    parts: Sequence[tuple[Template, int]],
    stats: Sequence[BlockStats],
    num_microbatches: int,
    sync_ms_per_param: float = 0.0,
    total_params: int = 0,
    *,
    update_scale: float = 1.0,
    memo: dict[Template, tuple[int, float, float]] | None = None,
) -> float:
    """A valid lower bound on iteration time for a grouping, whatever the split.
    ``update_scale``: the least share of the update a stage steps (ZeRO-1: 1/P).
    ``memo``: what each template contributes, kept across calls with these
    ``stats`` (the search bounds 10^5 groupings built from a few templates).

    A pipeline of S stages whose model costs W per micro-batch (on its fastest
    class) needs at least max(m*W/S, W) for m micro-batches: its bottleneck
    stage is at least the average and the first micro-batch crosses every
    layer. Summing throughputs: T >= M / sum_j k_j S_j / W_j. The optimizer
    step lasts at least the largest per-stage share U_j / S_j, and some stage of
    every pipeline holds at least P / S_j parameters whose gradients it syncs.
    """
    rate = 0.0
    fill = float("inf")
    opt = 0.0
    sync = 0.0
    for tpl, k in parts:
        got = None if memo is None else memo.get(tpl)
        if got is None:
            got = (
                tpl.num_stages,
                min(stats[c].total_ms for c in tpl.classes),
                min(stats[c].total_upd_ms for c in tpl.classes) / tpl.num_stages,
            )
            if memo is not None:
                memo[tpl] = got
        stages, w, upd = got
        sync = max(sync, sync_ms_per_param * total_params / stages)
        rate += k * stages / w
        fill = min(fill, w)
        opt = max(opt, upd)
    if rate == 0:
        return float("inf")
    return max(num_microbatches / rate, fill) + opt * update_scale + sync


def enumerate_parts(
    classes: Sequence[DeviceClass],
    options: Sequence[list[tuple[int, int]]],
    *,
    mixed_orders: bool,
) -> Iterator[tuple[tuple[Template, int], ...]]:
    """Homogeneous combinations (each class: one of its options, or unused),
    then mixed pipelines over every subset of two or more classes (big-memory
    classes first, since early stages keep more activations under 1F1B, and
    with ``mixed_orders`` the reverse too) beside homogeneous pipelines of the
    other classes. A class too small to hold the model alone (no options) can
    still serve in mixed pipelines."""

    def homogeneous(i: int, limit: int | None) -> list[tuple[Template, int] | None]:
        entries: list[tuple[Template, int] | None] = [None]
        opts = options[i] if limit is None else options[i][:limit]
        entries += [(Template(classes=(classes[i].index,) * d), k) for d, k in opts]
        return entries

    for combo in product(*(homogeneous(i, None) for i in range(len(classes)))):
        parts = tuple(x for x in combo if x is not None)
        if parts:
            yield parts
    for size in range(2, len(classes) + 1):
        for subset in combinations(range(len(classes)), size):
            others = [i for i in range(len(classes)) if i not in subset]
            rest = list(product(*(homogeneous(i, 2) for i in others)))
            for mixed in _mixed([classes[i] for i in subset], mixed_orders):
                for combo in rest:
                    yield (mixed, *(x for x in combo if x is not None))


def _mixed(classes: Sequence[DeviceClass], both_orders: bool) -> Iterator[tuple[Template, int]]:
    order = sorted(classes, key=lambda c: -c.mem_bytes)
    orders = [order, order[::-1]] if both_orders else [order]
    for k in range(1, min(c.num_groups for c in classes) + 1):
        depth = {c.index: c.num_groups // k for c in classes}
        for ordered in orders:
            yield (
                Template(classes=tuple(c.index for c in ordered for _ in range(depth[c.index]))),
                k,
            )


ALIGNED_MAX_HOSTS = 4


def aligned_parts(classes: Sequence[DeviceClass]) -> Iterator[tuple[tuple[Template, int], ...]]:
    """Host-aligned pipelines for small clusters: k pipelines whose stage
    positions are whole hosts (each host gives every pipeline groups // k
    stages), in every order of the hosts. Placed stage-major, the copies of a
    stage share a host, so its gradient all-reduce never leaves the host, and
    the host order decides which links the activations cross (a slow pair of
    hosts can be kept apart by a third one between them). Same-class hosts keep
    their pool order so that stage-major placement lands each position on its
    host. Only for up to ALIGNED_MAX_HOSTS hosts: the orders grow factorially."""
    hosts = [
        (c.index, n, name)
        for c in classes
        for name, n in zip(c.hosts, c.groups_per_host, strict=True)
    ]
    if not 2 <= len(hosts) <= ALIGNED_MAX_HOSTS:
        return
    for k in range(1, max(n for _, n, _ in hosts) + 1):
        usable = [i for i, (_, n, _) in enumerate(hosts) if n >= k]
        for size in range(2, len(usable) + 1):
            for chosen in combinations(usable, size):
                for order in permutations(chosen):
                    if not _pool_order(order, hosts):
                        continue
                    per = [(hosts[i][0], hosts[i][2], hosts[i][1] // k) for i in order]
                    yield (
                        (
                            Template(
                                classes=tuple(c for c, _, d in per for _ in range(d)),
                                hosts=tuple(h for _, h, d in per for _ in range(d)),
                            ),
                            k,
                        ),
                    )


def _pool_order(order: Sequence[int], hosts: Sequence[tuple[int, int, str]]) -> bool:
    last: dict[int, int] = {}
    for i in order:
        cls = hosts[i][0]
        if last.get(cls, -1) > i:
            return False
        last[cls] = i
    return True
