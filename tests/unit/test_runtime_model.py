"""The built-in GPT, the synthetic data and the 1F1B loop in one process (no process group)."""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autohet_cli.models import get_model
from autohet_cli.plan import Device
from autohet_cli.runtime.data import SyntheticCorpus
from autohet_cli.runtime.gpt import build, lm_loss
from autohet_cli.runtime.model_api import (
    ModelParts,
    ModelRequest,
    layer_of,
    load_model_fn,
    local_layers,
)
from autohet_cli.runtime.pipeline import PipelineSchedule, autocast_contexts
from autohet_cli.runtime.stage import StageModule, tie_parameters
from autohet_cli.runtime.topology import RankInfo, one_f_one_b


def request(name: str, start: int, end: int, seed: int = 0, seq_len: int = 16) -> ModelRequest:
    spec = get_model(name)
    return ModelRequest(
        model_name=name,
        num_layers=spec.num_layers,
        layer_start=start,
        layer_end=end,
        seed=seed,
        seq_len=seq_len,
        micro_batch_size=2,
    )


def stage_of(name: str, start: int, end: int, seed: int = 0) -> tuple[StageModule, ModelParts]:
    req = request(name, start, end, seed)
    parts = build(req)
    stage = StageModule(local_layers(parts, req))
    tie_parameters(stage, parts.tied)
    return stage, parts


def test_weights_do_not_depend_on_the_partition() -> None:
    whole = stage_of("gpt-tiny", 0, 6)[0].state_dict()
    pieces: dict[str, torch.Tensor] = {}
    for a, b in [(0, 2), (2, 3), (3, 6)]:
        pieces.update(stage_of("gpt-tiny", a, b)[0].state_dict())
    assert pieces.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(pieces[name], value), name
    other_seed = stage_of("gpt-tiny", 0, 6, seed=1)[0].state_dict()
    assert not torch.equal(other_seed["layers.1.mlp.fc.weight"], whole["layers.1.mlp.fc.weight"])


def test_head_alone_starts_with_the_embedding_weights() -> None:
    embedding = stage_of("gpt-tiny", 0, 1)[0].state_dict()["layers.0.wte.weight"]
    head = stage_of("gpt-tiny", 5, 6)[0].state_dict()["layers.5.lm_head.weight"]
    assert torch.equal(embedding, head)
    both = stage_of("gpt-tiny", 0, 6)[0]
    assert both.layers["0"].wte.weight is both.layers["5"].lm_head.weight


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small"])
def test_layers_match_the_model_spec(name: str) -> None:
    spec = get_model(name)
    parts = build(request(name, 0, spec.num_layers))
    assert len(parts.layers) == spec.num_layers == len(spec.layers())
    for layer, layer_spec in zip(parts.layers, spec.layers(), strict=True):
        count = sum(p.numel() for p in layer.parameters())
        assert count == layer_spec.num_params, layer_spec.name


def test_stage_forward_and_loss() -> None:
    stage, parts = stage_of("gpt-tiny", 0, 6)
    corpus = SyntheticCorpus(vocab_size=parts.vocab_size, seq_len=16, seed=0)
    inputs, targets = corpus.global_batch(0, 4)
    logits = stage(inputs)
    assert logits.shape == (4, 16, 256)
    loss = lm_loss(logits, targets) / 4
    assert loss.item() == pytest.approx(math.log(256), rel=0.02)  # untrained: near uniform


def test_frozen_key_bias_and_everything_else_trains() -> None:
    stage, _ = stage_of("gpt-tiny", 0, 6)
    frozen = [n for n, p in stage.named_parameters() if not p.requires_grad]
    assert frozen == [f"layers.{i}.attn.k_proj.bias" for i in range(1, 5)]


def test_unsupported_model_points_to_model_fn() -> None:
    with pytest.raises(ValueError, match="not 'opt'.*--model-fn"):
        build(request("OPT-30B", 0, 1, seq_len=16))
    with pytest.raises(ValueError, match="seq_len 100"):
        build(request("gpt-tiny", 0, 1, seq_len=100))
    with pytest.raises(ValueError, match="num_kv_heads 8 is not divisible by tensor_parallel 16"):
        build(replace(request("LLaMA-3-8B", 0, 1, seq_len=16), tensor_parallel=16))


def test_data_depends_only_on_seed_and_step() -> None:
    a = SyntheticCorpus(vocab_size=256, seq_len=16, seed=3)
    b = SyntheticCorpus(vocab_size=256, seq_len=16, seed=3)
    x0, y0 = a.global_batch(5, 8)
    assert torch.equal(x0, b.global_batch(5, 8)[0])
    assert not torch.equal(x0, a.global_batch(6, 8)[0])
    assert torch.equal(x0[:, 1:], y0[:, :-1])  # targets are the inputs shifted by one
    assert 0 <= int(x0.min()) and int(x0.max()) < 256
    share = a.microbatches(5, batch_size=8, sample_range=(2, 8), micro_batch_size=2)
    assert [tuple(mb[0].shape) for mb in share] == [(2, 16)] * 3
    assert torch.equal(torch.cat([mb[0] for mb in share]), x0[2:8])


def test_model_fn_loading_and_layer_lists() -> None:
    assert load_model_fn("autohet_cli.runtime.gpt:build") is build
    for bad, match in [
        ("autohet_cli.runtime.gpt", "package.module:function"),
        ("no_such_module_xyz:f", "cannot import"),
        ("autohet_cli.runtime.gpt:nope", "no function 'nope'"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_model_fn(bad)
    req = request("gpt-tiny", 2, 4)
    full = ModelParts(layers=[torch.nn.Identity() for _ in range(6)], loss_fn=lm_loss, vocab_size=2)
    assert list(local_layers(full, req)) == [2, 3]
    short = ModelParts(layers=[torch.nn.Identity()] * 2, loss_fn=lm_loss, vocab_size=2)
    assert list(local_layers(short, req)) == [2, 3]
    with pytest.raises(ValueError, match="returned 3 layers"):
        local_layers(
            ModelParts(layers=[torch.nn.Identity()] * 3, loss_fn=lm_loss, vocab_size=2), req
        )
    assert layer_of("layers.12.attn.q_proj.weight") == 12


class FakeP2P:
    """Stands in for the neighbours: receives zeros, drops what is sent."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape)

    def recv_forward(self) -> torch.Tensor:
        return self._zeros()

    def recv_backward(self) -> torch.Tensor:
        return self._zeros()

    def send_forward(self, t: Any) -> None:
        pass

    def send_backward(self, t: Any) -> None:
        pass

    def send_forward_recv_backward(self, t: Any) -> torch.Tensor:
        return self._zeros()

    def send_backward_recv_forward(self, t: Any) -> torch.Tensor:
        return self._zeros()


@pytest.mark.parametrize(
    ("num_stages", "stage_index", "m"), [(1, 0, 4), (3, 0, 5), (3, 1, 2), (3, 2, 2), (4, 0, 1)]
)
def test_schedule_loop_follows_one_f_one_b(num_stages: int, stage_index: int, m: int) -> None:
    first, last = stage_index == 0, stage_index == num_stages - 1
    layers = {(True, True): (0, 6), (True, False): (0, 2), (False, False): (2, 4)}.get(
        (first, last), (4, 6)
    )
    stage, parts = stage_of("gpt-tiny", *layers)
    schedule = _schedule(stage, parts, num_stages, stage_index, layers, m)
    schedule.run(_batches(m))
    assert schedule.trace == one_f_one_b(num_stages, stage_index, m)


def _schedule(
    stage: StageModule,
    parts: ModelParts,
    num_stages: int,
    stage_index: int,
    layers: tuple[int, int],
    m: int,
    **contexts: Any,
) -> PipelineSchedule:
    """The 1F1B loop of one stage of pipeline 0, its neighbours faked."""
    info = RankInfo(
        rank=0,
        pipeline=0,
        stage=stage_index,
        tp_rank=0,
        num_stages=num_stages,
        tp_size=1,
        layer_start=layers[0],
        layer_end=layers[1],
        num_microbatches=m,
        device=Device(host="localhost", gpu=0),
    )
    return PipelineSchedule(
        stage=stage,
        info=info,
        p2p=FakeP2P((2, 16, 64)),  # type: ignore[arg-type]
        loss_fn=parts.loss_fn,
        global_batch_size=2 * m,
        device=torch.device("cpu"),
        **contexts,
    )


def _batches(m: int) -> list[Any]:
    corpus = SyntheticCorpus(vocab_size=256, seq_len=16, seed=0)
    return corpus.microbatches(0, batch_size=2 * m, sample_range=(0, 2 * m), micro_batch_size=2)


def _bf16_run(cast_once: bool) -> tuple[dict[str, torch.Tensor], int, int]:
    """Stage 0 of 3 (3 micro-batches in flight) under bf16 autocast on the CPU: its
    gradients, the distinct 16-bit weight copies autograd kept, and the weights."""
    stage, parts = stage_of("gpt-tiny", 0, 2)
    m = 4
    schedule = _schedule(
        stage,
        parts,
        3,
        0,
        (0, 2),
        m,
        autocast=lambda: autocast_contexts("cpu", torch.bfloat16, recompute=False)[0],
        cast_once=(lambda: autocast_contexts("cpu", torch.bfloat16, recompute=False)[1])
        if cast_once
        else contextlib.nullcontext,
    )
    weights = {tuple(p.shape) for p in stage.parameters() if p.ndim == 2}
    copies: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bfloat16 and tuple(t.shape) in weights:
            copies.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        schedule.run(_batches(m))
    grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    # every matrix but the embedding's (layer 0: a lookup, not cast)
    cast = sum(1 for n, p in stage.named_parameters() if p.ndim == 2 and layer_of(n) != 0)
    return grads, len(copies), cast


def test_one_weight_copy_per_step_under_autocast_with_the_same_gradients() -> None:
    """The runtime's step shares autocast's 16-bit weight copies among micro-batches
    (``PipelineSchedule.run``'s ``cast_once``): one copy per weight instead of one
    per micro-batch in flight, and bit-for-bit the same gradients."""
    once, n_once, weights = _bf16_run(cast_once=True)
    each, n_each, _ = _bf16_run(cast_once=False)
    assert once.keys() == each.keys() and once
    for name in once:
        assert torch.equal(once[name], each[name]), name
    assert n_once == weights  # one copy of each cast weight, shared
    assert n_each >= 3 * n_once  # three micro-batches in flight each kept their own


class _Casts(TorchDispatchMode):
    """Weak references to the 16-bit matrices cast while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            func is torch.ops.aten._to_copy.default
            and out.dtype == torch.bfloat16
            and out.ndim == 2
        ):
            self.refs.append(weakref.ref(out))
        return out


def test_a_recompute_stage_forward_keeps_no_weight_copy() -> None:
    """A recompute stage runs autocast without its cache: its checkpointed forward
    frees each cast weight after use (with the cache every layer's copy stayed
    until the forward's context exited: the whole stage's weights at once)."""
    stage, _ = stage_of("gpt-tiny", 1, 5)
    stage.recompute = True
    x = torch.randn(2, 16, 64, requires_grad=True)
    alive = {}
    for recompute in (True, False):
        mode = _Casts()
        forward, _ = autocast_contexts("cpu", torch.bfloat16, recompute=recompute)
        with mode, forward:
            stage(x)
            alive[recompute] = sum(1 for r in mode.refs if r() is not None)
        assert mode.refs  # weights were cast
    assert alive[True] == 0 and alive[False] > 0
    assert autocast_contexts("cpu", torch.float32, recompute=False)[0].__class__ is (
        contextlib.nullcontext
    )
