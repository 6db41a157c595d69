"""The quick cost model of a grouping (pure): a search context (a micro-batch size
and a TP degree per GPU type, with its device classes and block statistics), and per
grouping its sync rates, links and balanced-split estimate, cheap enough for the
10^5 groupings of a 1024-GPU search; memoised per context, since groupings share a
few templates, classes and links."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.evaluate import ring_allreduce_ms, send_copies, transfer_ms
from autohet_cli.costmodel.sharding import compute_bytes
from autohet_cli.planner.groups import BlockStats, DeviceClass, Grouping, Template, block_range
from autohet_cli.planner.milp import SplitResult
from autohet_cli.planner.request import FREE_PRICE_PER_HOUR, SearchRequest
from autohet_cli.settings import GRAD_REDUCE_BYTES


@dataclass(slots=True)
class Context:
    tp: int  # the largest degree of its classes
    mbs: int
    classes: list[DeviceClass]
    stats: list[BlockStats]
    caps: list[float]
    params_per_gpu: int
    splits: dict[tuple[tuple[int, ...], int, float, tuple[float, ...], int], SplitResult | None] = (
        field(default_factory=dict)
    )
    sends: dict[Template, list[float]] = field(default_factory=dict)  # link_sends, memoised
    # what every grouping of this context asks again (estimate_ms, sync_rate): per
    # template, per class, per cluster; computed once (10^5 groupings on 1024 GPUs)
    memo: dict[object, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``tp=2``, or the degree per GPU type where they differ."""
        degrees = dict.fromkeys((c.gpu_type, c.tp) for c in self.classes)
        if len({t for _, t in degrees}) <= 1:
            return f"tp={self.tp}"
        return "tp=" + ",".join(f"{g}:{t}" for g, t in degrees)


def update_scale(req: SearchRequest, replicas: int, *, tied: bool = False) -> float:
    """The share of a stage's update each holder steps: 1/P of what ZeRO-1 shards
    over ``replicas`` pipelines (``tied``: a tied embedding or head, never sharded;
    a segment held at two degrees is not either, so the scale is a lower bound)."""
    if req.shard_weights and replicas >= 2 and not (tied and req.model.tied_embeddings):
        return 1.0 / replicas
    if not req.tables.training.zero1 or replicas < 2 or (tied and req.model.tied_embeddings):
        return 1.0
    return 1.0 / replicas


def state_bytes(req: SearchRequest, replicas: int) -> int:
    """Bytes per parameter a GPU keeps for its stage's weights, gradients and
    optimizer state, with ZeRO-1 (``training.zero1``) over ``replicas`` pipelines:
    the optimizer's part split over them (tied weights and segments held at
    different degrees are not sharded; the exact evaluation counts those, so a
    split this admits may still be refused there)."""
    t = req.tables.training
    if req.shard_weights and replicas >= 2:  # every state byte split (shard: weights)
        return -(-t.state_bytes_per_param // replicas)
    if not t.zero1 or replicas < 2:
        return t.state_bytes_per_param
    return int(t.state_bytes_per_param - t.optimizer_bytes_per_param * (1 - 1 / replicas))


def gathered_bytes(req: SearchRequest, c: DeviceClass, st: BlockStats) -> float:
    """Bytes a GPU of class ``c`` holds beyond its sharded state in the weight-sharded
    space (0 elsewhere): two layers' gathered weights (the one at work and the next,
    prefetched) and one layer's unsharded gradient, at the largest layer of the model
    (costmodel.sharding's working set, taken where it is largest so that a split the
    search admits fits there too)."""
    if not req.shard_weights:
        return 0.0
    c_bytes = compute_bytes(req.tables, c.gpu_type)
    layer = max(st.head_params, st.block_params, st.tail_params)
    grad = GRAD_REDUCE_BYTES + (c_bytes if c_bytes != GRAD_REDUCE_BYTES else 0)
    return float(layer * (2 * c_bytes + grad))


def _slowest_link(cluster: Cluster) -> float:
    return min([cluster.inter_node_gbps, *cluster.pair_gbps.values()])


def link_sends(req: SearchRequest, ctx: Context, tpl: Template) -> list[float]:
    """Per link of a template: latency + the boundary bytes times the copies a rank
    sends between the two degrees (``evaluate.send_copies``). Memoised per context:
    every grouping's estimate asks again for the same few templates."""
    got = ctx.sends.get(tpl)
    if got is None:
        got = ctx.sends[tpl] = _link_ms(req, ctx, tpl)
    return got


Link = tuple[int, int, str | None, str | None]  # _one_link_ms's arguments


def _link_ms(req: SearchRequest, ctx: Context, tpl: Template) -> list[float]:
    """Per link of ``tpl``: latency + transfer of the boundary bytes (``link_sends``),
    each distinct link (its two classes, and its two hosts or whether it stays on
    one) memoised per context: templates on 1024 GPUs run to 50 stages, built
    from a few classes and links."""
    links: dict[Link, float] = ctx.memo.setdefault("links", {})
    pairs = list(zip(tpl.classes, tpl.classes[1:], strict=False))
    keys: list[Link]
    if tpl.hosts:  # host-aligned: the links between the stage hosts are known
        keys = [(a, b, tpl.hosts[s], tpl.hosts[s + 1]) for s, (a, b) in enumerate(pairs)]
    else:  # "" "": inside one host; None None: the slowest link between hosts
        fits = [tpl.num_stages <= min(c.groups_per_host) for c in ctx.classes]
        keys = [(a, b, "", "") if a == b and fits[a] else (a, b, None, None) for a, b in pairs]
    out = []
    for key in keys:
        got = links.get(key)
        if got is None:
            got = links[key] = _one_link_ms(req, ctx, *key)
        out.append(got)
    return out


def _one_link_ms(
    req: SearchRequest, ctx: Context, a: int, b: int, src: str | None, dst: str | None
) -> float:
    """One link of ``_link_ms``: from a stage of class ``a`` on host ``src`` to one
    of class ``b`` on ``dst`` (both "": inside one host; both None: hosts not
    known, the cluster's slowest link)."""
    latency = req.tables.p2p_latency_ms(ctx.classes[a].gpu_type, ctx.classes[b].gpu_type)
    nbytes = ctx.stats[a].out_bytes * send_copies(ctx.classes[a].tp, ctx.classes[b].tp)
    if src is None or dst is None:
        gbps = _slowest_link(req.cluster)
    elif src == "":
        gbps = ctx.classes[a].intra_node_gbps
    else:
        gbps = req.cluster.link_gbps(src, dst)
    return latency + transfer_ms(nbytes, gbps)


def sync_rate(
    req: SearchRequest,
    ctx: Context,
    parts: Sequence[tuple[Template, int]],
    *,
    optimistic: bool = False,
) -> tuple[float, Scales]:
    """Ring all-reduce ms per parameter of one stage, across all pipelines, and per
    class what a GPU's parameters count for (``Scales``).

    Placement fills hosts in order, so a grouping whose groups fit on one host
    syncs over that host's links, per parameter a GPU holds; otherwise over the
    slowest inter-host link, where the TP ranks that share a NIC add up their bytes
    on it (``DeviceClass.nic_share``) and a full-gradient sync between degrees moves
    the full gradient (the class's TP degree). ``optimistic`` takes the fastest link
    any segment could use, per parameter a GPU holds, which keeps lower bounds
    valid whatever the placement.
    """
    low, rate = sync_rates(req, ctx, parts)
    return (low, ONES) if optimistic else rate


# Per device class of the context, what one parameter a GPU holds counts for in the
# sync (its NIC share or its TP degree, ``sync_rate``); ONES: each counts once.
Scales = tuple[float, ...]
ONES: Scales = ()


def scale_of(scales: Scales, c: int) -> float:
    return scales[c] if scales else 1.0


def sync_rates(
    req: SearchRequest, ctx: Context, parts: Sequence[tuple[Template, int]]
) -> tuple[float, tuple[float, Scales]]:
    """``sync_rate`` both ways from one pass over the grouping: the optimistic
    rate (for its lower bound) and (rate, per full parameter) for its estimate;
    every grouping asks for both (10^5 of them on 1024 GPUs)."""
    d = sum(k for _, k in parts)
    nbytes = req.tables.training.grad_bytes_per_param
    used = [0] * len(ctx.classes)
    counts: dict[Template, tuple[tuple[int, int], ...]] = ctx.memo.setdefault("counts", {})
    for tpl, k in parts:
        per_class = counts.get(tpl)
        if per_class is None:  # stages per class: templates run to 50 stages of few classes
            per_class = counts[tpl] = tuple(Counter(tpl.classes).items())
        for c, n in per_class:
            used[c] += k * n
    fixed = _context_rates(req, ctx)
    intra = max(g for g, n in zip(fixed["intra"], used, strict=True) if n)
    aligned = all(tpl.hosts for tpl, _ in parts)
    if aligned:
        slowest_intra = min(_hosts_intra(req, ctx, tpl) for tpl, _ in parts)
        low = ring_allreduce_ms(nbytes, d, slowest_intra)
    else:  # no ZeRO-1 factor either: it is 1 for a tied layer's share
        low = ring_allreduce_ms(nbytes, d, max(intra, fixed["fastest"]))
    # ZeRO-1's reduce-scatter + all-gather against the all-reduce (costmodel.evaluate);
    # segments held at two degrees sync the full gradient, unsharded: no factor
    uniform = len({c.tp for c, n in zip(ctx.classes, used, strict=True) if n}) == 1
    f = max(fixed["zero1"][c] for c, n in enumerate(used) if n) if d > 1 and uniform else 1.0
    if aligned:  # stage-major: each stage's copies on one host
        return low, (f * low, ONES)
    hosts = sum(  # the hosts a class's groups fill, in order, to hold ``need`` of them
        min(bisect_left(cum, need) + 1, len(cum))
        for cum, need in zip(fixed["cumulative"], used, strict=True)
        if need > 0
    )
    if hosts > 1:
        scales = tuple(float(c.nic_share if uniform else c.tp) for c in ctx.classes)
        return low, (f * ring_allreduce_ms(nbytes, d, fixed["slowest"]), scales)
    return low, (f * ring_allreduce_ms(nbytes, d, intra), ONES)


def _context_rates(req: SearchRequest, ctx: Context) -> dict[str, Any]:
    """Per class: its all-reduce rate inside a host and the running count of its
    groups host by host; the cluster's fastest and slowest links (memoised)."""
    got = ctx.memo.get("rates")
    if got is None:
        got = ctx.memo["rates"] = {
            "intra": [allreduce_gbps(req, c.gpu_type, c.intra_node_gbps) for c in ctx.classes],
            "cumulative": [list(accumulate(c.groups_per_host)) for c in ctx.classes],
            "fastest": max([req.cluster.inter_node_gbps, *req.cluster.pair_gbps.values()]),
            "slowest": _slowest_link(req.cluster),
            "zero1": [
                req.tables.spec(c.gpu_type).fixed.zero1_sync_factor
                if req.tables.training.zero1
                else 1.0
                for c in ctx.classes
            ],
        }
    return got


def _hosts_intra(req: SearchRequest, ctx: Context, tpl: Template) -> float:
    """The slowest one-host all-reduce rate among a host-aligned template's hosts."""
    key = ("hosts_intra", tpl)
    got = ctx.memo.get(key)
    if got is None:
        got = ctx.memo[key] = min(
            allreduce_gbps(req, req.cluster.host(h).gpu_type, req.cluster.host(h).intra_node_gbps)
            for h in tpl.hosts
        )
    return float(got)


def allreduce_gbps(req: SearchRequest, gpu_type: str, nominal_gbps: float) -> float:
    """The rate of a one-host all-reduce of this GPU type: the probe's measured fit
    (``DeviceFacts.allreduce_gbytes_s``, what the final evaluation charges) when the
    profile has one, else the host's nominal link speed."""
    measured = req.tables.allreduce_gbps(gpu_type)
    return nominal_gbps if measured is None else measured


def estimate_ms(
    req: SearchRequest,
    ctx: Context,
    parts: Sequence[tuple[Template, int]],
    M: int,
    sync: tuple[float, Scales] | None = None,
) -> float:
    """Balanced continuous split per template; micro-batches shared so that all
    pipelines finish together, then rounded (cheap enough for 10^5 groupings).
    ``sync``: ``sync_rate`` of the grouping, where the caller has it."""
    got = ctx.memo.get("blocks")
    if got is None:
        got = ctx.memo["blocks"] = block_range(req.model)
    a, b = got
    n = b - a
    upd = 0.0
    params = 0.0
    shapes = []
    rate, scales = sync or sync_rate(req, ctx, parts)
    for tpl, k in parts:
        c_ms, fill_ms, tpl_upd, tpl_params = _shape(req, ctx, tpl, n, scales)
        shapes.append((k, c_ms, fill_ms))
        upd = max(upd, tpl_upd)
        params = max(params, tpl_params)
    pipes = sum(k for k, _, _ in shapes)
    t_ms = (M - pipes + sum(k * f / c for k, c, f in shapes)) / sum(k / c for k, c, _ in shapes)
    t_ms = max(t_ms, max(f for _, _, f in shapes))
    ms = [max(1, int((t_ms - f) / c) + 1) for _, c, f in shapes]
    left = M - sum(k * m for (k, _, _), m in zip(shapes, ms, strict=True))
    while left > 0:  # rounding down left a few micro-batches: give them out
        j = min(range(len(shapes)), key=lambda i: ms[i] * shapes[i][1] + shapes[i][2])
        ms[j] += 1
        left -= shapes[j][0]
    t_ms = max((m - 1) * c + f for (_, c, f), m in zip(shapes, ms, strict=True))
    total = t_ms + upd * update_scale(req, pipes) + rate * params
    if req.objective == "cost":
        used = {c for tpl, _ in parts for c in tpl.classes}
        price = sum(req.cluster.host(h).price_per_hour for c in used for h in ctx.classes[c].hosts)
        # in the score's unit (``request.scorer``: dollars per million tokens, i.e.
        # $/h x ms / (3.6 x tokens per iteration)): solve_queue holds estimates against
        # solved scores (HOPELESS), and in ms x $/h every estimate was thousands of
        # times any score, so a cost search solved its first grouping only
        tokens = req.global_batch_size * req.tables.training.seq_len
        return total * max(price, FREE_PRICE_PER_HOUR) / (3.6 * tokens)
    return total


def _shape(
    req: SearchRequest, ctx: Context, tpl: Template, n: int, scales: Scales
) -> tuple[float, float, float, float]:
    """A template's balanced continuous split (``estimate_ms``): its bottleneck and
    fill ms per micro-batch, its update ms and the parameters its fullest stage
    syncs; memoised per context (groupings share their few templates)."""
    key = ("shape", tpl, scales)
    got = ctx.memo.get(key)
    if got is None:
        st = [ctx.stats[c] for c in tpl.classes]
        inv = sum(1.0 / s.block_ms for s in st)
        fixed = (st[0].head_ms / st[0].block_ms) + (st[-1].tail_ms / st[-1].block_ms)
        sends = link_sends(req, ctx, tpl)
        c_ms = max((n + fixed) / inv, 2 * max(sends, default=0.0))
        held = [ctx.stats[c].block_params * scale_of(scales, c) for c in tpl.classes]
        got = ctx.memo[key] = (
            c_ms,
            c_ms * tpl.num_stages + 2 * sum(sends),
            max(s.total_upd_ms for s in st) / tpl.num_stages,
            max(held) * n / tpl.num_stages,
        )
    return got


def describe(g: Grouping, ctx: Context) -> str:
    parts = []
    for tpl, k in g.parts:
        names = [ctx.classes[c].gpu_type for c in tpl.classes]
        runs: list[str] = []
        for name in dict.fromkeys(names):
            runs.append(f"{names.count(name)}x{name}")
        parts.append(f"{k}x[{'+'.join(runs)}]")
    return " ".join(parts)
