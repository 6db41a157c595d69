"""This rank's part of the model, named like the whole model.

``StageModule`` holds the rank's layers in ``self.layers``, an ``nn.ModuleDict``
keyed by *global* layer index, so its ``state_dict``/``named_parameters`` use the
full model's names (``layers.<i>.<name>``) on every rank, whatever the plan: the
seam checkpointing builds on (torch.distributed.checkpoint keys by these names;
TP-sharded parameters are DTensors, which DCP reshards on load).

Building (``build_stage``) asks the model function for layers on the meta device
(``model_api``: "Building on the meta device"): the TP plans are applied to the
meta layers, the stage is allocated on the device without initialisation
(``to_empty``), tied copies become one Parameter and the buffers are computed.
Its parameters then wait for a load (``--resume``, ``--init-from``) or for
``init_params``, so a restart never draws the random weights it would overwrite.
A model function that builds on the CPU gets its layers moved to the device.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import checkpoint

from autohet_cli.runtime.context import Runtime
from autohet_cli.runtime.model_api import (
    ModelFn,
    ModelParts,
    ModelRequest,
    layer_of,
    local_layers,
)

# Every TP rank built the same full weights, so each slices its own part (no
# broadcast). Before torch 2.7 ``parallelize_module`` has no ``src_data_rank`` and
# scatters from the mesh's first rank instead: the same numbers, one collective more.
_LOCAL_SLICE = (
    {"src_data_rank": None}
    if "src_data_rank" in inspect.signature(parallelize_module).parameters
    else {}
)


class StageModule(nn.Module):
    """``recompute_first``: the first N layers keep only their input for backward and
    run their forward again there (``torch.utils.checkpoint``, non-reentrant, so
    autocast and DTensor work as in the first forward); the plan stage's
    ``recompute`` decides (true: every layer, N: its first N, ``Stage.recomputed``)."""

    def __init__(self, layers: dict[int, nn.Module], *, recompute_first: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layers[i] for i in sorted(layers)})
        self.recompute_first = recompute_first
        self.recompute = recompute_first > 0  # any layer (autocast's cache is off then)

    def forward(self, x: Tensor, *, but_last: bool = False) -> Tensor:
        """The layers in order; ``but_last``: all but the last, whose ``loss`` (see
        ``fused_loss``) then takes their output."""
        layers = list(self.layers.values())
        for k, layer in enumerate(layers[:-1] if but_last else layers):
            if k < self.recompute_first and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x

    def fused_loss(self, loss_fn: object = None) -> Callable[[Tensor, Tensor], Tensor] | None:
        """The last layer's ``loss(x, targets)``, its forward and the loss in one (the
        built-in head's never holds whole logits, ``models.loss``), or None: also when
        the layer says which ``loss_fn`` it equals (``loss_equals``) and the model's is
        another (a model function pairing the built-in head with its own loss)."""
        last = list(self.layers.values())[-1] if len(self.layers) else None
        loss = layer_loss(last)
        if loss is None:
            return None
        equals = getattr(last, "loss_equals", None)
        return loss if equals is None or loss_fn is None or equals == loss_fn else None

    def full_state_dict(self) -> dict[str, Tensor]:
        """Whole (TP-gathered) tensors on CPU, keyed by full names.

        A collective over the stage's TP group: all its ranks must call it together.
        """
        out = {}
        for name, value in self.state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            out[name] = value.detach().cpu().clone()
        return out


def layer_loss(layer: object) -> Callable[[Tensor, Tensor], Tensor] | None:
    """``layer``'s own ``loss(x, targets)`` method (model_api), or None. A method, not
    any callable: a layer holding ``self.loss = nn.CrossEntropyLoss()`` has a loss
    module, not the contract's loss."""
    loss = getattr(layer, "loss", None)
    return loss if inspect.ismethod(loss) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class BuiltStage:
    """This rank's stage, placed, and whether its parameters still wait for values."""

    stage: StageModule
    parts: ModelParts
    # Built on the meta device: the parameters are allocated but hold no values yet;
    # a load or ``init_params`` fills them. False: initialised by the model function.
    empty: bool


def model_request(runtime: Runtime, seed: int, *, on_meta: bool = False) -> ModelRequest:
    info, plan = runtime.info, runtime.plan
    return ModelRequest(
        model_name=plan.model_name,
        num_layers=plan.num_layers,
        layer_start=info.layer_start,
        layer_end=info.layer_end,
        seed=seed,
        seq_len=plan.training.seq_len,
        micro_batch_size=plan.training.micro_batch_size,
        tensor_parallel=info.tp_size,
        architecture=plan.architecture,
        on_meta=on_meta,
    )


def build_stage(model_fn: ModelFn, runtime: Runtime, seed: int) -> BuiltStage:
    """Build, place, tensor-parallelise and tie this rank's layers (module docstring)."""
    request = model_request(runtime, seed, on_meta=True)
    parts = model_fn(request)
    layers = local_layers(parts, request)
    empty = any(t.is_meta for layer in layers.values() for t in _tensors(layer))
    if empty and parts.init_layer is None:
        raise ValueError(
            "the model function built layers on the meta device but returned no init_layer "
            "to fill them (see autohet_cli/runtime/model_api.py)"
        )
    for index, layer in layers.items():
        if not empty:
            layer.to(runtime.device)
        if runtime.tp_mesh is not None:
            _parallelize(index, layer, runtime)
    info = runtime.info
    spec = runtime.plan.pipelines[info.pipeline].stages[info.stage]
    stage = StageModule(layers, recompute_first=spec.recomputed)
    if empty:
        # Every tensor, meta or not, is allocated anew: init_layer fills them all.
        stage.to_empty(device=runtime.device)
    tie_parameters(stage, parts.tied)  # after to_empty, which gives each copy its own
    if empty:
        assert parts.init_layer is not None
        for index, layer in layers.items():
            parts.init_layer(index, layer, params=False)
    return BuiltStage(stage=stage, parts=parts, empty=empty)


def init_params(stage: StageModule, parts: ModelParts) -> None:
    """Initialise an empty stage's parameters as a fresh run does (``parts.init_layer``)."""
    if parts.init_layer is None:
        raise ValueError("the model function gave no init_layer to initialise its layers")
    for index, layer in stage.layers.items():
        parts.init_layer(int(index), layer, params=True)


def _tensors(layer: nn.Module) -> Iterator[Tensor]:
    yield from layer.parameters()
    yield from layer.buffers()


def _parallelize(index: int, layer: nn.Module, runtime: Runtime) -> None:
    """Apply the layer's TP plan over the stage's mesh (meta layers stay meta)."""
    tp_plan = getattr(layer, "tp_plan", None)
    if tp_plan is None:
        raise ValueError(
            f"layer {index} ({type(layer).__name__}) has no tp_plan() method, "
            f"but its stage has tensor_parallel {runtime.info.tp_size}"
        )
    frozen = [n for n, p in layer.named_parameters() if not p.requires_grad]
    parallelize_module(layer, runtime.tp_mesh, tp_plan(), **_LOCAL_SLICE)
    for name in frozen:  # distributing a parameter makes it trainable again
        layer.get_parameter(name).requires_grad_(False)


def tie_parameters(stage: StageModule, tied: Sequence[tuple[str, ...]]) -> None:
    """Make the local copies of each tied group one Parameter (the first one held)."""
    present = dict(stage.named_parameters(remove_duplicate=False))
    held = {int(i) for i in stage.layers.keys()}
    for names in tied:
        local = [n for n in names if layer_of(n) in held]
        missing = [n for n in local if n not in present]
        if missing:
            raise ValueError(f"tied parameters {missing} are not parameters of their layers")
        keep = present[local[0]] if local else None
        for name in local[1:]:
            if _layout(present[name]) != _layout(keep):
                raise ValueError(f"tied {name} is laid out unlike {local[0]} under TP")
            module_path, _, leaf = name.rpartition(".")
            setattr(stage.get_submodule(module_path), leaf, keep)


def _layout(t: Tensor | None) -> tuple[object, ...]:
    if isinstance(t, DTensor):
        return (tuple(t.shape), tuple(t.placements))
    return (None if t is None else tuple(t.shape),)


def trainable_parameters(stage: StageModule) -> Iterator[tuple[str, nn.Parameter]]:
    """Each trainable parameter once, under the first full name that holds it."""
    for name, p in stage.named_parameters():
        if p.requires_grad:
            yield name, p


def is_tp_sharded(p: Tensor) -> bool:
    """Whether TP shards ``p`` (each TP rank holds a different part), rather than
    replicating it (every TP rank holds the same copy) or not touching it."""
    return isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)


def local_tensor(t: Tensor) -> Tensor:
    """The rank's own shard of a (possibly DTensor) tensor, sharing its storage."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def normalize_grads(stage: StageModule) -> None:
    """Give every trainable parameter a gradient laid out like the parameter.

    Zeros where the step did not reach a parameter. DTensor may leave a gradient in
    another placement than its parameter (a vocabulary-sharded embedding gets a
    replicated gradient); redistribute it so gradient sync and the optimizer see
    this rank's shard only.
    """
    for _, p in trainable_parameters(stage):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif isinstance(p, DTensor) and isinstance(p.grad, DTensor):
            if p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
