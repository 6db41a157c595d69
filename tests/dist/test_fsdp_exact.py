"""Weight-sharded stages (``shard: weights``, FSDP2 over their holders) train exactly
like one process on the same global batch (issue 48).

The plans are ``test_runtime_exact``'s gpt-tiny plans (6 layers, 8 micro-batches of
2 samples, real text, clipping that acts at every step, 3 steps) with some or all
stages weight-sharded over the stages of the other pipelines that hold the same
layers; they are checked against that file's single-process reference with its
tolerances (losses and grad norms 1e-5 relative; SGD weights 1e-5 per tensor; AdamW
weights within half a step). Each rank dumps its stage's full (gathered) tensors, so
the holders' copies must also be bitwise equal, as replicas' are.

Shapes: equal batch shares; unequal ones (6 and 2, 7 and 1: the shorter pipeline
runs zero-weight micro-batches so its holders issue the same gathers); a pipeline
whose second stage is sharded and first is not (the tied embedding and head, left
out of FSDP, still sync through ``gradsync``); a sharded stage that recomputes
its activations beside a ZeRO-1 one; one-stage pipelines (the whole model
sharded, tied weights inside one stage) with ``reshard_after_forward: false``; and
AdamW on the DTensor shards.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_runtime_exact import (
    LR,
    ROOT,
    RunResult,
    _env,
    _reference,
    _worker_args,
    assert_matches,
    collect,
    make_plan,
    run_plan,
)
from zygote import run_workers

from autohet_cli.plan import Plan, write_plan

pytestmark = pytest.mark.dist


def sharded(plan: Plan, stages: set[int] | None = None, *, reshard: bool = True) -> Plan:
    """``plan`` with stages ``stages`` (indices within each pipeline; None: all) sharded."""
    return replace(
        plan,
        pipelines=tuple(
            replace(
                p,
                stages=tuple(
                    replace(s, shard="weights", reshard_after_forward=reshard)
                    if stages is None or j in stages
                    else s
                    for j, s in enumerate(p.stages)
                ),
            )
            for p in plan.pipelines
        ),
    )


@pytest.fixture(scope="module")
def reference_sgd(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return _reference(tmp_path_factory, "sgd")


@pytest.fixture(scope="module")
def reference_adam(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return _reference(tmp_path_factory, "adam")


TWO_STAGES = [(0, 3), (3, 6)]

SHAPES: dict[str, tuple[list[tuple[int, list[tuple[int, ...]]]], set[int] | None, bool]] = {
    # (layout, sharded stage indices (None: all), reshard_after_forward)
    "equal": ([(4, TWO_STAGES), (4, TWO_STAGES)], None, True),
    "unequal": ([(6, TWO_STAGES), (2, TWO_STAGES)], None, True),
    "unequal-7-1-second-stage-only": ([(1, TWO_STAGES), (7, TWO_STAGES)], {1}, True),
    "one-stage-kept-gathered": ([(5, [(0, 6)]), (3, [(0, 6)])], None, False),
    # The first stage sharded and recomputing, the second ZeRO-1 (see EXTRA).
    "recompute-beside-zero1": ([(3, [(0, 2), (2, 6)]), (5, [(0, 2), (2, 6)])], {0}, True),
}
EXTRA = {"recompute-beside-zero1": {"recompute_first": True, "zero1": True}}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_weight_sharded_plan_matches_single_process(
    shape: str, reference_sgd: RunResult, tmp_path: Path
) -> None:
    layout, stages, reshard = SHAPES[shape]
    plan = make_plan(f"fsdp-{shape}", layout, **EXTRA.get(shape, {}))
    plan = sharded(plan, stages, reshard=reshard)
    assert_matches(run_plan(plan, tmp_path), reference_sgd)
    assert_sharded(plan, tmp_path / plan.name)


@pytest.mark.timeout(200)
def test_adamw_on_sharded_weights_matches_single_process(
    reference_adam: RunResult, tmp_path: Path
) -> None:
    plan = sharded(make_plan("fsdp-adam", [(5, TWO_STAGES), (3, TWO_STAGES)], optimizer="adam"))
    assert_matches(run_plan(plan, tmp_path), reference_adam, adam_lr=LR["adam"])
    assert_sharded(plan, tmp_path / plan.name)


def assert_sharded(plan: Plan, out: Path) -> None:
    """A sharded stage's ranks held about half its parameter elements (two holders; the
    tied embedding and head stay whole), the others all of them."""
    for f in sorted((out / "state").glob("rank*.pt")):
        dump = torch.load(f)
        info = dump["rank_info"]
        full = sum(t.numel() for t in dump["params"].values())
        held = info["held_numel"]
        if plan.pipelines[info["pipeline"]].stages[info["stage"]].shard == "weights":
            assert held < 0.75 * full, (f.name, held, full)
        else:
            assert held == full, (f.name, held, full)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("flags", "what"),
    [
        (["--checkpoint-every", "1"], "checkpoints (--checkpoint-every)"),
        (["--resume"], "--resume"),
        (["--eval-every", "1"], "validation losses (--eval-every)"),
    ],
)
def test_the_worker_refuses_what_a_sharded_run_cannot_do_yet(
    flags: list[str], what: str, tmp_path: Path
) -> None:
    """In one line, before the process group (so a plain process, not one per rank)."""
    plan = sharded(make_plan("fsdp-refused", [(4, TWO_STAGES), (4, TWO_STAGES)]))
    _, path = write_plan(plan, tmp_path)
    cmd = [sys.executable, *_worker_args(path, tmp_path, "sgd"), *flags]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=100, check=False
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert f"runs without {what} for now (issue 48)" in lines[0]


@pytest.mark.timeout(200)
def test_a_run_folder_run_trains_and_says_it_saves_nothing(
    reference_sgd: RunResult, tmp_path: Path
) -> None:
    """Under the launcher's ``--run-dir`` checkpoints default to on; a sharded plan
    trains without them and says so once (rank 0), rather than refusing every launch."""
    plan = sharded(make_plan("fsdp-run-dir", [(6, TWO_STAGES), (2, TWO_STAGES)]))
    out = tmp_path / plan.name
    out.mkdir()
    _, path = write_plan(plan, out)
    args = _worker_args(path, out, "sgd", run_dir=True)
    ranks = run_workers(args, 4, env=_env(), cwd=ROOT, logs=out / "logs", timeout_s=150)
    assert [code for code, _, _ in ranks] == [0] * 4, ranks[0][2][-3000:]
    note = "saves no checkpoints yet (issue 48), not even on a preemption notice"
    assert [note in stderr for _, _, stderr in ranks] == [True, False, False, False]
    assert_matches(collect(out, plan), reference_sgd)
    assert not list(out.rglob("*.distcp"))
