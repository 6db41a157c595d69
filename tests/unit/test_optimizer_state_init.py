"""``ckpt.loading.materialize_state`` makes the optimizer state torch's own initialisation
makes (``_init_optim_state``: a step on zero gradients), without that step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import _init_optim_state, get_state_dict

from autohet_cli.ckpt.loading import materialize_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3, bias=False))
    m[1].bias.requires_grad_(False)  # a frozen parameter gets no state
    return m


def _layout(opt: torch.optim.Optimizer) -> list[tuple[int, str, tuple, torch.dtype, str, type]]:
    index = {id(p): i for g in opt.param_groups for i, p in enumerate(g["params"])}
    out = []
    for p, st in opt.state.items():
        for key, v in st.items():
            out.append((index[id(p)], key, tuple(v.shape), v.dtype, v.device.type, type(v)))
    return sorted(out, key=lambda t: (t[0], t[1]))


@pytest.mark.parametrize(
    "kind,options",
    [
        ("adamw", {}),
        ("adamw", {"fused": True}),
        ("adamw", {"foreach": True}),
        ("adam", {"amsgrad": True}),
    ],
)
def test_the_state_has_torchs_layout_and_no_step_runs(kind: str, options: dict) -> None:
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    ours_model, torch_model = _model(), _model()
    groups = lambda m: [  # noqa: E731
        {"params": [m[0].weight, m[2].weight], "weight_decay": 0.1},
        {"params": [m[0].bias, m[1].weight, m[1].bias], "weight_decay": 0.0},
    ]
    ours, theirs = (
        cls(groups(ours_model), lr=0.1, **options),
        cls(groups(torch_model), lr=0.1, **options),
    )
    _init_optim_state(theirs)
    before = copy.deepcopy(ours_model.state_dict())

    def no_step(*args: object, **kwargs: object) -> None:
        raise AssertionError("materialize_state must not run the optimizer")

    ours.step = no_step  # type: ignore[method-assign]
    assert materialize_state(ours)
    assert _layout(ours) == _layout(theirs)
    for st in ours.state.values():
        assert all(float(v.abs().sum()) == 0.0 for v in st.values())
    # get_state_dict sees the state and runs no step of its own either
    _, osd = get_state_dict(ours_model, ours)
    _, tsd = get_state_dict(torch_model, theirs)
    assert sorted(osd["state"]) == sorted(tsd["state"])
    for name, st in osd["state"].items():
        assert sorted(st) == sorted(tsd["state"][name])
    assert all(torch.equal(v, before[k]) for k, v in ours_model.state_dict().items())
    assert not any(p.grad is not None for p in ours_model.parameters())


def test_an_optimizer_with_state_or_of_another_kind_is_left_alone() -> None:
    m = _model()
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    assert not materialize_state(sgd) and not sgd.state
    adam = torch.optim.AdamW(m.parameters(), lr=0.1)
    _init_optim_state(adam)
    held = {id(p): dict(st) for p, st in adam.state.items()}
    assert not materialize_state(adam)
    assert {id(p): dict(st) for p, st in adam.state.items()} == held
    assert not materialize_state(None)
