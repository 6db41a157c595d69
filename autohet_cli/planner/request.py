"""What a search is asked and what it gives back (pure): the request, a candidate
plan with its evaluation, the result, and the score that orders candidates."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from autohet_cli.cluster import Cluster
from autohet_cli.costmodel.evaluate import PlanEval
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.models import ModelSpec
from autohet_cli.plan import Pipeline

Progress = Callable[[float, str], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchRequest:
    cluster: Cluster
    model: ModelSpec
    tables: CostTables
    global_batch_size: int
    objective: str = "time"  # or "cost": $ per token
    time_limit_s: float = 60.0
    tp_candidates: Sequence[int] = (1, 2, 4, 8)
    mbs_candidates: Sequence[int] = (1, 2, 4, 8)
    # Every stage of every plan searched recomputes its activations (Stage.recompute):
    # times and memory throughout (MILP, estimates, bounds, evaluation) are those of
    # recompute stages, and the plans carry the flag.
    recompute: bool = False
    # Stages on these GPU types recompute too (with recompute False): where one type's
    # memory binds and another's does not, the best layouts mix flags by type
    # (planner.recompute).
    recompute_types: frozenset[str] = frozenset()
    # Only (GPU type, TP, micro-batch size) combinations the profile measured
    # (CostTables.is_measured): a class without a measurement at a context's
    # (TP, mbs) is left out of that context, as if the cluster lacked it.
    measured_only: bool = False
    # A plan known to run here (recover: the old plan's survivors kept in place):
    # (pipelines, micro-batch size). It seeds the search as its first incumbent, so
    # groupings whose bound or estimate cannot beat it are never solved; the result
    # is never worse than it.
    incumbent: tuple[tuple[Pipeline, ...], int] | None = None
    # Ms per iteration a plan must beat to be of use to the caller (planner.decide:
    # a sharded plan ZeRO-1's threshold below the plain one), time objective only.
    # A grouping whose lower bound is not under it is never solved (estimates and
    # the solve caps still follow the incumbent alone): where the bound shows no
    # layout of the space can win, the search costs its enumeration, not its solves
    # (issue 32), and raises NoBetterPlan when it solved nothing.
    must_beat_ms: float | None = None
    # The weight-sharded space (issue 48, ``planner.weights``): groupings of one
    # template copied k >= 2 times, whose k copies of each stage hold 1/k of its
    # weights, gradients and optimizer state each (``shard: weights``) and share its
    # cut and TP degree (refinement moves the copies' boundaries together).
    shard_weights: bool = False

    def recomputes(self, gpu_type: str) -> bool:
        """Whether the stages this request plans on ``gpu_type`` recompute."""
        return self.recompute or gpu_type in self.recompute_types


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    pipelines: list[Pipeline]
    tp: int  # the largest stage degree
    mbs: int
    eval: PlanEval
    score: float
    solver_gap: float = 0.0

    def degree(self, gpu_type: str) -> int:
        """The TP degree of this candidate's stages on ``gpu_type`` (``tp`` if none)."""
        used = {
            s.tensor_parallel for p in self.pipelines for s in p.stages if s.gpu_type == gpu_type
        }
        return max(used, default=self.tp)


@dataclass(slots=True, kw_only=True)
class SearchResult:
    best: Candidate
    status: str
    gap: float  # SCIP's gap on the chosen grouping's split and shares
    search_gap: float  # against the lower bound over every grouping (a weak bound)
    time_s: float
    explored: int = 0
    pruned: int = 0
    hopeless: int = 0
    milp_gaps: list[float] = field(default_factory=list)
    # the next best candidates solved (best first, at most RUNNERS_UP): other layouts
    # that a change of settings (ZeRO-1) is re-evaluated on without a new search
    runners_up: list[Candidate] = field(default_factory=list)


FREE_PRICE_PER_HOUR = 1e-9  # what a plan on unpriced hosts alone is charged (scorer)


def scorer(cluster: Cluster, objective: str) -> Callable[[list[Pipeline], PlanEval], float]:
    """Seconds per iteration, or dollars per million tokens of the hosts in use.
    Hosts without a price (on-premises) cost nothing; a plan on them alone is
    charged ``FREE_PRICE_PER_HOUR`` so that free plans still rank by speed (all at
    zero, the search took any of them, and its gap divided by zero)."""

    def score(pipelines: list[Pipeline], ev: PlanEval) -> float:
        if objective == "time":
            return ev.iteration_ms
        hosts = {s.host for p in pipelines for s in p.stages}
        price = max(sum(cluster.host(h).price_per_hour for h in hosts), FREE_PRICE_PER_HOUR)
        return price / 3600.0 / ev.tokens_per_s * 1e6 if ev.tokens_per_s else float("inf")

    return score
