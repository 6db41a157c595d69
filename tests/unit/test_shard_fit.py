"""Refitting weight-sharded stages' collectives from a run (issue 48: profile run
measures a sharded stage and refits; ``profiling.shardfit``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.costmodel.tables import CostTables
from autohet_cli.errors import ConfigError
from autohet_cli.estimates.profile import Overhead
from autohet_cli.launch.compare import shard_links
from autohet_cli.plan import Pipeline
from autohet_cli.profiling.calibrate import calibrate
from autohet_cli.profiling.shardfit import shard_factor
from tests.unit.test_sharded_weights_cost import TOY, cluster, tables, whole_model_replicas

HOSTS = ["h0", "h1", "h2"]


def _with_x(t: CostTables, x: float, *, catalog: bool = False) -> CostTables:
    """``t`` on hardware whose collectives take ``x`` times the model's; ``catalog``:
    with the catalog's fixed costs (message latency), as ``calibrate`` builds its
    tables, instead of the toy's none."""
    profile = replace(t.profile, overheads={"A100-40": Overhead(shard_x=x)})
    return CostTables(TOY, profile, t.training, **({} if catalog else {"gpu_specs": t.gpu_specs}))


def _check(plan: list[Pipeline], truth: CostTables, *, device: str = "cuda") -> dict[str, Any]:
    """The prediction check a run of ``plan`` on hardware whose collectives take
    ``truth``'s factor would write: its measured stage times are ``truth``'s."""
    c = cluster([(h, 1) for h in HOSTS])
    links = shard_links_of(plan, c)
    ev = evaluate(plan, c, truth, 1)
    stages = []
    for p, (pipe, pe) in enumerate(zip(plan, ev.pipelines, strict=True)):
        for s, (st, se) in enumerate(zip(pipe.stages, pe.stages, strict=True)):
            stages.append(
                {
                    "pipeline": p,
                    "stage": s,
                    "gpu_type": st.gpu_type,
                    "tensor_parallel": st.tensor_parallel,
                    "layers": [st.layer_start, st.layer_end],
                    "recompute": False,
                    "shard": st.shard,
                    "num_microbatches": pipe.num_microbatches,
                    **(
                        {
                            "reshard_after_forward": st.reshard_after_forward,
                            "shard_link": links[(p, s)],
                        }
                        if (p, s) in links
                        else {}
                    ),
                    "measured": {
                        "fwd_ms": se.cost.fwd_ms,
                        "bwd_ms": se.cost.bwd_ms,
                        "optimizer_ms": se.cost.update_ms,
                        "sync_ms": 0.0,
                        "p2p_ms": 0.0,
                        "mem_bytes": se.mem_bytes,
                    },
                }
            )
    return {"stages": stages, "micro_batch_size": 1, "seq_len": 128, "precision": "bf16",
            "device": device}  # fmt: skip


def shard_links_of(plan: list[Pipeline], c: Any) -> dict[tuple[int, int], dict[str, Any]]:
    from autohet_cli.plan import Plan
    from autohet_cli.settings import TrainingSettings

    whole = Plan(
        name="p", version=1, model_name=TOY.name, num_layers=TOY.num_layers,
        training=TrainingSettings(global_batch_size=2 * len(plan), micro_batch_size=1, seq_len=128),
        tensor_parallel=1, pipelines=tuple(plan),
    )  # fmt: skip
    return shard_links(whole, c)


def test_the_check_records_what_each_sharded_stage_gathered_over() -> None:
    plan = whole_model_replicas(HOSTS) + [
        Pipeline(num_microbatches=2, stages=whole_model_replicas(["h0"], shard="none")[0].stages)
    ]
    links = shard_links_of(plan, cluster([(h, 1) for h in HOSTS]))
    # three holders over the hosts' 0.8 Gbit/s; the replicated stage has no link
    assert links == {(i, 0): {"holders": 3, "gbps": 0.8, "nic_share": 1} for i in range(3)}


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("x", [0.5, 3.0])
def test_the_factor_the_hardware_had_is_found_again(x: float, reshard: bool) -> None:
    plan = whole_model_replicas(HOSTS, reshard=reshard)
    check = _check(plan, _with_x(tables(), x))
    assert shard_factor(check["stages"], tables()) == pytest.approx(x, rel=1e-6)


def test_collectives_the_compute_hid_refit_nothing() -> None:
    plan = whole_model_replicas(HOSTS)
    check = _check(plan, _with_x(tables(), 1e-9))  # as fast as no collectives at all
    assert shard_factor(check["stages"], tables()) is None
    unlinked = [{k: v for k, v in st.items() if k != "shard_link"} for st in check["stages"]]
    assert shard_factor(unlinked, tables()) is None  # a check from before the links


def test_calibrate_refits_the_factor_and_the_next_estimate_meets_the_run() -> None:
    plan = whole_model_replicas(HOSTS)
    check = _check(plan, _with_x(tables(), 2.5, catalog=True))
    refit, rows = calibrate(tables().profile, check, TOY, run_id="r1", global_batch_size=6)
    assert rows == []  # sharded stages alone: nothing else to refit
    assert refit.overheads["A100-40"].shard_x == pytest.approx(2.5, rel=1e-6)
    assert refit.meta["calibrated_from"] == ["r1"]
    c = cluster([(h, 1) for h in HOSTS])
    after = evaluate(plan, c, CostTables(TOY, refit, tables().training), 1)
    measured = check["stages"][0]["measured"]
    cost = after.pipelines[0].stages[0].cost
    assert (cost.fwd_ms, cost.bwd_ms) == pytest.approx((measured["fwd_ms"], measured["bwd_ms"]))
    # beside replicated stages, they still refit the factor, and the layers only from those
    check = _check(whole_model_replicas(HOSTS[:2]) + whole_model_replicas(["h2"], shard="none"),
                   _with_x(tables(), 2.5, catalog=True))  # fmt: skip
    refit, rows = calibrate(tables().profile, check, TOY, run_id="r2", global_batch_size=6)
    assert refit.overheads["A100-40"].shard_x == pytest.approx(2.5, rel=1e-6)
    assert [r["fwd_x"] for r in rows] == [pytest.approx(1.0)]
    # a sharded run whose collectives hid refits nothing, and says so
    hidden = _check(plan, _with_x(tables(), 1e-9, catalog=True))
    with pytest.raises(ConfigError, match="no sharded stage's collectives could be refitted"):
        calibrate(tables().profile, hidden, TOY, run_id="r3", global_batch_size=6)


def test_a_mixed_run_fits_the_factor_against_the_layer_times_it_refitted() -> None:
    """A run whose plain stages took 3 times the analytic layer times and whose
    sharded copies took what the refitted layers and collectives 2 times the
    model's give: the factor is 2, as from the refitted profile alone; before, it
    was fitted against the old layer times and took their error for the
    collectives' (3.5 here)."""
    from autohet_cli.launch.compare import compare
    from autohet_cli.profiling.schema import Profile
    from autohet_cli.profiling.shardfit import _row
    from autohet_cli.settings import TrainingSettings
    from tests.unit.test_prediction_check import MODEL, _plan, _report

    plan = _plan()
    check = compare(plan, _report(plan, 3.0, mem_bytes=900 << 20, step_extra_ms=5.0), None)
    layers, _ = calibrate(Profile(), check, MODEL, run_id="plain", global_batch_size=8)
    training = TrainingSettings(
        global_batch_size=8, micro_batch_size=check["micro_batch_size"],
        seq_len=check["seq_len"], precision="fp32",
    )  # fmt: skip
    link = {"holders": 2, "gbps": 2.0, "nic_share": 1}
    sharded = []
    for st in check["stages"]:
        st = dict(st, shard="weights", shard_link=link, reshard_after_forward=True)
        row = _row(st, CostTables(MODEL, layers, training))
        assert row is not None
        total = row[1](2.0)
        st["measured"] = dict(st["measured"], fwd_ms=total / 3, bwd_ms=2 * total / 3)
        sharded.append(st)
    mixed = dict(check, stages=[*check["stages"], *sharded])
    refit, _ = calibrate(Profile(), mixed, MODEL, run_id="mixed", global_batch_size=8)
    assert refit.overheads["cpu"].shard_x == pytest.approx(2.0)
