"""The step loop in one process: hooks, metrics, and the state seam resuming exactly."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from autohet_cli.runtime.trainer import Hook, MetricsHook, StepResult, TrainConfig, Trainer
from tests.planting import plan_of, stage

PLAN = plan_of(
    [stage(0, 6, "localhost")], name="one", precision="fp32", micro_batch_size=2, seq_len=16
)
CONFIG = TrainConfig(seed=3, device="cpu", decay_steps=3)  # fit(2)+fit(1) == fit(3)


pytestmark = pytest.mark.usefixtures("alone")


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.stage.state_dict().items()}


class Recorder(Hook):
    def __init__(self) -> None:
        self.events: list[str] = []

    def on_train_start(self, trainer: Trainer) -> None:
        self.events.append("start")

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        self.events.append(f"begin {step}")

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self.events.append(f"end {result.step}")

    def on_train_end(self, trainer: Trainer) -> None:
        self.events.append("stop")


def test_hooks_and_metrics(tmp_path: Path) -> None:
    recorder = Recorder()
    metrics = tmp_path / "m.jsonl"
    trainer = Trainer(PLAN, CONFIG, hooks=[recorder, MetricsHook(metrics, echo=False)])
    results = trainer.fit(2)
    assert recorder.events == ["start", "begin 0", "end 0", "begin 1", "end 1", "stop"]
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1]
    assert lines[0]["loss"] == pytest.approx(results[0].loss)
    assert lines[0]["tokens"] == 4 * 16 and lines[0]["tokens_per_s"] > 0
    assert trainer.step == 2


def test_state_dict_resumes_exactly() -> None:
    straight = Trainer(PLAN, CONFIG)
    straight.fit(3)
    want = params(straight)

    first = Trainer(PLAN, CONFIG)
    first.fit(2)
    state = copy.deepcopy(first.state_dict())
    assert "layers.1.attn.q_proj.weight" in state["model"]
    assert "layers.1.attn.q_proj.weight" in state["optimizer"]["state"]

    resumed = Trainer(PLAN, CONFIG)
    resumed.load_state_dict(state)
    assert resumed.step == 2
    resumed.fit(1)
    got = params(resumed)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
