"""The runtime recomputes what the plan says: every layer, or the first N (issue 48)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autohet_cli.runtime.stage import StageModule


class Counting(nn.Module):
    """A layer that counts its forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("first", [0, 1, 2, 3])
def test_the_first_n_layers_run_their_forward_again_in_the_backward(first: int) -> None:
    torch.manual_seed(0)
    layers = {i: Counting() for i in (4, 5, 6)}  # a stage holding layers 4..6
    stage = StageModule(dict(layers), recompute_first=first)
    plain = StageModule({i: layers[i] for i in layers})
    x = torch.randn(2, 4, requires_grad=True)
    stage(x).sum().backward()
    grads = [p.grad.clone() for p in stage.parameters()]
    assert [layers[i].calls for i in (4, 5, 6)] == [2 if k < first else 1 for k in range(3)]
    assert stage.recompute == (first > 0)
    for p in stage.parameters():
        p.grad = None
    plain(x).sum().backward()  # the same gradients, recomputed or not
    for g, p in zip(grads, plain.parameters(), strict=True):
        assert torch.equal(g, p.grad)
    with torch.no_grad():  # evaluation never recomputes
        before = [layers[i].calls for i in (4, 5, 6)]
        stage(x)
        assert [layers[i].calls - b for i, b in zip((4, 5, 6), before, strict=True)] == [1, 1, 1]
