"""Every plan shape trains exactly like one process on the same global batch.

Each test writes a small gpt-tiny plan, runs the real worker entry point under
torchrun (gloo on CPU), and compares the per-step loss, the global gradient norm
and every parameter on every rank after 3 steps with the single-process
reference: the one-device plan through the same entry point, no torchrun. Plans
differ only in how the global batch of 8 micro-batches x 2 samples and the 6
layers are spread (and, for one shape, which stages recompute activations). They
train on real text (``realdata``) with clipping by the global norm that acts at
every step, warmup and cosine decay; ``tests/unit/test_training_reference`` ties
the single-process run to torch's own clipping and schedulers.

Losses must agree within 1e-5 relative, and copies of one parameter on different
ranks (pipeline replicas, TP replicas, the tied embedding and head) must be
bitwise equal. The plan shapes run with SGD, whose update is linear in the
gradient, so ``|p - p_ref| / |p_ref| <= 1e-5`` per tensor checks the gradients
themselves. AdamW divides each update by the gradient's RMS, so where a gradient
is zero in exact arithmetic (a handful of elements at the first step) its rounding
noise, which depends on the summation order, sets a step of up to a tenth of the
learning rate. The AdamW test therefore checks every element within half a step
(0.5 * lr: a missing or doubled gradient sync moves elements by whole steps) and
all but 1e-4 of them within 1% of a step.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from realdata import CLIP, data_flags
from zygote import run_workers

from autohet_cli.plan import Device, Pipeline, Plan, Stage, write_plan
from autohet_cli.settings import TrainingSettings

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
MICRO_BATCH = 2
SEQ_LEN = 32
NUM_LAYERS = 6  # gpt-tiny: embedding, 4 blocks, head
LR = {"sgd": 0.05, "adam": 1e-3}
TIMEOUT_S = 150

# [(num_microbatches, [(start, end), ...])]; a stage may be (start, end, tp) to give it
# its own TP degree instead of the plan's.
Layout = list[tuple[int, list[tuple[int, ...]]]]


def make_plan(
    name: str,
    layout: Layout,
    *,
    tp: int = 1,
    optimizer: str = "sgd",
    recompute_first: bool | Sequence[int] = False,
    zero1: bool = False,
) -> Plan:
    """Plan over host ``localhost`` with GPU indices numbered in plan order
    (``recompute_first``: every pipeline's first stage recomputes activations; a
    count per pipeline: its first stage recomputes that many of its first layers,
    ``recompute: N``)."""
    gpus = iter(range(64))

    def first(p: int, st: tuple[int, ...]) -> dict[str, object]:
        if isinstance(recompute_first, bool):
            return {"recompute": recompute_first}
        n = recompute_first[p]
        return {"recompute": True} if n >= st[1] - st[0] else {"recompute_layers": n}

    pipelines = tuple(
        Pipeline(
            num_microbatches=m,
            stages=tuple(
                Stage(
                    layer_start=st[0],
                    layer_end=st[1],
                    gpu_type="cpu",
                    tensor_parallel=(t := st[2] if len(st) > 2 else tp),
                    devices=tuple(Device(host="localhost", gpu=next(gpus)) for _ in range(t)),
                    **(first(p, st) if i == 0 else {}),  # type: ignore[arg-type]
                )
                for i, st in enumerate(stages)
            ),
        )
        for p, (m, stages) in enumerate(layout)
    )
    tp = max(s.tensor_parallel for p in pipelines for s in p.stages)
    total = sum(m for m, _ in layout)
    return Plan(
        name=name,
        version=1,
        model_name="gpt-tiny",
        num_layers=NUM_LAYERS,
        training=TrainingSettings(
            global_batch_size=total * MICRO_BATCH,
            micro_batch_size=MICRO_BATCH,
            seq_len=SEQ_LEN,
            precision="fp32",
            optimizer=optimizer,
            zero1=zero1,
        ),
        tensor_parallel=tp,
        pipelines=pipelines,
    )


@dataclass(frozen=True, slots=True)
class RunResult:
    losses: list[float]
    grad_norms: list[float]
    params: dict[int, dict[str, torch.Tensor]]  # global rank -> full name -> tensor
    layers: dict[int, tuple[int, int]]  # global rank -> its stage's layer range


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _worker_args(plan_path: Path, out: Path, optimizer: str, *, run_dir: bool = False) -> list[str]:
    """Metrics in ``out/metrics.jsonl``: named, or by the launcher's ``--run-dir``."""
    metrics = ("--run-dir", str(out)) if run_dir else ("--metrics", str(out / "metrics.jsonl"))
    return [
        *("-m", "autohet_cli.runtime.train", "--plan", str(plan_path)),
        *("--steps", str(STEPS), "--seed", "7", "--lr", str(LR[optimizer])),
        *(*metrics, "--dump-state", str(out / "state"), "--device", "cpu"),
        *data_flags(),
    ]


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    # No deprecation noise in a user's logs from the APIs we call (torch 2.13 renamed
    # the tensor collectives ZeRO-1 uses and warned on every step).
    assert "FutureWarning" not in proc.stderr, proc.stderr[-4000:]


def run_plan(plan: Plan, tmp: Path) -> RunResult:
    """Run ``plan`` through the worker entry point, one process per rank with torchrun's
    variables (forked from a server that imported torch once: ``zygote``); collect
    metrics and dumped state. One device runs as a plain ``python -m`` process."""
    out = tmp / plan.name
    out.mkdir(parents=True)
    _, path = write_plan(plan, out)
    args = _worker_args(path, out, plan.training.optimizer)
    ranks = run_workers(
        args, len(plan.devices()), env=_env(), cwd=ROOT, logs=out / "logs", timeout_s=TIMEOUT_S
    )
    for code, _stdout, stderr in ranks:
        _check(subprocess.CompletedProcess(args, code, "", stderr), " ".join(args[:2]))
    return collect(out, plan)


def collect(out: Path, plan: Plan, *, clipped: bool = True) -> RunResult:
    """``clipped``: the run trained on ``realdata`` with ``--clip CLIP``, which must act
    at the first step (runs on other data and weights have their own norms)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if "loss" in m]  # steps, not saves
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(m["tokens_per_s"] > 0 for m in metrics)
    if clipped:
        assert metrics[0]["grad_norm"] > CLIP  # clipping acts
    params, layers = {}, {}
    for f in sorted((out / "state").glob("rank*.pt")):
        dump = torch.load(f)
        rank = int(f.stem.removeprefix("rank"))
        params[rank] = dump["params"]
        info = dump["rank_info"]
        stage = plan.pipelines[info["pipeline"]].stages[info["stage"]]
        layers[rank] = (stage.layer_start, stage.layer_end)
    assert sorted(params) == list(range(len(plan.devices())))
    return RunResult(
        losses=[m["loss"] for m in metrics],
        grad_norms=[m["grad_norm"] for m in metrics],
        params=params,
        layers=layers,
    )


def assert_matches(run: RunResult, ref: RunResult, *, adam_lr: float | None = None) -> None:
    """Losses within 1e-5; parameters as the module docstring says; copies bitwise equal."""
    assert run.losses == pytest.approx(ref.losses, rel=1e-5)
    assert run.grad_norms == pytest.approx(ref.grad_norms, rel=1e-5)
    expected = ref.params[0]
    copies: dict[str, torch.Tensor] = {}
    num_elements = num_off = 0
    for rank, params in run.params.items():
        a, b = run.layers[rank]
        # Each rank holds exactly its stage's layers, under the full model's names.
        assert {n for n in expected if a <= int(n.split(".")[1]) < b} == set(params), rank
        for name, value in params.items():
            want = expected[name]
            assert value.shape == want.shape, (rank, name)
            if adam_lr is None:
                err = float((value - want).norm() / want.norm().clamp_min(1e-12))
                assert err <= 1e-5, f"rank {rank} {name}: relative error {err:.2e}"
            else:
                diff = (value - want).abs()
                err = float(diff.max())
                assert err <= 0.5 * adam_lr, f"rank {rank} {name}: error {err:.2e}"
                num_off += int((diff > 0.01 * adam_lr).sum())
                num_elements += diff.numel()
            first = copies.setdefault(name, value)
            assert torch.equal(first, value), f"rank {rank} {name}: copies differ"
    assert num_off <= 1e-4 * num_elements, f"{num_off} of {num_elements} elements off"
    tied = ("layers.0.wte.weight", f"layers.{NUM_LAYERS - 1}.lm_head.weight")
    assert torch.equal(copies[tied[0]], copies[tied[1]])
    assert set(copies) == set(expected)


def _reference(tmp_path_factory: pytest.TempPathFactory, optimizer: str) -> RunResult:
    plan = make_plan(f"reference-{optimizer}", [(8, [(0, NUM_LAYERS)])], optimizer=optimizer)
    return run_plan(plan, tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module")
def reference_sgd(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return _reference(tmp_path_factory, "sgd")


@pytest.fixture(scope="module")
def reference_adam(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return _reference(tmp_path_factory, "adam")


COMBINED: Layout = [(3, [(0, 6)]), (5, [(0, 2), (2, 6)])]

SHAPES: dict[str, tuple[Layout, int]] = {
    # Pure data parallelism with uneven batch shares.
    "dp-uneven": ([(1, [(0, 6)]), (2, [(0, 6)]), (5, [(0, 6)])], 1),
    # Pipelines of 1, 2 and 3 stages with different cuts; the 3-stage one gets a single
    # micro-batch (fewer than its stages), the tied embedding/head spans stages.
    "asymmetric-pipelines": (
        [(5, [(0, 6)]), (2, [(0, 2), (2, 6)]), (1, [(0, 3), (3, 4), (4, 6)])],
        1,
    ),
    # TP 2 inside both stages of one pipeline.
    "tp2": ([(8, [(0, 3), (3, 6)])], 2),
    # All at once: TP 2, a 1-stage and a 2-stage pipeline, 3 and 5 micro-batches.
    "combined": (COMBINED, 2),
    # TP degree per stage: 2 -> 1 in one pipeline, 1 -> 2 -> 1 in the other. Segments
    # [0,2) and [3,4) and the tied embedding/head are held at different degrees (they
    # sync through the full gradient), [2,3) at TP 2 and [4,6) at TP 1 in both.
    "mixed-tp": ([(3, [(0, 3, 2), (3, 6, 1)]), (5, [(0, 2, 1), (2, 4, 2), (4, 6, 1)])], 1),
    # Recomputation in every pipeline's first stage only (see RECOMPUTE): the first
    # 2 of its 3 layers in one pipeline (recompute: 2), all of them in the other.
    "recompute": ([(3, [(0, 3), (3, 6)]), (5, [(0, 2), (2, 4), (4, 6)])], 1),
}
RECOMPUTE = {"recompute": (2, 2)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_plan_shape_matches_single_process(
    shape: str, reference_sgd: RunResult, tmp_path: Path
) -> None:
    layout, tp = SHAPES[shape]
    plan = make_plan(shape, layout, tp=tp, recompute_first=RECOMPUTE.get(shape, False))
    run = run_plan(plan, tmp_path)
    assert_matches(run, reference_sgd)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("shape", ["asymmetric-pipelines", "combined", "mixed-tp"])
def test_zero1_plan_matches_single_process(
    shape: str, reference_sgd: RunResult, tmp_path: Path
) -> None:
    """ZeRO-1 (optimizer state sharded over the pipelines holding a segment): replicas
    that cut layers differently, TP 2, and segments held at two degrees (not sharded)."""
    layout, tp = SHAPES[shape]
    run = run_plan(make_plan(f"zero-{shape}", layout, tp=tp, zero1=True), tmp_path)
    assert_matches(run, reference_sgd)


@pytest.mark.timeout(200)
def test_adamw_zero1_plan_matches_single_process(reference_adam: RunResult, tmp_path: Path) -> None:
    plan = make_plan("zero-adam", COMBINED, tp=2, optimizer="adam", zero1=True)
    assert_matches(run_plan(plan, tmp_path), reference_adam, adam_lr=LR["adam"])


@pytest.mark.timeout(200)
def test_adamw_combined_plan_matches_single_process(
    reference_adam: RunResult, tmp_path: Path
) -> None:
    run = run_plan(make_plan("combined-adam", COMBINED, tp=2, optimizer="adam"), tmp_path)
    assert_matches(run, reference_adam, adam_lr=LR["adam"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(200)
def test_per_host_workers_find_their_plan_devices(reference_sgd: RunResult, tmp_path: Path) -> None:
    """One agent per host numbers ranks host by host; plan order interleaves the hosts.

    Workers get what ``autohet launch`` gives them: ``AUTOHET_HOST`` and ``--run-dir``.
    """
    base = make_plan("two-hosts", [(3, [(0, 3), (3, 6)]), (5, [(0, 3), (3, 6)])])
    # Pipeline i: stage 0 on host a gpu i, stage 1 on host b gpu i.
    plan = replace(
        base,
        pipelines=tuple(
            replace(
                p,
                stages=tuple(
                    replace(s, devices=(Device(host="ab"[j], gpu=i),))
                    for j, s in enumerate(p.stages)
                ),
            )
            for i, p in enumerate(base.pipelines)
        ),
    )
    out = tmp_path / plan.name
    out.mkdir()
    _, path = write_plan(plan, out)
    port = str(_free_port())
    # torchrun-style numbering: host a's two workers are ranks 0-1, host b's 2-3.
    procs = []
    for global_rank, (host, local_rank) in enumerate([("a", 0), ("a", 1), ("b", 0), ("b", 1)]):
        env = _env() | {
            "RANK": str(global_rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(local_rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "AUTOHET_HOST": host,
        }
        cmd = [sys.executable, *_worker_args(path, out, "sgd", run_dir=True)]
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT_S)
            _check(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), "worker")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    run = collect(out, plan)
    # Global ranks 1 and 2 hold the plan's devices 2 and 1.
    assert run.layers == {0: (0, 3), 1: (0, 3), 2: (3, 6), 3: (3, 6)}
    assert_matches(run, reference_sgd)


@pytest.mark.timeout(120)
def test_world_size_must_match_the_plan(tmp_path: Path) -> None:
    plan = make_plan("two-devices", [(8, [(0, 3), (3, 6)])])
    _, path = write_plan(plan, tmp_path)
    cmd = [sys.executable, *_worker_args(path, tmp_path, "sgd")]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert proc.returncode == 1
    assert "has 2 devices but WORLD_SIZE is 1" in proc.stderr
