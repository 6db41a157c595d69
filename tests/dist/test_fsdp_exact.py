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
runs zero-weight micro-batches so its holders issue the same gathers; the 7/1 one's
holders of two GPU types, A100-40 and V100-16 by label); a pipeline
whose second stage is sharded and first is not (the tied embedding and head, left
out of FSDP, still sync through ``gradsync``); a sharded stage that recomputes
its activations beside a ZeRO-1 one; one-stage pipelines (the whole model
sharded, tied weights inside one stage) with ``reshard_after_forward: false``; TP 2
inside sharded holders (a 2-D mesh), alone and before a replicated stage; and AdamW
on the DTensor shards. Then checkpoints: saved by TP 2 sharded holders, resumed under
one device and under another sharded plan, and exported to HF; validation losses;
and bf16 gathers. torch.compile on a sharded stage: tests/dist/test_compile_exact.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from realdata import data_flags
from test_runtime_exact import (
    LR,
    NUM_LAYERS,
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
    # (equal shares: "tp2-first-stage-only"; 6 and 2, every stage sharded, under the
    # launcher's --run-dir: test_a_run_folder_run_trains_exactly)
    "unequal-7-1-second-stage-only": ([(1, TWO_STAGES), (7, TWO_STAGES)], {1}, True),
    "one-stage-kept-gathered": ([(5, [(0, 6)]), (3, [(0, 6)])], None, False),
    # The first stage sharded and recomputing, the second ZeRO-1 (see EXTRA).
    "recompute-beside-zero1": ([(3, [(0, 2), (2, 6)]), (5, [(0, 2), (2, 6)])], {0}, True),
    # TP 2 inside each holder: FSDP over the (holders x TP) mesh's "dp" dimension,
    # the whole model (tied embedding and head inside) on unequal shares.
    "tp2-one-stage": ([(5, [(0, 6, 2)]), (3, [(0, 6, 2)])], None, True),
    # a sharded TP 2 stage before a replicated TP 1 one
    "tp2-first-stage-only": ([(4, [(0, 3, 2), (3, 6)]), (4, [(0, 3, 2), (3, 6)])], {0}, True),
}
EXTRA = {"recompute-beside-zero1": {"recompute_first": True, "zero1": True}}
# Holders of different GPU types (issue 48): on a CPU only the label differs, which
# is what the runtime must not care about (its groups, shards and pads are the same).
TYPES = {"unequal-7-1-second-stage-only": ("A100-40", "V100-16")}


def typed(plan: Plan, types: tuple[str, ...]) -> Plan:
    """``plan`` with pipeline i's stages labelled ``types[i]``."""
    return replace(
        plan,
        pipelines=tuple(
            replace(p, stages=tuple(replace(s, gpu_type=t) for s in p.stages))
            for p, t in zip(plan.pipelines, types, strict=True)
        ),
    )


@pytest.mark.timeout(200)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_weight_sharded_plan_matches_single_process(
    shape: str, reference_sgd: RunResult, tmp_path: Path
) -> None:
    layout, stages, reshard = SHAPES[shape]
    plan = make_plan(f"fsdp-{shape}", layout, **EXTRA.get(shape, {}))
    plan = sharded(plan, stages, reshard=reshard)
    if shape in TYPES:
        plan = typed(plan, TYPES[shape])
        plan.validate()
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


@pytest.mark.timeout(200)
def test_validation_losses_of_sharded_holders_on_unequal_shares(tmp_path: Path) -> None:
    """--eval-every on holders of shares 6/2 (the shorter pipeline runs extra
    validation micro-batches that gather and are not counted) gives one process's
    validation losses, and trains on its curve."""
    evals = {}
    for name, layout, shard in (
        ("one", [(8, [(0, NUM_LAYERS)])], False),
        ("sharded", [(6, TWO_STAGES), (2, TWO_STAGES)], True),
    ):
        plan = make_plan(f"fsdp-eval-{name}", layout)
        plan = sharded(plan) if shard else plan
        out = tmp_path / name
        out.mkdir()
        _, path = write_plan(plan, out)
        args = [*_worker_args(path, out, "sgd"), "--eval-every", "1", "--eval-batches", "2"]
        ranks = run_workers(args, len(plan.devices()), env=_env(), cwd=ROOT, timeout_s=150)
        assert [code for code, _, _ in ranks] == [0] * len(ranks), ranks[0][2][-3000:]
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        evals[name] = {x["step"]: x["eval_loss"] for x in lines if "eval_loss" in x}
        evals[name + "-train"] = {x["step"]: x["loss"] for x in lines if "loss" in x}
    assert sorted(evals["one"]) == sorted(evals["sharded"]) == [0, 1, 2]
    for kind in ("", "-train"):
        for step, loss in evals["one" + kind].items():
            assert evals["sharded" + kind][step] == pytest.approx(loss, rel=1e-5), (kind, step)


CKPT = "fsdp-ckpt"  # the plans below share the name, so they share the checkpoints
STEPS_CKPT = 6


def _ckpt_args(plan: Plan, tmp: Path, steps: int, metrics: str, *extra: str) -> list[str]:
    _, path = write_plan(plan, tmp / "plans")
    return [
        *("-m", "autohet_cli.runtime.train", "--plan", str(path), "--steps", str(steps)),
        *("--seed", "7", "--lr", str(LR["adam"]), "--device", "cpu", *data_flags()),
        *("--decay-steps", str(STEPS_CKPT), "--metrics", str(tmp / metrics)),
        *("--checkpoint-dir", str(tmp / "disk"), "--remote-storage", "none", *extra),
    ]


def _run_ckpt(args: list[str], count: int) -> str:
    ranks = run_workers(args, count, env=_env(), cwd=ROOT, timeout_s=150)
    for code, _, stderr in ranks:
        assert code == 0, stderr[-3000:]
    return "".join(stderr for _, _, stderr in ranks)


def _losses(path: Path) -> dict[int, float]:
    lines = map(json.loads, path.read_text().splitlines())
    return {m["step"]: m["loss"] for m in lines if "loss" in m}


@pytest.mark.timeout(200)
@pytest.mark.slow(
    "four runs one after another (the reference, a 4-rank saving run, two resumes); "
    "about 23 s on a quiet machine"
)
def test_sharded_checkpoints_resume_under_one_device_and_another_sharded_plan(
    tmp_path: Path,
) -> None:
    """A sharded plan (AdamW, shares 6 and 2, TP 2 inside each holder: FSDP's shards
    of TP's shards) saves steps 2 and 4 in today's format; one device, and a sharded
    plan of another cut, TP degree and shares, resume step 4 on
    the uninterrupted single-process curve (optimizer state included). The saving run
    starts with ``--resume`` and nothing to resume: its weights are drawn as one
    process draws them."""
    (tmp_path / "plans").mkdir()
    one = make_plan(CKPT, [(8, [(0, NUM_LAYERS)])], optimizer="adam")
    ref_args = _ckpt_args(replace(one, name="ref"), tmp_path, STEPS_CKPT, "ref.jsonl")
    _run_ckpt([*ref_args, "--checkpoint-every", "4"], 1)
    reference = _losses(tmp_path / "ref.jsonl")
    saving = sharded(make_plan(CKPT, [(6, [(0, 6, 2)]), (2, [(0, 6, 2)])], optimizer="adam"))
    args = _ckpt_args(saving, tmp_path, 4, "save.jsonl", "--checkpoint-every", "2", "--resume")
    _run_ckpt(args, 4)
    other = sharded(
        make_plan(CKPT, [(3, [(0, 2), (2, 6)]), (5, [(0, 2), (2, 6)])], optimizer="adam")
    )
    step_4 = tmp_path / "disk" / CKPT / "default" / "step-00000004"
    runs = {"save": _losses(tmp_path / "save.jsonl")}
    for tag, plan in (("one", one), ("other", other)):
        quiet = ("--checkpoint-every", "0", "--no-emergency-save")  # step 4 stays the newest
        args = _ckpt_args(plan, tmp_path, STEPS_CKPT, f"{tag}.jsonl", "--resume", *quiet)
        stderr = _run_ckpt(args, len(plan.devices()))
        assert f"resumed from {step_4} at step 4" in stderr, stderr[-3000:]
        runs[tag] = _losses(tmp_path / f"{tag}.jsonl")
    assert sorted(runs["save"]) == [0, 1, 2, 3]
    assert sorted(runs["one"]) == sorted(runs["other"]) == [4, 5]
    for tag, losses in runs.items():
        for step, loss in losses.items():
            assert loss == pytest.approx(reference[step], rel=1e-5), (tag, step)
    # autohet export of the sharded holders' step 4 is the one process's step 4 in HF form
    ref_step = tmp_path / "disk" / "ref" / "default" / "step-00000004"
    exported = {
        tag: _export(step, tmp_path, tag) for tag, step in (("sharded", step_4), ("ref", ref_step))
    }
    assert set(exported["sharded"]) == set(exported["ref"])
    for name, want in exported["ref"].items():
        got = exported["sharded"][name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        err = float((got - want).norm() / want.norm().clamp_min(1e-12))
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def _export(step: Path, tmp: Path, tag: str) -> dict[str, torch.Tensor]:
    """``autohet export --format hf`` of ``step`` (its plan from ``tmp/plans``)."""
    from safetensors.torch import load_file

    out = tmp / f"hf-{tag}"
    cmd = [sys.executable, "-m", "autohet_cli", "export", str(step), "--out", str(out)]
    proc = subprocess.run(
        cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=100, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    assert tensors, list(out.iterdir())
    return tensors


@pytest.mark.timeout(200)
def test_a_run_folder_run_trains_exactly(reference_sgd: RunResult, tmp_path: Path) -> None:
    """Under the launcher's ``--run-dir`` (checkpoints on by default) a plan sharded
    over holders of shares 6 and 2 (the shorter pipeline pads) trains on the
    single-process curve."""
    plan = sharded(make_plan("fsdp-run-dir", [(6, TWO_STAGES), (2, TWO_STAGES)]))
    out = tmp_path / plan.name
    out.mkdir()
    _, path = write_plan(plan, out)
    args = _worker_args(path, out, "sgd", run_dir=True)
    ranks = run_workers(args, 4, env=_env(), cwd=ROOT, logs=out / "logs", timeout_s=150)
    assert [code for code, _, _ in ranks] == [0] * 4, ranks[0][2][-3000:]
    assert_matches(collect(out, plan), reference_sgd)
    assert_sharded(plan, out)


BF16_SITE = """import torch
import autohet_cli.runtime.trainer as t
t.Trainer._precision = lambda self: torch.bfloat16
"""


@pytest.mark.timeout(200)
@pytest.mark.slow("three fresh interpreters (torchrun) import torch: about 20 s when quiet")
def test_bf16_gathers_train_like_one_bf16_process(tmp_path: Path) -> None:
    """The GPU path's mixed precision on the CPU: the trainer made to compute in bf16
    (a ``sitecustomize`` patch: the CPU runtime computes in fp32 otherwise), so FSDP
    gathers bf16 weights (``fsdp_stage.mixed_precision``) and reduce-scatters fp32
    gradients, under autocast. Two sharded holders on shares 5/3 follow one bf16
    process to bf16's precision."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BF16_SITE)
    env = _env()
    env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
    losses = {}
    for name, layout, shard in (
        ("one", [(8, [(0, NUM_LAYERS)])], False),
        ("sharded", [(5, [(0, NUM_LAYERS)]), (3, [(0, NUM_LAYERS)])], True),
    ):
        plan = make_plan(f"bf16-{name}", layout)
        plan = sharded(plan) if shard else plan
        out = tmp_path / name
        out.mkdir()
        _, path = write_plan(plan, out)
        n = len(plan.devices())
        # fresh interpreters (torchrun), so that sitecustomize runs in each; the
        # zygote's workers are forked from a server that imported the runtime unpatched
        run = ("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}")
        cmd = [sys.executable, *(run if n > 1 else ()), *_worker_args(path, out, "sgd")]
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150, check=False
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[name] = _losses(out / "metrics.jsonl")
    assert sorted(losses["one"]) == sorted(losses["sharded"]) == [0, 1, 2]
    for step, loss in losses["one"].items():
        assert losses["sharded"][step] == pytest.approx(loss, rel=2e-3), step
