"""The one case where a public planner beat ours (issue 15): GPT-Neo-2.7B on 8 A100-40 +
8 V100-16 (two hosts of each, 4 GPUs per host, 100 Gbit/s), global batch 128, sequence
2048, with Sailor's measured profiles. Metis's plan puts each pipeline's first layers on
V100 pairs at TP 2 and the rest on single A100s, which needs a TP degree per stage.

Judged by the simulator (``evaluate``) and by ``autohet estimate`` on the written YAML,
our plan must be at least as fast as Metis's, and it must be a per-stage TP plan (one
degree for every stage was 0.8% behind Metis's plan).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.plan import Plan, write_plan
from benchmarks.metis_neo import metis_plan, neo_inputs, plan_neo
from tests.cli import ROOT, autohet

CLUSTER = ROOT / "profiles/clusters/neo-a100-v100.yaml"
PROFILE = ROOT / "profiles/sailor/GPT-Neo-2.7B.yaml"
BATCH = 128


@pytest.fixture(scope="module")
def planned() -> tuple[Plan, Plan, float, float]:
    inputs, tables = neo_inputs()
    out = plan_neo()
    ours = out.plan
    metis = metis_plan(ours)
    metis.validate("metis")
    ev = evaluate(list(metis.pipelines), inputs.cluster, tables, 1)
    assert ev.fits
    return ours, metis, out.eval.iteration_ms, ev.iteration_ms


def test_our_plan_is_at_least_as_fast_as_metis_by_the_simulator(
    planned: tuple[Plan, Plan, float, float],
) -> None:
    ours, _, ours_ms, metis_ms = planned
    assert ours_ms <= metis_ms, f"ours {ours_ms:.1f} ms, Metis {metis_ms:.1f} ms"
    # It gets there with a TP degree per stage, as Metis does.
    assert len(ours.tp_degrees) > 1, ours.tp_degrees


def test_estimate_agrees_on_both_plans(
    planned: tuple[Plan, Plan, float, float], tmp_path: Path
) -> None:
    ours, metis, ours_ms, metis_ms = planned
    times = {}
    for plan in (ours, metis):
        _, path = write_plan(plan, tmp_path)
        res = autohet(
            "estimate",
            str(path),
            "--cluster",
            str(CLUSTER),
            "--profile",
            str(PROFILE),
            "--json",
            cwd=tmp_path,
        )
        assert res.returncode == 0, res.stderr
        times[plan.name] = json.loads(res.stdout)["iteration_time_s"] * 1e3
    assert times["neo"] == pytest.approx(ours_ms, rel=1e-6)
    assert times["metis-neo"] == pytest.approx(metis_ms, rel=1e-6)
    assert times["neo"] <= times["metis-neo"]


def test_one_degree_for_all_stages_cannot_match_metis(
    planned: tuple[Plan, Plan, float, float],
) -> None:
    """Why TP per stage: restricted to one degree and replicated weights, the planner
    stays behind Metis (which has neither); sharding the weights (TP 1, issue 48)
    gets that one-degree plan ahead of it again."""
    _, _, _, metis_ms = planned
    uniform = plan_neo(one_degree=True, shard_weights=False)
    assert len(uniform.plan.tp_degrees) == 1
    assert uniform.eval.iteration_ms > metis_ms
    sharded = plan_neo(one_degree=True)
    assert any(s.shard == "weights" for p in sharded.plan.pipelines for s in p.stages)
    assert sharded.eval.iteration_ms < metis_ms
