"""The training loop against torch's own tools, in one process, on real text.

The trainer's clipping (a hand-written global norm, ``runtime.optim``) and its
learning-rate schedule (a pure function of the step) must do what
``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.lr_scheduler`` do. The
reference below trains the same model on the same batches with plain torch:
AdamW over the same decay / no-decay groups, ``clip_grad_norm_``, and
``LinearLR`` warmup chained to ``CosineAnnealingLR`` (or ``LambdaLR`` for the
linear decay), then the parameters and the reported norms are compared. The
distributed exactness tests (tests/dist) tie every plan shape to this one process.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_runtime_trainer import PLAN

from autohet_cli.plan import Plan
from autohet_cli.runtime.hooks import Hook
from autohet_cli.runtime.metrics import StepResult
from autohet_cli.runtime.optim import LRSchedule
from autohet_cli.runtime.trainer import TrainConfig, Trainer
from autohet_cli.settings import TrainingSettings

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "autohet_cli" / "data" / "sample" / "corpus.txt"
STEPS, WARMUP, LR, MIN_LR, CLIP = 6, 2, 3e-3, 3e-4, 0.25


def _plan() -> Plan:
    """test_runtime_trainer's one-device gpt-tiny plan, with longer samples."""
    return replace(
        PLAN,
        training=TrainingSettings(
            global_batch_size=4, micro_batch_size=2, seq_len=32, precision="fp32", optimizer="adam"
        ),
    )


pytestmark = pytest.mark.usefixtures("alone")


@pytest.fixture(scope="module")
def text_tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample corpus, one token per byte (gpt-tiny's vocabulary is 256)."""
    path = tmp_path_factory.mktemp("data") / "bytes.npy"
    np.save(path, np.frombuffer(CORPUS.read_bytes(), dtype=np.uint8).astype(np.uint16))
    return path


def _config(data: Path, style: str) -> TrainConfig:
    return TrainConfig(
        seed=5,
        device="cpu",
        lr=LR,
        min_lr=MIN_LR,
        warmup_steps=WARMUP,
        decay_steps=STEPS,
        lr_schedule=style,
        grad_clip=CLIP,
        data=str(data),
    )


def _torch_scheduler(
    opt: torch.optim.Optimizer, style: str
) -> torch.optim.lr_scheduler.LRScheduler:
    warm = torch.optim.lr_scheduler.LinearLR(
        opt, start_factor=1 / WARMUP, end_factor=1.0, total_iters=WARMUP - 1
    )
    if style == "cosine":
        decay: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=STEPS - WARMUP, eta_min=MIN_LR
        )
    else:
        decay = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: 1 - t / (STEPS - WARMUP) * (1 - MIN_LR / LR)
        )
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[WARMUP])


def _reference(trainer: Trainer, style: str) -> tuple[list[float], list[float]]:
    """Train ``trainer``'s model and data with plain torch; (grad norms, lrs)."""
    stage, plan = trainer.stage, trainer.plan
    t = plan.training
    decay = [p for p in stage.parameters() if p.ndim >= 2]
    no_decay = [p for p in stage.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
    )
    sched = _torch_scheduler(opt, style)
    norms, lrs = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        inputs, targets = trainer.data.global_batch(step, t.global_batch_size)  # type: ignore[attr-defined]
        for i in range(0, t.global_batch_size, t.micro_batch_size):
            out = stage(inputs[i : i + t.micro_batch_size])
            loss = trainer.parts.loss_fn(out, targets[i : i + t.micro_batch_size])
            (loss / t.global_batch_size).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(stage.parameters(), CLIP)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return norms, lrs


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_clipping_and_schedule_equal_torch_on_one_process(text_tokens: Path, style: str) -> None:
    trainer = Trainer(_plan(), _config(text_tokens, style))
    results = trainer.fit(STEPS)
    got = {k: v.detach().clone() for k, v in trainer.stage.state_dict().items()}
    trainer.close()

    ref = Trainer(_plan(), _config(text_tokens, style))  # same initial weights and data
    norms, lrs = _reference(ref, style)
    want = ref.stage.state_dict()

    assert [r.lr for r in results] == pytest.approx(lrs, rel=1e-12)
    assert [r.grad_norm for r in results] == pytest.approx(norms, rel=1e-5)
    assert all(n > CLIP for n in norms)  # clipping acted at every step
    for name, value in want.items():
        err = float((got[name] - value).norm() / value.norm().clamp_min(1e-12))
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
    ref.close()


def test_schedule_shape() -> None:
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14, style="cosine")
    assert [s.at(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.at(4) == 1.0 and s.at(9) == pytest.approx(0.55) and s.at(14) == 0.1
    assert s.at(10_000) == 0.1
    lin = LRSchedule(lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=10, style="linear")
    assert [lin.at(i) for i in (0, 5, 10)] == [1.0, 0.5, 0.0]
    const = LRSchedule(lr=2.0, min_lr=0.0, warmup_steps=2, decay_steps=10, style="constant")
    assert [const.at(i) for i in (0, 1, 2, 50)] == [1.0, 2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="min_lr"):
        LRSchedule(lr=1.0, min_lr=2.0, warmup_steps=0, decay_steps=1)
    assert math.isclose(s.at(13), 0.1 + 0.45 * (1 + math.cos(math.pi * 0.9)))


def test_a_resumed_run_keeps_its_decay_and_past_its_end_extends_it_as_told(
    text_tokens: Path,
) -> None:
    """Issue 46: extending a finished run trained every new step at min_lr, silently.
    Past the decay end, --lr-extend re-plans it (runtime.lr_schedule); the re-plan
    travels in the checkpoints, so the extended run resumes exactly too."""
    import copy

    config = TrainConfig(seed=5, device="cpu", lr=LR, min_lr=MIN_LR, data=str(text_tokens))
    first = Trainer(_plan(), config)
    first.fit(2)  # a run to step 2: its cosine ends there
    state = copy.deepcopy(first.state_dict())
    first.close()

    def resume(how: str, steps: int = 2, **kw: object) -> tuple[Trainer, list[float]]:
        trainer = Trainer(_plan(), TrainConfig(**{**_kw(config), "lr_extend": how, **kw}))
        trainer.load_state_dict(copy.deepcopy(state))
        lrs = [r.lr for r in trainer.fit(steps)]  # asked for step 2 + steps
        return trainer, lrs

    kept, lrs = resume("continue")  # the old end: min_lr from there on
    assert kept.lr_schedule.decay_steps == 2 and lrs == [MIN_LR, MIN_LR]
    kept.close()
    redecay, lrs = resume("redecay")  # from the rate at step 2, which is min_lr already
    assert lrs == pytest.approx([MIN_LR, MIN_LR], rel=1e-12)
    assert (redecay.lr_schedule.decay_steps, redecay.lr_schedule.restart_step) == (4, 2)
    redecay.close()
    rewarm, lrs = resume("rewarm")  # no warmup configured: back to --lr, then decay to 4
    assert lrs[0] == pytest.approx(LR, rel=1e-12) and MIN_LR < lrs[1] < LR
    rewarm.close()
    # Interrupted after step 2 (a preemption) and resumed to the same end: the same rates.
    part = Trainer(_plan(), TrainConfig(**{**_kw(config), "lr_extend": "rewarm"}))
    part.load_state_dict(copy.deepcopy(state))
    part.hooks.append(_StopAfterOneStep())
    part.fit(2)
    assert part.step == 3
    saved = copy.deepcopy(part.state_dict())
    part.close()
    again = Trainer(_plan(), TrainConfig(**{**_kw(config), "lr_extend": "continue"}))
    again.load_state_dict(saved)
    assert [r.lr for r in again.fit(1)] == [lrs[1]]
    again.close()
    explicit, _ = resume("redecay", steps=1, decay_steps=4)
    assert explicit.lr_schedule.at(2) > MIN_LR  # --decay-steps given: it wins
    explicit.close()


class _StopAfterOneStep(Hook):
    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        trainer.stop_reason = "preempted"


def _kw(config: TrainConfig) -> dict[str, object]:
    return {f: getattr(config, f) for f in config.__slots__}


def test_eval_runs_between_steps_on_fixed_batches_in_eval_mode(
    text_tokens: Path, tmp_path: Path
) -> None:
    import json

    from autohet_cli.runtime.hooks import MetricsHook

    config = TrainConfig(seed=5, device="cpu", data=str(text_tokens), eval_every=2, eval_batches=2)
    metrics = tmp_path / "m.jsonl"
    trainer = Trainer(_plan(), config, hooks=[MetricsHook(metrics, echo=False)])
    trainer.fit(4)
    assert trainer.stage.training  # back in train mode
    first, again = trainer.evaluate(), trainer.evaluate()
    trainer.close()
    assert first == again  # the same validation batches every time
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    evals = [x for x in lines if "eval_loss" in x]
    assert [x["step"] for x in evals] == [0, 2, 3]  # every 2 steps and after the last
    assert all("loss" not in x for x in evals)
    assert [x["step"] for x in lines if "loss" in x] == [0, 1, 2, 3]
    assert evals[-1]["eval_loss"] == first


def test_a_tied_weight_counts_once_whatever_order_its_group_names() -> None:
    from torch import nn

    from autohet_cli.runtime.optim import counted_parameters
    from autohet_cli.runtime.stage import StageModule, tie_parameters

    layers = {0: nn.Linear(3, 3, bias=False), 1: nn.Linear(3, 3, bias=False)}
    for order in (
        [("layers.0.weight", "layers.1.weight")],
        [("layers.1.weight", "layers.0.weight")],  # a --model-fn listing the head first
    ):
        stage = StageModule(dict(layers))
        tie_parameters(stage, order)
        got = counted_parameters(stage, pipeline=0, tp_rank=0, tied=order)
        assert len(got) == 1 and got[0] is stage.layers["0"].weight
        # A stage holding only the non-first name of the group counts nothing for it.
        only = StageModule({1 if order[0][0].startswith("layers.0") else 0: nn.Linear(3, 3)})
        assert all(p.ndim < 2 for p in counted_parameters(only, pipeline=0, tp_rank=0, tied=order))
