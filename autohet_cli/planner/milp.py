"""The SCIP formulations: layer split per pipeline template, then batch shares.

Notation (j a template with k_j identical pipelines of S_j stages; s a stage;
c(j,s) its device class; N blocks; M micro-batches; m̂_j the micro-batches a
pipeline of j is expected to take):

Split (one template at a time, pure MILP):

    n_s   in Z>=0   blocks held by stage s (middle stages >= 1), sum_s n_s = N
    y_s   = head_c*[s=0] + n_s*blk_c + tail_c*[s=S-1]     fwd+bwd ms per micro-batch
    x_s   = the same with forward times only
    h_s   = (send_{s-1} + send_s) / 2                      half of each adjacent link
    Fw >= x_s + h_s,  Bw >= (y_s - x_s) + h_s,  C = Fw + Bw   bottleneck (1F1B bound)
    F   = sum_s y_s + 2 sum_s send_s                       one micro-batch end to end
    Z  >= g * params_s        gradient sync of a stage (ring over the slowest link)
    O  >= upd_s               optimizer step of a stage
    params_s * state + act_s * (S - s) + buffers + w_s <= mem_c - reserve     memory
    minimise (m̂ - 1) C + F + Z + O

Shares (all templates, pure MILP with the splits' C_j, F_j fixed):

    m_j in Z>=1, r_j in [0, k_j - 1], rho_j binary, r_j <= (k_j - 1) rho_j
    sum_j k_j m_j + r_j = M
    T >= (m_j - 1) C_j + F_j;   T >= m_j C_j + F_j - U (1 - rho_j)
    minimise T

With activation recomputation (the stats are then built for it, groups.py),
y_s carries the re-run forward, act_s counts the layers' inputs, and w_s is the
largest single layer's activations the stage may hold during its backward (0
without recompute).

Taking the forward and backward maxima separately, with half of each adjacent
send, keeps ``(m-1) C + F`` an upper bound of the simulated 1F1B makespan even
when stages split their time between forward and backward differently
(costmodel/pipeline.py has the proof). Splitting the problem keeps both parts
linear: the joint model multiplies m_j by C_j, whose exact linearisation has so
weak a relaxation that SCIP needed seconds for 24 GPUs. The search alternates
the two (split for m̂, shares, split again for the m found) and the exact
refinement (build.py) corrects what the alternation and the mean-block costing
leave on the table.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from autohet_cli.planner.groups import BlockStats, Template


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitInputs:
    template: Template
    stats: Sequence[BlockStats]  # per class
    mem_cap_bytes: Sequence[float]  # per class, after the runtime reserve
    state_bytes_per_param: int
    num_blocks: int
    send_ms: Sequence[float]  # per boundary
    sync_ms_per_param: float
    expected_microbatches: int
    # per class: what a stage's per-GPU parameters are multiplied by in the sync
    # term (its TP degree where the rate is per full parameter; empty: 1)
    sync_scale: Sequence[float] = ()
    # bytes per parameter of the layers before and after the blocks, where they
    # differ (ZeRO-1 does not shard tied weights); None: state_bytes_per_param
    end_state_bytes_per_param: int | None = None
    # the share of the blocks' and the end layers' update a stage steps (ZeRO-1)
    update_scale: float = 1.0
    end_update_scale: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitResult:
    status: str
    gap: float
    time_s: float
    blocks: tuple[int, ...]
    bottleneck_ms: float  # C
    fill_ms: float  # F
    sync_ms: float  # Z
    update_ms: float  # O


@dataclass(frozen=True, slots=True, kw_only=True)
class SharesResult:
    status: str
    gap: float
    time_s: float
    microbatches: tuple[int, ...]
    extra: tuple[int, ...]
    makespan_ms: float


# One SCIP instance per process, emptied and reused for every model: creating one
# (SCIP with its ~100 default plugins) costs 3-4 ms, as much as solving one of these
# models, and a 256-GPU plan solves a few hundred of them (issue 32). ``freeProb``
# drops the problem and keeps the plugins and parameters. One per thread, and per
# process: a forked planner process (planner.parallel) makes its own rather than
# share its parent's.
_SCIP = threading.local()


def _model(name: str, time_limit_s: float, gap_limit: float) -> Any:
    pid, model = getattr(_SCIP, "held", (None, None))
    model = cast(Any, model)
    fresh = model is None or pid != os.getpid()
    if not fresh:
        try:
            model.freeProb()
        except Exception:  # a solve that failed midway left it unusable: start over
            fresh = True
    if fresh:
        model = _new_scip()
        _SCIP.held = (os.getpid(), model)
    _SCIP.status = None
    model.createProbBasic(name)
    model.setParam("limits/time", max(0.05, time_limit_s))
    model.setParam("limits/gap", gap_limit)
    return model


def _new_scip() -> Any:
    from pyscipopt import Model
    from pyscipopt.scip import PY_SCIP_PARAMSETTING as SCIP_PARAMSETTING

    model = Model("autohet")
    model.hideOutput()
    model.setParam("randomization/randomseedshift", 0)
    model.setParam("randomization/permutationseed", 0)
    model.setParam("parallel/maxnthreads", 1)
    # These models are tiny (a dozen integers): cutting planes cost more than the
    # branching they save. 197 splits on 64 GPUs: 3.1 s, 7.3 s with them; same plans.
    model.setSeparating(SCIP_PARAMSETTING.OFF)
    # ... and so do primal heuristics: branching on a dozen integers finds and proves
    # the optimum by itself. mix-256 (issue 32): 4.1 s of SCIP per search, 2.0 s
    # without them; the same plans here and in the brute-force suite.
    model.setHeuristics(SCIP_PARAMSETTING.OFF)
    return model


def _status(model: Any) -> str:
    raw = str(model.getStatus())
    return {"optimal": "optimal", "gaplimit": "gap_limit", "timelimit": "time_limit"}.get(raw, raw)


def last_status() -> str | None:
    """How this thread's last solve ended (``_status``): with None from a solve,
    "infeasible" means nothing fits, "time_limit" only that SCIP found no solution
    in its time (heuristics are off), which a caller must not remember as the former."""
    return getattr(_SCIP, "status", None)


def solve_split(
    inp: SplitInputs, *, time_limit_s: float, gap_limit: float = 1e-3
) -> SplitResult | None:
    """Best layer split of one template; None when no split fits in memory."""
    from pyscipopt import quicksum

    tpl, sends = inp.template, inp.send_ms
    S = tpl.num_stages
    model = _model("split", time_limit_s, gap_limit)
    fw = model.addVar("Fw", lb=0.0)
    bw = model.addVar("Bw", lb=0.0)
    Z = model.addVar("Z", lb=0.0)
    O_ = model.addVar("O", lb=0.0)
    ns, ys = [], []
    for s, c in enumerate(tpl.classes):
        st = inp.stats[c]
        head, tail = s == 0, s == S - 1
        n = model.addVar(
            f"n{s}", vtype="I", lb=0 if (head or tail) and S > 1 else 1, ub=inp.num_blocks
        )
        ns.append(n)
        y = (st.head_ms if head else 0.0) + n * st.block_ms + (st.tail_ms if tail else 0.0)
        x = (
            (st.head_fwd_ms if head else 0.0)
            + n * st.block_fwd_ms
            + (st.tail_fwd_ms if tail else 0.0)
        )
        ys.append(y)
        half = ((sends[s - 1] if s > 0 else 0.0) + (sends[s] if s < S - 1 else 0.0)) / 2
        model.addCons(fw >= x + half)
        model.addCons(bw >= y - x + half)
        ends = (st.head_params if head else 0) + (st.tail_params if tail else 0)
        params = ends + n * st.block_params
        end_state = inp.end_state_bytes_per_param
        state = params * inp.state_bytes_per_param
        if end_state is not None:
            state = n * st.block_params * inp.state_bytes_per_param + ends * end_state
        act = (st.head_act if head else 0.0) + n * st.block_act + (st.tail_act if tail else 0.0)
        work = st.work_bytes(head=head, tail=tail) + st.cast_bytes(n, head=head, tail=tail)
        model.addCons(state + act * (S - s) + 2 * st.out_bytes + work <= inp.mem_cap_bytes[c])
        model.addCons(
            O_
            >= ((st.head_upd_ms if head else 0.0) + (st.tail_upd_ms if tail else 0.0))
            * inp.end_update_scale
            + n * st.block_upd_ms * inp.update_scale
        )
        scale = inp.sync_scale[c] if inp.sync_scale else 1.0
        model.addCons(Z >= inp.sync_ms_per_param * scale * params)
    model.addCons(quicksum(ns) == inp.num_blocks)
    # Symmetry: neighbouring middle stages of one class may swap block counts
    # without changing time; the later keeps fewer micro-batches in flight, so
    # it can always take the larger count.
    for s in range(1, S - 2):
        if tpl.classes[s] == tpl.classes[s + 1]:
            model.addCons(ns[s] <= ns[s + 1])
    fill = quicksum(ys) + 2 * sum(sends)
    m_hat = max(1, inp.expected_microbatches)
    model.setObjective((m_hat - 1) * (fw + bw) + fill + Z + O_, "minimize")
    model.optimize()
    _SCIP.status = _status(model)
    if model.getNSols() == 0:
        return None
    sol = model.getBestSol()
    blocks = tuple(round(model.getSolVal(sol, n)) for n in ns)
    return SplitResult(
        status=_status(model),
        gap=model.getGap(),
        time_s=model.getSolvingTime(),
        blocks=blocks,
        bottleneck_ms=model.getSolVal(sol, fw) + model.getSolVal(sol, bw),
        fill_ms=_fill_ms(inp, blocks),
        sync_ms=model.getSolVal(sol, Z),
        update_ms=model.getSolVal(sol, O_),
    )


def _fill_ms(inp: SplitInputs, blocks: Sequence[int]) -> float:
    S = len(blocks)
    total = 2 * sum(inp.send_ms)
    for s, (c, n) in enumerate(zip(inp.template.classes, blocks, strict=True)):
        st = inp.stats[c]
        total += (
            (st.head_ms if s == 0 else 0.0) + n * st.block_ms + (st.tail_ms if s == S - 1 else 0.0)
        )
    return total


def solve_shares(
    counts: Sequence[int],
    bottleneck_ms: Sequence[float],
    fill_ms: Sequence[float],
    num_microbatches: int,
    *,
    time_limit_s: float,
    gap_limit: float = 1e-4,
) -> SharesResult | None:
    """Micro-batches per pipeline of each template; None when M < pipelines."""
    from pyscipopt import quicksum

    M = num_microbatches
    if sum(counts) > M:
        return None
    model = _model("shares", time_limit_s, gap_limit)
    T = model.addVar("T", lb=0.0)
    ms, rs, total = [], [], []
    for j, (k, c, f) in enumerate(zip(counts, bottleneck_ms, fill_ms, strict=True)):
        m = model.addVar(f"m{j}", vtype="I", lb=1, ub=M // k)
        r = model.addVar(f"r{j}", vtype="I", lb=0, ub=max(0, k - 1))
        model.addCons(T >= (m - 1) * c + f)
        if k > 1:
            rho = model.addVar(f"rho{j}", vtype="B")
            model.addCons(r <= (k - 1) * rho)
            big = M * c + f
            model.addCons(T >= m * c + f - big * (1 - rho))
        ms.append(m)
        rs.append(r)
        total.append(k * m + r)
    model.addCons(quicksum(total) == M)
    model.setObjective(T, "minimize")
    model.optimize()
    _SCIP.status = _status(model)
    if model.getNSols() == 0:
        return None
    sol = model.getBestSol()
    return SharesResult(
        status=_status(model),
        gap=model.getGap(),
        time_s=model.getSolvingTime(),
        microbatches=tuple(round(model.getSolVal(sol, m)) for m in ms),
        extra=tuple(round(model.getSolVal(sol, r)) for r in rs),
        makespan_ms=model.getSolVal(sol, T),
    )
