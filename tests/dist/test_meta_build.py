"""A stage built on the meta device under TP 2 (gloo, two processes) equals the
normally built one: initialised as a fresh run, loaded from a checkpoint, and
initialised when a resume finds none (also under ZeRO-1, whose slices view the
parameters).

The normal build is the model function run on the CPU (``ModelRequest.on_meta``
False) and sliced by ``parallelize_module``; the meta build parallelises meta
layers, allocates the DTensor shards on the device and fills them in place
(``tests/unit/test_runtime_meta_build.py`` checks the one-process cases). gpt-tiny
has what can go wrong: a tied embedding and head split over the vocabulary, and a
frozen key bias that TP would make trainable again.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from test_runtime_exact import NUM_LAYERS, _free_port, make_plan

from autohet_cli.ckpt.checkpointer import Checkpointer
from autohet_cli.runtime.stage import local_tensor
from autohet_cli.runtime.trainer import TrainConfig, Trainer
from tests.unit.test_runtime_meta_build import cpu_build

pytestmark = pytest.mark.dist

CONFIG = TrainConfig(seed=3, device="cpu", decay_steps=3)
PLAN = make_plan("meta", [(2, [(0, NUM_LAYERS)])], tp=2, optimizer="adam")
ZERO_PLAN = make_plan("zero", [(1, [(0, NUM_LAYERS)])] * 2, optimizer="adam", zero1=True)
TIED = ("0", "wte"), (str(NUM_LAYERS - 1), "lm_head")


def _params(trainer: Trainer) -> dict[str, Any]:
    """This rank's shards of the parameters (and buffers)."""
    return {k: local_tensor(v).detach().clone() for k, v in trainer.stage.state_dict().items()}


def _local(trainer: Trainer) -> dict[str, Any]:
    """The parameters and the (flat) optimizer state, once the optimizer has one
    (``state_dict`` makes one by a step of learning rate 0 otherwise)."""
    state = trainer.state_dict(flat_optimizer=True)
    optimizer = {
        f"optimizer.{k}": local_tensor(v).detach().clone() if isinstance(v, torch.Tensor) else v
        for k, v in state["optimizer"].items()
    }
    return _params(trainer) | optimizer


def _differ(what: str, got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    if got.keys() != want.keys():
        return [f"{what}: entries {sorted(got.keys() ^ want.keys())} in one only"]
    return [
        f"{what}: {k}"
        for k, v in want.items()
        if not (torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v)
    ]


def _layout(what: str, trainer: Trainer, like: Trainer) -> list[str]:
    """One Parameter per tied group, the same frozen names and DTensor placements."""
    layers = trainer.stage.layers
    (a, an), (b, bn) = TIED
    problems = []
    if getattr(layers[a], an).weight is not getattr(layers[b], bn).weight:
        problems.append(f"{what}: the tied embedding and head are two Parameters")

    def shapes(t: Trainer) -> dict[str, tuple[object, ...]]:
        return {
            n: (p.requires_grad, tuple(getattr(p, "placements", ())), p.device.type)
            for n, p in t.stage.named_parameters()
        }

    if shapes(trainer) != shapes(like):
        problems.append(f"{what}: parameters laid out unlike the normal build's")
    frozen = [n for n, p in trainer.stage.named_parameters() if not p.requires_grad]
    if frozen != [f"layers.{i}.attn.k_proj.bias" for i in range(1, NUM_LAYERS - 1)]:
        problems.append(f"{what}: frozen {frozen}")
    return problems


def _check(root: Path) -> list[str]:
    normal = Trainer(PLAN, CONFIG, model_fn=cpu_build)
    fresh = Trainer(PLAN, CONFIG)
    problems = _differ("fresh", _params(fresh), _params(normal))
    problems += _layout("fresh", fresh, normal)

    normal.fit(2)
    ckpt = Checkpointer(normal, root=root, plan_ref="meta.v1", plan_sha256="a" * 64, job="j")
    ckpt.save()
    ckpt.close()
    resumed = Trainer(PLAN, CONFIG, defer_init=True)
    loader = Checkpointer(resumed, root=root, plan_ref="meta.v1", plan_sha256="a" * 64, job="j")
    if loader.resume() != 2:
        problems.append("the saved step was not found")
    problems += _differ("resumed", _local(resumed), _local(normal))
    problems += _layout("resumed", resumed, normal)
    normal.fit(1)
    resumed.fit(1)
    problems += _differ("resumed, one step on", _local(resumed), _local(normal))

    nothing = Trainer(PLAN, CONFIG, defer_init=True)
    empty = Checkpointer(nothing, root=root, plan_ref="meta.v1", plan_sha256="a" * 64, job="e")
    if empty.resume() is not None:
        problems.append("an empty job resumed")
    nothing.fit(1)
    fresh.fit(1)
    problems += _differ("no checkpoint, one step on", _params(nothing), _params(fresh))
    return problems + _check_zero(root)


def _check_zero(root: Path) -> list[str]:
    """ZeRO-1 steps slices that view the parameters' storage, made before a deferred
    initialisation writes there: they must see the values it writes."""
    fresh = Trainer(ZERO_PLAN, CONFIG)
    nothing = Trainer(ZERO_PLAN, CONFIG, defer_init=True)
    ckpt = Checkpointer(nothing, root=root, plan_ref="zero.v1", plan_sha256="a" * 64, job="e")
    problems = [] if ckpt.resume() is None else ["an empty job resumed (ZeRO-1)"]
    assert nothing.zero is not None
    fresh.fit(2)
    nothing.fit(2)
    problems += _differ("ZeRO-1, no checkpoint", _params(nothing), _params(fresh))
    fresh.close()  # the one process group every trainer here shares
    return problems


def _rank(rank: int, port: int, root: str, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        queue.put((rank, _check(Path(root))))
    except BaseException:
        queue.put((rank, [traceback.format_exc()]))


@pytest.mark.timeout(240)
def test_a_tp_stage_built_on_meta_equals_the_normal_build(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=200) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == {0: [], 1: []}
