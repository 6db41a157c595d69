"""torch.compile per block: which layers, when, the flags that decide, the startup line."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from autohet_cli.cli.trainopts import switches
from autohet_cli.runtime.compiling import CompileClock, compile_blocks, wants_compile
from autohet_cli.runtime.startup import StartupClock
from autohet_cli.runtime.train_args import parse_args, train_config


def test_auto_compiles_on_cuda_only_and_the_flags_decide() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert wants_compile("auto", cuda) and not wants_compile("auto", cpu)
    assert wants_compile("on", cpu) and not wants_compile("off", cuda)
    with pytest.raises(ValueError, match="--compile 'yes'"):
        wants_compile("yes", cpu)


def test_worker_flags_reach_the_config() -> None:
    base = ["--plan", "p.yaml", "--steps", "1"]
    assert train_config(parse_args(base)).compile == "auto"
    assert train_config(parse_args([*base, "--no-compile"])).compile == "off"
    assert train_config(parse_args([*base, "--compile", "on"])).compile == "on"
    # launch and recover pass their --no-compile on, after the user's --train-args
    assert switches(["--lr=1"], no_emergency_save=False, no_compile=True) == [
        "--lr=1",
        "--no-compile",
    ]


class Head(nn.Linear):
    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self(x).sum()


def test_the_blocks_are_compiled_in_place_not_the_first_and_last_layers() -> None:
    layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(3, 7)})
    names = set(layers.state_dict())
    done = compile_blocks(layers, num_layers=7)  # this stage holds 3..6; 6 is the model's last
    assert done == [3, 4, 5]
    assert set(layers.state_dict()) == names  # parameter names and checkpoints unchanged
    first = nn.ModuleDict({"0": nn.Embedding(5, 4), "1": nn.Linear(4, 4), "2": Head(4, 4)})
    assert compile_blocks(first, num_layers=9) == [1]  # a layer with its own loss is not


def test_the_startup_line_says_compile_and_its_seconds() -> None:
    said, emitted = [], []
    clock = StartupClock(said.append, emitted.append)

    class Trainer:
        compile_clock = CompileClock()

    Trainer.compile_clock.available, Trainer.compile_clock.seconds = True, 12.5

    class Result:
        step = 0

    clock.on_train_start(Trainer())
    clock.on_step_end(Trainer(), Result())  # type: ignore[arg-type]
    assert "torch.compile on: 12.50 s of the first step" in said[0]
    record = json.loads(emitted[0].split(": ", 1)[1])
    assert record["compiled"] is True and record["compile_s"] == 12.5


def test_the_compile_clock_times_a_real_compilation() -> None:
    clock = CompileClock().start()
    fn = torch.compile(lambda x: torch.sin(x) * 2, backend="eager")
    fn(torch.randn(4))
    assert clock.total_s() is not None and clock.total_s() > 0


def test_only_a_loss_method_is_the_fused_loss() -> None:
    """A layer holding a loss *module* (``self.loss = nn.CrossEntropyLoss()``) keeps
    the runtime's ``loss_fn`` path; the built-in head's ``loss`` method is used."""
    from autohet_cli.runtime.stage import StageModule

    class WithModule(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.loss = nn.CrossEntropyLoss()

    assert StageModule({0: nn.Linear(4, 4), 1: WithModule()}).fused_loss() is None
    stage = StageModule({0: nn.Linear(4, 4), 1: Head(4, 4)})
    assert stage.fused_loss() is not None


def test_a_model_functions_own_loss_keeps_the_built_in_head_unfused() -> None:
    """The built-in head's chunked loss equals the built-in loss_fn only: a model
    function pairing that head with its own loss (label smoothing, z-loss) keeps it."""
    from autohet_cli.models import get_model
    from autohet_cli.runtime.models import build
    from autohet_cli.runtime.stage import StageModule
    from tests.hf_reference import model_request

    spec = get_model("gpt-tiny")
    parts = build(model_request(spec, seq_len=8))
    stage = StageModule(dict(enumerate(parts.layers)))
    assert stage.fused_loss(parts.loss_fn) is not None

    def smoothed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return parts.loss_fn(logits, targets) * 0.9

    assert stage.fused_loss(smoothed) is None


def test_a_missing_toolchain_is_an_error_with_on_and_eager_with_auto(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from autohet_cli.runtime import compiling

    cpu = torch.device("cpu")
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    assert "no C++ compiler" in (compiling.compile_problem(cpu) or "")
    with pytest.raises(ValueError, match=r"--compile on: no C\+\+ compiler"):
        compiling.setup("on", cpu)
    assert compiling.setup("off", cpu) == (False, None)
    assert compiling.setup("auto", cpu) == (False, None)  # auto: CPU runs eagerly anyway


def test_the_clock_stops_counting_once_stopped() -> None:
    clock = CompileClock().start()
    clock.stop()
    torch.compile(lambda x: torch.cos(x) + 1, backend="eager")(torch.randn(3))
    assert clock.seconds == 0.0
