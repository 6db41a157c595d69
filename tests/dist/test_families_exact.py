"""The LLaMA family trains exactly like one process under every plan shape.

Like ``test_runtime_exact`` but for tiny HuggingFace models saved with
``save_pretrained``: LLaMA with LLaMA-3.1 rope scaling and grouped-query attention
(untied head) and Qwen2 (q/k/v biases, tied head), each with a vocabulary of 250
that trains padded to 256. Every run starts from the saved weights with
``--init-from``; the plan carries the architecture (no zoo entry exists).

- The single-process reference's step-0 loss equals transformers' loss on the same
  batch (``--init-from`` loads what transformers computes with).
- One plan combines a 2-stage pipeline, TP 2 (heads, kv heads and the padded
  vocabulary split, each rank reading only its shard of the checkpoint) and an
  uneven data-parallel split (3 and 5 micro-batches); after 3 SGD steps its losses
  and every parameter on every rank equal the reference's (1e-5 relative).
- The checkpoint that plan wrote, through ``autohet export``, loads in transformers
  with the reference model's logits.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from zygote import run_workers

from autohet_cli.hfconfig import load_hf_config
from autohet_cli.models import ModelSpec
from autohet_cli.plan import Plan, write_plan
from autohet_cli.runtime.data import SyntheticCorpus
from autohet_cli.runtime.model_api import ModelRequest, local_layers
from autohet_cli.runtime.models import build
from autohet_cli.runtime.stage import StageModule
from tests.dist.test_runtime_exact import STEPS, TIMEOUT_S, RunResult, _check, _env, collect
from tests.hf_reference import SEQ_LEN, VOCAB, model_request, save_random_model, worst_relative
from tests.planting import plan_of, stage

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
MICRO_BATCH = 2
LR = 0.05
Layout = list[tuple[int, list[tuple[int, int]]]]


def make_plan(name: str, spec: ModelSpec, layout: Layout, tp: int = 1) -> Plan:
    gpus = iter(range(64))
    return plan_of(
        *(
            [stage(a, b, "localhost", *(next(gpus) for _ in range(tp))) for a, b in stages]
            for _, stages in layout
        ),
        microbatches=[m for m, _ in layout],
        micro_batch_size=MICRO_BATCH,
        seq_len=SEQ_LEN,
        precision="fp32",
        optimizer="sgd",
        model=spec,
        name=name,
    )


def run(
    plan: Plan, weights: Path, tmp: Path, *, torchrun: bool, extra: tuple[str, ...] = ()
) -> RunResult:
    out = tmp / plan.name
    out.mkdir(parents=True)
    _, path = write_plan(plan, out)
    args = [
        *("-m", "autohet_cli.runtime.train", "--plan", str(path), "--steps", str(STEPS)),
        *("--lr", str(LR), "--init-from", str(weights), "--device", "cpu"),
        *("--metrics", str(out / "metrics.jsonl"), "--dump-state", str(out / "state")),
        *extra,
    ]
    # One process per rank with torchrun's variables, forked from a server that imported
    # torch once (``zygote``); ``torchrun=False``: one plain process.
    n = len(plan.devices()) if torchrun else 1
    for code, _stdout, stderr in run_workers(args, n, env=_env(), cwd=ROOT, timeout_s=TIMEOUT_S):
        _check(subprocess.CompletedProcess(args, code, "", stderr), plan.name)
    return collect(out, plan, clipped=False)  # transformers' weights, synthetic tokens


def transformers_loss(model: object, batch_size: int) -> float:
    inputs, targets = SyntheticCorpus(vocab_size=VOCAB, seq_len=SEQ_LEN, seed=0).global_batch(
        0, batch_size
    )
    with torch.no_grad():
        logits = model(inputs).logits  # type: ignore[operator]
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_combined_plan_from_hf_weights_matches_one_process(family: str, tmp_path: Path) -> None:
    weights = tmp_path / "hf"
    model = save_random_model(family, weights)
    spec = load_hf_config(str(weights / "config.json"))
    n = spec.num_layers  # embedding, 2 blocks, final norm, head
    ref = run(make_plan("reference", spec, [(8, [(0, n)])]), weights, tmp_path, torchrun=False)
    assert ref.losses[0] == pytest.approx(transformers_loss(model, 8 * MICRO_BATCH), rel=1e-5)
    combined = make_plan("combined", spec, [(3, [(0, n)]), (5, [(0, 2), (2, n)])], tp=2)
    checkpoints = ("--checkpoint-every", "3", "--checkpoint-dir", str(tmp_path / "ckpt"))
    got = run(
        combined, weights, tmp_path, torchrun=True, extra=(*checkpoints, "--remote-storage", "none")
    )
    assert got.losses == pytest.approx(ref.losses, rel=1e-5)
    expected = ref.params[0]
    copies: dict[str, torch.Tensor] = {}
    for rank, params in got.params.items():
        a, b = got.layers[rank]
        assert {k for k in expected if a <= int(k.split(".")[1]) < b} == set(params), rank
        for name, value in params.items():
            err = float((value - expected[name]).norm() / expected[name].norm().clamp_min(1e-12))
            assert err <= 1e-5, f"rank {rank} {name}: relative error {err:.2e}"
            assert torch.equal(copies.setdefault(name, value), value), f"{name}: copies differ"
    assert set(copies) == set(expected)
    # The checkpoint the combined plan wrote, exported, is the reference model in transformers.
    step_dir = next((tmp_path / "ckpt" / "combined").glob(f"*/step-{STEPS:08d}"))  # <job>/step
    exported = export(step_dir, tmp_path)
    reference = StageModule(local_layers(build(request(spec)), request(spec)))
    reference.load_state_dict(expected)
    inputs = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = reference(inputs)[..., :VOCAB]
        assert worst_relative(exported(inputs).logits, ours) <= 1e-5


def request(spec: ModelSpec) -> ModelRequest:
    return model_request(spec, seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH)


def export(step_dir: Path, tmp: Path) -> object:
    """``autohet export`` (the plan found by name under plans/), loaded by transformers."""
    from transformers import AutoModelForCausalLM

    plans = tmp / "plans"
    plans.mkdir()
    for f in (tmp / "combined").glob("combined.v*.yaml"):
        (plans / f.name).write_text(f.read_text())
    cmd = [sys.executable, "-m", "autohet_cli", "export", str(step_dir), "--format", "hf"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp / "exported"), "--max-shard-size", "50KB"],
        cwd=tmp,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    _check(proc, "autohet export")
    assert (tmp / "exported" / "model.safetensors.index.json").is_file()
    return AutoModelForCausalLM.from_pretrained(tmp / "exported").eval()
