"""Optimality: on tiny clusters (<= 8 GPUs, 2-3 types) the planner's iteration
time is within 1% of the exhaustive optimum (tests/bruteforce.py), scored by the
same cost model.

Every case is small enough to enumerate every plan of AutoHet's space (TP
degree, pipelines of TP groups in any order, layer splits, micro-batch size,
uneven micro-batch shares, idle GPUs, and for ``make_plan``, which decides
recomputation, each stage recomputing or not). The planner can never beat the
brute force (that would mean the enumeration is incomplete), and must come
within 1%.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from functools import cache

import pytest

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.models import ModelSpec, get_model
from autohet_cli.plan import (
    Device,
    Pipeline,
    Plan,
    Stage,
    check_against_cluster,
    weight_sharded,
)
from autohet_cli.planner.api import PlanOutcome, make_plan
from autohet_cli.planner.decide import ZERO1_MIN_GAIN
from autohet_cli.planner.search import SearchRequest, search
from autohet_cli.planner.weights import WEIGHTS_MIN_GAIN
from autohet_cli.settings import TrainingSettings
from tests.bruteforce import (
    Optimum,
    brute_force,
    describe,
    naive_brute_force,
    synthetic_tables,
    tiny_cluster,
    tiny_model,
)

TOLERANCE = 1.01
TIME_LIMIT_S = 30.0  # generous: these cases solve in well under a second
SPEEDS = {"A100-40": 1.0, "V100-16": 2.5, "RTX-3090": 3.0}  # ms per block, fwd+bwd

A2V2R4 = (("a0", "A100-40", 2, None), ("v0", "V100-16", 2, None), ("r0", "RTX-3090", 4, None))
A2V2 = (("a0", "A100-40", 2, None), ("v0", "V100-16", 2, None))


@dataclass(frozen=True)
class Case:
    id: str
    hosts: tuple[tuple[str, str, int, float | None], ...]
    global_batch_size: int
    num_blocks: int = 4  # 4: the zoo's gpt-tiny (6 partitionable layers)
    speeds: tuple[tuple[str, float], ...] = tuple(SPEEDS.items())
    profile: tuple[tuple[str, object], ...] = ()  # synthetic_tables keyword arguments
    analytic: bool = False  # the catalog's analytic profile instead of a synthetic one
    inter_node_gbps: float = 100.0
    pairs: tuple[tuple[str, str, float], ...] = ()
    # What the optimum must show, so that the case keeps testing what it claims:
    idle_types: tuple[str, ...] = ()  # GPU types the optimum leaves idle
    oom_types: tuple[str, ...] = ()  # types that cannot hold the whole model alone
    mixed_pipeline: bool = False  # the optimum has a pipeline spanning two types
    # The optimum has stages of different TP degrees, and one degree for every type
    # is >= 3% slower.
    mixed_tp: bool = False
    # The optimum with recomputation is >= 5% faster than without, and recomputes
    # some stages but not all (mixed) or every stage (everywhere).
    recompute_wins: str = ""  # "", "mixed" or "everywhere"
    # make_plan is judged against the optimum with recomputation where memory binds
    # (where it decides recomputation); elsewhere that optimum is the plain one
    # (checked for the cases where it is cheap), and enumerating it twice would
    # double the suite's longest oracle runs.
    binds_memory: bool = False
    xfail_search: str = ""  # known planner misses (reason); strict
    xfail_make_plan: str = ""
    # The ZeRO-1 optimum is enumerated too (make_plan decides ZeRO-1; it is judged
    # against both optima). Off for the three cases whose enumeration takes 20-50 s:
    # their make_plan runs without ZeRO-1, judged as before.
    zero1_oracle: bool = True

    def model(self) -> ModelSpec:
        return get_model("gpt-tiny") if self.num_blocks == 4 else tiny_model(self.num_blocks)

    def tables(self) -> CostTables:
        model = self.model()
        if self.analytic:
            training = TrainingSettings(
                global_batch_size=self.global_batch_size, micro_batch_size=1, seq_len=64
            )
            return CostTables(model, None, training)
        return synthetic_tables(
            model,
            dict(self.speeds),
            global_batch_size=self.global_batch_size,
            **dict(self.profile),  # type: ignore[arg-type]
        )

    def cluster(self) -> Cluster:
        return tiny_cluster(
            self.hosts, inter_node_gbps=self.inter_node_gbps, pairs=self.pairs, name=self.id
        )

    def label(self) -> str:
        gpus = ", ".join(f"{h}: {n}x{t}" + (f" ({m} GB)" if m else "") for h, t, n, m in self.hosts)
        net = f"{self.inter_node_gbps:g} Gbit/s" + "".join(
            f", {a}-{b} {g:g} Gbit/s" for a, b, g in self.pairs
        )
        prof = (
            "analytic" if self.analytic else f"synthetic {dict(self.speeds)} {dict(self.profile)}"
        )
        return (
            f"cluster [{gpus}; {net}], model {self.model().name} ({self.model().num_layers} "
            f"layers), profile {prof}, global batch {self.global_batch_size}"
        )


CASES = [
    # The optimum (since TP per GPU type) mixes degrees and has pipelines whose cuts
    # line up; the MILP, solving one template at a time, splits that grouping 7% off,
    # the 10th best candidate. Refining the best candidates whose pipelines' cuts are
    # not aligned reaches it (refining only the 3 best left the search 1.6% above).
    Case(
        id="3types-8gpu",
        hosts=A2V2R4,
        global_batch_size=8,
        zero1_oracle=False,
    ),
    Case(id="2types-4gpu", hosts=A2V2, global_batch_size=8),
    Case(
        id="3types-6gpu-8layers",
        hosts=(("a0", "A100-40", 2, None), ("v0", "V100-16", 2, None), ("r0", "RTX-3090", 2, None)),
        global_batch_size=16,
        num_blocks=6,
        zero1_oracle=False,
    ),
    Case(
        id="3types-1-2-3-batch12",
        hosts=(("a0", "A100-40", 1, None), ("v0", "V100-16", 2, None), ("r0", "RTX-3090", 3, None)),
        global_batch_size=12,
    ),
    Case(
        id="analytic-3types-6gpu",
        hosts=(("a0", "A100-40", 2, None), ("v0", "V100-16", 2, None), ("r0", "RTX-3090", 2, None)),
        global_batch_size=8,
        analytic=True,
    ),
    # The catalog's analytic gpt-tiny is launch-bound on these cards: its ops' fixed
    # costs (catalog.FixedCosts) outweigh its arithmetic, so halving each pipeline's
    # micro-batches pays more than the gradient sync costs: the optimum is two
    # V100 -> RTX -> RTX pipelines syncing inside each host, and the A100 stays idle.
    # (Without fixed costs the fp32 all-reduces cost more than data parallelism gave:
    # one A100 -> RTX x4 pipeline, the V100s idle.)
    Case(
        id="analytic-3types-7gpu-batch16",
        hosts=(("a0", "A100-40", 1, None), ("v0", "V100-16", 2, None), ("r0", "RTX-3090", 4, None)),
        global_batch_size=16,
        analytic=True,
        idle_types=("A100-40",),
        mixed_pipeline=True,
        zero1_oracle=False,
    ),
    # Memory binds: a V100 (2.2 GB) cannot hold the model, so it must pipeline.
    Case(
        id="mem-v100-must-pipeline",
        binds_memory=True,
        hosts=(("a0", "A100-40", 1, 2.6), ("v0", "V100-16", 3, 2.2)),
        global_batch_size=8,
        oom_types=("V100-16",),
    ),
    # Memory binds harder: no type holds the model; the best pipelines mix types.
    Case(
        id="mem-mixed-v100-a100",
        binds_memory=True,
        hosts=(("a0", "A100-40", 1, 2.6), ("v0", "V100-16", 3, 2.6)),
        global_batch_size=8,
        profile=(("block_params", 10_000_000),),
        oom_types=("A100-40", "V100-16"),
        mixed_pipeline=True,
    ),
    Case(
        id="mem-both-types-pipeline",
        binds_memory=True,
        hosts=(("a0", "A100-40", 2, 2.3), ("v0", "V100-16", 2, 2.3)),
        global_batch_size=8,
        profile=(("act_mb_per_block", 40.0),),
        oom_types=("A100-40", "V100-16"),
        mixed_pipeline=True,
    ),
    # A very slow GPU: any share of the batch or any stage on it costs more than it gives.
    Case(
        id="idle-slow-gpu",
        hosts=(("a0", "A100-40", 2, None), ("r0", "RTX-3090", 1, None)),
        global_batch_size=4,
        speeds=(("A100-40", 1.0), ("RTX-3090", 12.0)),
        idle_types=("RTX-3090",),
    ),
    # TP that scales well and heavy gradients: one TP-4 group beats data parallelism.
    Case(
        id="tp4-wins",
        hosts=(("a0", "A100-40", 4, None), ("v0", "V100-16", 2, None)),
        global_batch_size=4,
        profile=(("tp_overhead", 1.05), ("block_params", 20_000_000)),
        inter_node_gbps=25.0,
        idle_types=("V100-16",),
    ),
    # Uneven blocks (block 2 costs 3x): the split must not assume equal blocks.
    Case(
        id="skewed-blocks",
        hosts=(("a0", "A100-40", 1, None), ("v0", "V100-16", 2, None), ("r0", "RTX-3090", 1, None)),
        global_batch_size=8,
        profile=(("block_skew", (1.0, 1.0, 3.0, 1.0)),),
    ),
    # A slow network: syncing across hosts costs more than the V100s give.
    Case(
        id="slow-network",
        hosts=A2V2,
        global_batch_size=8,
        inter_node_gbps=10.0,
        idle_types=("V100-16",),
    ),
    # Two A100 hosts on a slow link, a V100 host well connected to both: pipelines
    # A(a0) -> V -> A(a1) keep every gradient all-reduce inside one host.
    # Recomputation where memory binds (activations 150 MB a block, 2.5 GB cards):
    # the A100 recomputes to hold 4 of 6 layers at full speed, the RTXs run plain.
    Case(
        id="recompute-the-fast-stage",
        binds_memory=True,
        hosts=(("a0", "A100-40", 1, 2.5), ("r0", "RTX-3090", 2, 2.5)),
        global_batch_size=8,
        profile=(("act_mb_per_block", 150.0),),
        recompute_wins="mixed",
    ),
    # ... or the A100 holds a whole replica by recomputing, beside two plain RTX ones
    Case(
        id="recompute-one-replica",
        binds_memory=True,
        hosts=(("a0", "A100-40", 1, 2.5), ("r0", "RTX-3090", 2, 3.0)),
        global_batch_size=8,
        profile=(("act_mb_per_block", 150.0),),
        recompute_wins="mixed",
    ),
    # ... or both types recompute to run data parallel at micro-batch 2
    Case(
        id="recompute-everywhere",
        binds_memory=True,
        hosts=(("a0", "A100-40", 1, 2.5), ("r0", "RTX-3090", 1, 2.7)),
        global_batch_size=8,
        profile=(("act_mb_per_block", 100.0),),
        recompute_wins="everywhere",
    ),
    # TP per GPU type, as Metis plans GPT-Neo on A100-40 + V100-16: the small V100s
    # need TP 2 to hold half the layers (10M-parameter blocks), the A100s run the
    # rest alone, two such pipelines; one degree for all is 4.4% slower.
    Case(
        id="mixed-tp-v100-tp2-a100-tp1",
        binds_memory=True,
        hosts=(("a0", "A100-40", 2, 2.6), ("v0", "V100-16", 4, 2.4)),
        global_batch_size=8,
        speeds=(("A100-40", 1.0), ("V100-16", 1.5)),
        profile=(("block_params", 10_000_000), ("tp_overhead", 1.2)),
        mixed_tp=True,
        mixed_pipeline=True,
    ),
    # With TP that scales well the optimum is one TP-2 pipeline A100 -> V100 -> V100
    # whose first stage sits at 96% of its memory: the MILP's per-block memory bound
    # (largest block, both end layers) rules that split out, refinement reaches it.
    Case(
        id="near-full-a100-first",
        binds_memory=True,
        hosts=(("a0", "A100-40", 2, 2.6), ("v0", "V100-16", 4, 2.2)),
        global_batch_size=8,
        speeds=(("A100-40", 1.0), ("V100-16", 1.5)),
        profile=(("block_params", 10_000_000), ("tp_overhead", 1.05)),
        mixed_pipeline=True,
    ),
    Case(
        id="slow-pair-link",
        hosts=(("a0", "A100-40", 2, None), ("a1", "A100-40", 2, None), ("v0", "V100-16", 2, None)),
        global_batch_size=8,
        pairs=(("a0", "a1", 5.0),),
        mixed_pipeline=True,
    ),
]


def _optimum(case: Case, recompute: bool = False, zero1: bool = False) -> Optimum:
    # one cache key however it is called: _optimum(case) is _optimum(case, False, False)
    return _cached_optimum(case, bool(recompute), bool(zero1))


@cache
def _cached_optimum(case: Case, recompute: bool, zero1: bool) -> Optimum:
    tables = case.tables().with_zero1(zero1)
    opt = brute_force(case.cluster(), tables, case.global_batch_size, recompute=recompute)
    assert opt is not None, f"{case.id}: nothing fits, the case is mis-built"
    return opt


def _report(
    case: Case,
    who: str,
    tp: int,
    mbs: int,
    pipes: list[Pipeline],
    ms: float,
    rc: bool,
    zero1: bool = False,
) -> str:
    opt = _optimum(case, rc, zero1)
    return (
        f"{case.id}: {case.label()}\n"
        f"  {who}: {ms:.4f} ms, tp={tp} mbs={mbs}: {describe(pipes)}\n"
        f"  optimum: {opt.iteration_ms:.4f} ms, tp={opt.tp} mbs={opt.mbs}: "
        f"{describe(opt.pipelines)}\n"
        f"  ratio {ms / opt.iteration_ms:.4f}"
    )


def _params(attr: str) -> list[object]:
    out = []
    for c in CASES:
        reason = getattr(c, attr)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


def _check(
    case: Case,
    who: str,
    tp: int,
    mbs: int,
    pipes: list[Pipeline],
    ms: float,
    rc: bool = False,
    zero1: bool = False,
    tolerance: float = TOLERANCE,
) -> None:
    """Against the optimum of the space ``who`` searches (``rc``: with recomputation,
    ``zero1``: with the optimizer state sharded)."""
    cluster, tables = case.cluster(), case.tables().with_zero1(zero1)
    ev = evaluate(pipes, cluster, tables, mbs)
    assert ev.fits, f"{who} plan does not fit in memory"
    assert ev.iteration_ms == pytest.approx(ms, rel=1e-9), "reported time is not the model's"
    assert sum(p.num_microbatches for p in pipes) * mbs == case.global_batch_size
    opt = _optimum(case, rc, zero1).iteration_ms
    msg = _report(case, who, tp, mbs, pipes, ms, rc, zero1)
    # the oracle recomputes whole stages or none; a stage recomputing its first N
    # layers (recompute: N) is judged by its whole-stage version, which is in the
    # oracle's space and never faster
    whole = [
        replace(p, stages=tuple(replace(s, recompute=True) if s.recompute_layers else s
                                for s in p.stages))
        for p in pipes
    ]  # fmt: skip
    floor = ms
    if whole != pipes:
        ev_whole = evaluate(whole, cluster, tables, mbs)
        assert ev_whole.fits and ms <= ev_whole.iteration_ms * (1 + 1e-9), msg
        floor = ev_whole.iteration_ms
    assert floor >= opt * (1 - 1e-9), (
        "beat the exhaustive optimum: the enumeration is incomplete\n" + msg
    )
    assert ms <= tolerance * opt, msg


@pytest.mark.parametrize("case", _params("xfail_search"))
@pytest.mark.slow(
    "the brute-force oracle enumerates every plan of clusters of up to 8 GPUs of 3 types"
)
def test_search_within_one_percent_of_brute_force(case: Case) -> None:
    req = SearchRequest(
        cluster=case.cluster(),
        model=case.model(),
        tables=case.tables(),
        global_batch_size=case.global_batch_size,
        time_limit_s=TIME_LIMIT_S,
    )
    best = search(req).best
    _check(case, "search", best.tp, best.mbs, best.pipelines, best.eval.iteration_ms)


def _make_plan(case: Case, cluster: Cluster, *, shard_weights: bool | None) -> PlanOutcome:
    """make_plan on ``case``, deciding ZeRO-1 where the case enumerates its optimum."""
    return make_plan(
        name=case.id,
        cluster=cluster,
        model=case.model(),
        tables=case.tables(),
        global_batch_size=case.global_batch_size,
        time_limit_s=TIME_LIMIT_S,
        zero1=None if case.zero1_oracle else False,
        shard_weights=shard_weights,
    )


@pytest.mark.parametrize("case", _params("xfail_make_plan"))
def test_make_plan_within_one_percent_of_brute_force(case: Case) -> None:
    """make_plan decides recomputation where memory binds, and ZeRO-1 (where the
    case enumerates its optimum): judged against the optimum of the space its plan
    is in, and never more than 1% behind the optimum without ZeRO-1, nor further
    behind the one with it than the decision's threshold allows."""
    cluster = case.cluster()
    # the oracle enumerates replicated weights (below: with them decided too)
    out = _make_plan(case, cluster, shard_weights=False)
    out.plan.validate()
    check_against_cluster(
        out.plan, {h.name: (h.gpu_type, h.num_gpus) for h in cluster.hosts}, case.id
    )
    pipes = list(out.plan.pipelines)
    zero1 = out.plan.training.zero1
    rc = case.binds_memory  # make_plan decides recomputation where memory binds
    plain = _optimum(case, rc).iteration_ms
    ms = out.eval.iteration_ms
    if case.zero1_oracle:
        sharded = _optimum(case, rc, True).iteration_ms
        what = _report(case, "make_plan", out.plan.tensor_parallel, 0, pipes, ms, rc, True)
        assert ms <= TOLERANCE * plain, f"slower than the optimum without ZeRO-1\n{what}"
        assert ms <= TOLERANCE * sharded / (1 - ZERO1_MIN_GAIN), what
        if zero1:  # it chose to shard: it must have paid
            assert ms < plain * (1 - ZERO1_MIN_GAIN) * (1 + 1e-9), what
    _check(
        case,
        "make_plan",
        out.plan.tensor_parallel,
        out.plan.training.micro_batch_size,
        pipes,
        ms,
        rc=rc,
        zero1=zero1,
        tolerance=TOLERANCE / (1 - ZERO1_MIN_GAIN) if zero1 or case.zero1_oracle else TOLERANCE,
    )
    if rc:  # memory binds: the planner may shard weights too, and never loses by it
        auto = _make_plan(case, cluster, shard_weights=None)
        auto.plan.validate()
        assert auto.eval.fits
        if weight_sharded(auto.plan.pipelines):
            assert auto.eval.iteration_ms < ms * (1 - WEIGHTS_MIN_GAIN) * (1 + 1e-9)
        else:
            assert auto.eval.iteration_ms == pytest.approx(ms, rel=1e-9)


ZERO1_CASES = [pytest.param(c, id=c.id) for c in CASES if c.zero1_oracle]


@pytest.mark.parametrize("case", ZERO1_CASES)
def test_search_with_zero1_within_one_percent_of_brute_force(case: Case) -> None:
    """With the optimizer state sharded (--zero1), against that space's optimum."""
    req = SearchRequest(
        cluster=case.cluster(),
        model=case.model(),
        tables=case.tables().with_zero1(True),
        global_batch_size=case.global_batch_size,
        time_limit_s=TIME_LIMIT_S,
    )
    best = search(req).best
    _check(case, "search", best.tp, best.mbs, best.pipelines, best.eval.iteration_ms, zero1=True)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case_shows_what_it_claims(case: Case) -> None:
    """The optimum has the property the case was built for (idle type, mixed
    pipeline, a type too small for the model), so the case stays meaningful."""
    opt = _optimum(case)
    cluster, tables, model = case.cluster(), case.tables(), case.model()
    plan = Plan(
        name=case.id,
        version=1,
        model_name=model.name,
        num_layers=model.num_layers,
        training=TrainingSettings(
            global_batch_size=case.global_batch_size, micro_batch_size=opt.mbs, seq_len=64
        ),
        tensor_parallel=opt.tp,
        pipelines=tuple(opt.pipelines),
    )
    plan.validate(case.id)  # the brute force stays inside the plan format
    check_against_cluster(plan, {h.name: (h.gpu_type, h.num_gpus) for h in cluster.hosts}, "bf")
    used = {s.gpu_type for p in opt.pipelines for s in p.stages}
    for gpu in case.idle_types:
        assert gpu not in used, describe(opt.pipelines)
    if case.mixed_pipeline:
        assert any(len({s.gpu_type for s in p.stages}) > 1 for p in opt.pipelines), describe(
            opt.pipelines
        )
    if case.mixed_tp:
        assert len({s.tensor_parallel for p in opt.pipelines for s in p.stages}) > 1
        uniform = brute_force(cluster, tables, case.global_batch_size, per_type_tp=False)
        assert uniform is not None and uniform.iteration_ms >= 1.03 * opt.iteration_ms
    for gpu in case.oom_types:
        host = next(h for h in cluster.hosts if h.gpu_type == gpu)
        stage = Stage(
            layer_start=0,
            layer_end=model.num_layers,
            gpu_type=gpu,
            tensor_parallel=1,
            devices=(Device(host=host.name, gpu=0),),
        )
        ev = evaluate([Pipeline(num_microbatches=1, stages=(stage,))], cluster, tables, 1)
        assert not ev.fits, f"{gpu} holds the whole model: the case no longer binds memory"
    if not case.binds_memory:
        assert opt.eval.memory_peak_fraction <= 0.8, "memory binds: mark the case binds_memory"
        return
    with_rc = _optimum(case, True)
    flags = [s.recompute for p in with_rc.pipelines for s in p.stages]
    if case.recompute_wins:
        assert with_rc.iteration_ms < 0.95 * opt.iteration_ms, describe(with_rc.pipelines)
        everywhere = case.recompute_wins == "everywhere"
        assert all(flags) if everywhere else any(flags) and not all(flags), flags
    else:
        assert with_rc.iteration_ms == pytest.approx(opt.iteration_ms, rel=1e-12)


# ----------------------------------------------------------------- the oracle itself

BY_ID = {c.id: c for c in CASES}

TINY = Case(
    id="tiny",
    hosts=(("a0", "A100-40", 1, None), ("v0", "V100-16", 2, 2.4)),
    global_batch_size=4,
)


def test_brute_force_decomposition_matches_naive_enumeration() -> None:
    """Min-max micro-batch shares + one evaluate per multiset of shapes gives the
    same optimum as evaluating every micro-batch composition of every plan."""
    cluster, tables = TINY.cluster(), TINY.tables()
    fast = brute_force(cluster, tables, TINY.global_batch_size)
    slow = naive_brute_force(cluster, tables, TINY.global_batch_size)
    assert fast is not None and slow is not None
    assert fast.iteration_ms == pytest.approx(slow, rel=1e-12)


def test_zero1_brute_force_matches_naive_enumeration() -> None:
    """With the optimizer state sharded, memory depends on the number of pipelines
    (and, where degrees mix, on the other pipelines' degrees): the decomposition,
    keyed by it, still finds what evaluating every plan whole finds, and where its
    per-pipeline figures were too optimistic (degrees mixed) it re-counts."""
    sharded = TINY.tables().with_zero1(True)
    fast = brute_force(TINY.cluster(), sharded, TINY.global_batch_size)
    slow = naive_brute_force(TINY.cluster(), sharded, TINY.global_batch_size)
    assert fast is not None and slow is not None
    assert fast.iteration_ms == pytest.approx(slow, rel=1e-12)
    plain = brute_force(TINY.cluster(), TINY.tables(), TINY.global_batch_size)
    assert plain is not None and fast.iteration_ms < plain.iteration_ms  # it shards here
    case = BY_ID["mixed-tp-v100-tp2-a100-tp1"]
    cluster, tables, B = case.cluster(), case.tables().with_zero1(True), case.global_batch_size
    unpruned = brute_force(cluster, tables, B, mbs_candidates=(2,), prune=False)
    pruned = brute_force(cluster, tables, B, mbs_candidates=(2,))
    whole = naive_brute_force(cluster, tables, B, mbs_candidates=(2,))
    assert unpruned is not None and pruned is not None
    assert unpruned.recounted > 0  # some mixed-degree plans did not fit as assumed
    assert unpruned.iteration_ms == pytest.approx(whole, rel=1e-12)
    assert pruned.iteration_ms == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize("case_id", ["recompute-everywhere", "recompute-the-fast-stage"])
def test_recompute_flags_per_stage_match_trying_every_flag(case_id: str) -> None:
    """The brute force's shortcut (recompute exactly the stages that do not fit
    plain) gives the optimum of trying all 2**stages flags of every plan."""
    case = BY_ID[case_id]
    cluster, tables, B = case.cluster(), case.tables(), case.global_batch_size
    fast = brute_force(cluster, tables, B, recompute=True, tp_candidates=(1,), mbs_candidates=(2,))
    slow = naive_brute_force(
        cluster, tables, B, recompute=True, tp_candidates=(1,), mbs_candidates=(2,)
    )
    plain = naive_brute_force(cluster, tables, B, tp_candidates=(1,), mbs_candidates=(2,))
    assert fast is not None and slow is not None
    assert fast.iteration_ms == pytest.approx(slow, rel=1e-12)
    assert plain is None or slow < plain  # recomputation matters at this size
    sharded = tables.with_zero1(True)  # ... and with ZeRO-1 on top
    fast = brute_force(cluster, sharded, B, recompute=True, tp_candidates=(1,), mbs_candidates=(2,))
    slow = naive_brute_force(
        cluster, sharded, B, recompute=True, tp_candidates=(1,), mbs_candidates=(2,)
    )
    assert fast is not None and slow is not None
    assert fast.iteration_ms == pytest.approx(slow, rel=1e-12)


@pytest.mark.parametrize(
    "case",
    [TINY, BY_ID["2types-4gpu"], BY_ID["mem-v100-must-pipeline"], BY_ID["idle-slow-gpu"]],
    ids=lambda c: c.id,
)
def test_brute_force_pruning_is_exact(case: Case) -> None:
    cluster, tables = case.cluster(), case.tables()
    pruned = brute_force(cluster, tables, case.global_batch_size)
    full = brute_force(cluster, tables, case.global_batch_size, prune=False)
    assert pruned is not None and full is not None
    assert pruned.iteration_ms == pytest.approx(full.iteration_ms, rel=1e-12)
    assert pruned.evaluated < full.evaluated


def test_brute_force_sees_the_whole_space() -> None:
    """Counts of the space on a hand-checkable cluster: hosts a0 (1 GPU) and v0
    (2 GPUs), 6 layers, tp=1, mbs=4 so M=1 (one pipeline). Host sequences:
    length 1: a, v (2); length 2: av, va, vv (3); length 3: avv, vav, vva (3).
    Layer splits of 6 layers into S stages: C(5, S-1) = 1, 5, 10. Plans with one
    pipeline: 2*1 + 3*5 + 3*10 = 47 shapes, all distinct compositions x splits."""
    from tests.bruteforce import _Space

    cluster, tables = TINY.cluster(), TINY.tables()
    space = _Space(cluster, tables, tp=1, mbs=4, M=1)
    comps = list(space.compositions())
    assert len(comps) == 8
    assert sum(1 for c in comps for _ in space.layer_splits(c)) == 47
    # M=4 (mbs=1): up to three pipelines; e.g. {a}, {v}, {v} is one composition.
    space4 = _Space(cluster, tables, tp=1, mbs=1, M=4)
    comps4 = [Counter(c) for c in space4.compositions()]
    assert Counter({(0,): 1, (1,): 2}) in comps4
    assert Counter({(0, 1): 1, (1,): 1}) in comps4
    assert Counter({(1, 0, 1): 1}) in comps4
    assert all(
        sum(s.count(h) * k for s, k in c.items()) <= cap
        for c in comps4
        for h, cap in enumerate((1, 2))
    )
    assert len(comps4) == len({frozenset(c.items()) for c in comps4})  # no duplicates
