"""torch.compile per block trains like eager: pipeline cuts, recomputation, TP, sharded
weights (FSDP2; the blocks are compiled before they are sharded), the chunked loss.

The worker entry point under torchrun (gloo, CPU; inductor compiles C++ here)
with ``--compile on``, against the same plan with ``--compile off`` (its ranks forked
from the ``zygote`` that imported torch once: the compiled run is the one that proves
torchrun and fresh interpreters, and four more of them cost 15 s of CPU). Inductor fuses
and reorders floating-point work, so agreement is within 1e-4 relative (losses,
gradient norms, every parameter after 3 SGD steps), not the 1e-5 that plan shapes
keep among themselves in eager mode.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_runtime_exact import (
    ROOT,
    TIMEOUT_S,
    RunResult,
    _check,
    _env,
    _worker_args,
    collect,
    make_plan,
)
from zygote import run_workers

from autohet_cli.plan import write_plan

pytestmark = pytest.mark.dist

TOL = 1e-4


def _run(
    layout: list, tmp: Path, name: str, *, compile_flag: str, torchrun: bool, tp: int = 1
) -> tuple[RunResult, list[dict]]:
    """``torchrun``: under torchrun, else forked from the ``zygote``."""
    plan = make_plan(name, layout, tp=tp, recompute_first=True)
    # every pipeline's second stage sharded over the two pipelines (FSDP2)
    plan = replace(
        plan,
        pipelines=tuple(
            replace(p, stages=(p.stages[0], replace(p.stages[1], shard="weights")))
            for p in plan.pipelines
        ),
    )
    out = tmp / name
    out.mkdir(parents=True)
    _, path = write_plan(plan, out)
    n = len(plan.devices())
    args = [*_worker_args(path, out, "sgd", run_dir=True), f"--compile={compile_flag}"]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={n}", *args]
        proc = subprocess.run(
            cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900, check=False
        )
        _check(proc, name)
        stdout = proc.stdout
    else:
        ranks = run_workers(args, n, env=_env(), cwd=ROOT, logs=out / "logs", timeout_s=TIMEOUT_S)
        for code, _stdout, stderr in ranks:
            _check(subprocess.CompletedProcess(args, code, "", stderr), name)
        stdout = "".join(rank_stdout for _code, rank_stdout, _stderr in ranks)
    startups = [
        json.loads(line.split("autohet-startup: ", 1)[1])
        for line in stdout.splitlines()
        if "autohet-startup: " in line
    ]
    return collect(out, plan), startups


def _close(run: RunResult, ref: RunResult) -> None:
    assert run.losses == pytest.approx(ref.losses, rel=TOL)
    assert run.grad_norms == pytest.approx(ref.grad_norms, rel=TOL)
    every = {name: value for params in ref.params.values() for name, value in params.items()}
    for rank, params in run.params.items():
        for name, value in params.items():
            want = every[name]
            err = float((value - want).norm() / want.norm().clamp_min(1e-12))
            assert err <= TOL, f"rank {rank} {name}: relative error {err:.2e}"


@pytest.mark.timeout(1200)
@pytest.mark.slow(
    "inductor compiles the blocks in each of 6 workers (the eager run beside it is its reference)"
)
def test_compiled_pipeline_with_recompute_tp_and_sharded_weights_matches_eager(
    tmp_path: Path,
) -> None:
    # Two pipelines of two stages on shares 3 and 5: a recomputing TP 2 first stage, and
    # a TP 1 second stage (blocks and the chunked loss) sharded over both pipelines.
    layout = [(3, [(0, 2, 2), (2, 6, 1)]), (5, [(0, 2, 2), (2, 6, 1)])]
    eager, eager_startup = _run(layout, tmp_path, "eager", compile_flag="off", torchrun=False)
    compiled, startup = _run(layout, tmp_path, "compiled", compile_flag="on", torchrun=True)
    _close(compiled, eager)
    assert startup and startup[0]["compiled"] is True
    assert startup[0].get("compile_s", 1.0) > 0  # inductor ran (and was timed)
    assert eager_startup and eager_startup[0]["compiled"] is False
