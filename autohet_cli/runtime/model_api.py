"""The plug-in point for models: what a model function receives and returns.

The runtime trains any model that can be written as a list of *partitionable
layers*: ``nn.Module`` objects applied one after the other, the first taking the
input batch (token ids), each next one taking the previous one's output, the last
one's output going to ``loss_fn``. A plan's ``layers: [start, end)`` index this
list, so its length must be the plan's ``model.num_layers``.

Write a function ``build(request: ModelRequest) -> ModelParts`` in an importable
module and pass ``--model-fn package.module:build`` to the runtime (the default,
``autohet_cli.runtime.models:build``, builds the built-in families: GPT-2 and the
LLaMA family, see ``runtime.models``). The contract:

- ``layers``: either all ``request.num_layers`` layers or just
  ``[request.layer_start, request.layer_end)``; build only those when the model is
  big. Parameter values must not depend on the range: every rank that builds a
  layer must get the same weights (seed each layer from ``request.seed`` and its
  index, not from a global RNG stream).
- ``request.architecture``: the plan's ``model.architecture`` (a ``ModelSpec``:
  shapes, norm, rope, vocabulary padding), None for plans older than that field.
- ``loss_fn(output, targets)``: the **sum** over the micro-batch's samples of each
  sample's loss (for a language model: the per-sample mean over tokens). The
  runtime divides by the global batch size, so the step optimises the mean loss
  over the global batch whatever the plan.
- ``activation_shape(micro_batch_size, seq_len)``: shape of the tensor passed
  between layers (the pipeline receives into buffers of this shape); needed only
  for plans with more than one stage.
- ``tied``: groups of full parameter names that are one weight used by several
  layers, e.g. ``[("layers.0.wte.weight", "layers.5.lm_head.weight")]``, the same
  list whatever range was requested. Every rank that builds any of them must
  initialise them identically; the runtime ties the copies a rank holds together
  and all-reduces their gradient over all holders.
- Tensor parallelism (plans with ``tensor_parallel > 1``): every layer must have a
  ``tp_plan()`` method returning a ``torch.distributed.tensor.parallel``
  ``parallelize_plan`` (sub-module name -> ParallelStyle); the runtime applies it
  over the stage's TP mesh. A head whose plan leaves logits sharded on the class
  dimension (``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``)
  has its loss computed under ``loss_parallel()``.
- Optional, the last layer's ``loss(x, targets)``: its forward and ``loss_fn`` in one
  (the same value as ``loss_fn(layer(x), targets)``), for a head that never holds a
  whole micro-batch's logits (the built-in head's, ``runtime.models.loss``); the
  runtime calls it, under autocast and ``loss_parallel()``, instead of the two.

Full parameter names are ``layers.<layer index>.<name inside the layer>``: the
names the whole model would have as ``nn.ModuleList`` attribute ``layers``. Every
rank's ``state_dict`` uses them, so a checkpoint written under one plan loads
under any other.

Building on the meta device (optional; what makes a restart fast): the runtime
asks with ``request.on_meta`` True. A function that honours it constructs its
layers on the meta device (``with torch.device("meta"):``: shapes only, no memory,
no random numbers) and returns ``init_layer``. The runtime applies the TP plans to
the meta layers, allocates every tensor on the rank's device uninitialised
(``nn.Module.to_empty``), ties the tied copies, and calls for each layer:

- ``init_layer(index, layer, params=False)`` at once: fill the buffers (RoPE
  tables and the like; no checkpoint holds a non-persistent buffer, and after
  ``to_empty`` they hold garbage);
- ``init_layer(index, layer, params=True)`` when neither a checkpoint (``--resume``)
  nor ``--init-from`` fills the parameters: initialise parameters and buffers in
  place on their device, seeded per parameter as above, so that a resumed run
  that finds no checkpoint starts with exactly the weights of a fresh run.

Under TP the parameters are DTensors: write each one's full value with
``write_full`` (every rank computes the whole tensor and keeps its block, which
keeps the weights independent of the plan). On a GPU run the device is the GPU,
whose random stream differs from the CPU's: such a model is the same under every
plan on one kind of device, not across kinds. A function that ignores ``on_meta``
builds and initialises on the CPU as before and works unchanged (the runtime says
so once when a checkpoint or ``--init-from`` may replace the weights it drew).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor, nn

from autohet_cli import fnspec
from autohet_cli.models import ModelSpec
from autohet_cli.runtime.worker_defaults import DEFAULT_MODEL_FN as DEFAULT_MODEL_FN
from autohet_cli.workerbase.paramnames import layer_of as layer_of


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRequest:
    """What the runtime asks a model function for."""

    model_name: str  # plan.model.name
    num_layers: int  # plan.model.num_layers
    layer_start: int  # this rank's stage: [layer_start, layer_end)
    layer_end: int
    seed: int
    seq_len: int
    micro_batch_size: int
    tensor_parallel: int = 1  # the stage's TP degree; layers get ``tp_plan()`` applied
    # plan.model.architecture: the model itself (None in plans older than that field)
    architecture: ModelSpec | None = None
    # Build on the meta device and return ``ModelParts.init_layer`` (see the module docstring)
    on_meta: bool = False


class LayerInit(Protocol):
    """``ModelParts.init_layer``: fill layer ``index``'s buffers, and its parameters too
    when ``params``, in place on their device (see the module docstring)."""

    def __call__(self, index: int, layer: nn.Module, *, params: bool) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelParts:
    """What a model function returns; see the module docstring for the contract."""

    layers: Sequence[nn.Module]
    loss_fn: Callable[[Any, Tensor], Tensor]
    vocab_size: int
    activation_shape: Callable[[int, int], tuple[int, ...]] | None = None
    tied: Sequence[tuple[str, ...]] = ()
    init_layer: LayerInit | None = None  # needed by layers built on the meta device


ModelFn = Callable[[ModelRequest], ModelParts]


def load_model_fn(spec: str) -> ModelFn:
    """Resolve ``package.module:function`` or ``FILE.py:function`` (``fnspec``)."""
    module_name, attr = fnspec.split(spec)
    if not module_name or not attr:
        raise ValueError(
            f"--model-fn {spec!r}: expected package.module:function or FILE.py:function"
        )
    try:
        module = fnspec.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--model-fn {spec!r}: cannot import {module_name}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--model-fn {spec!r}: {module_name} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def local_layers(parts: ModelParts, request: ModelRequest) -> dict[int, nn.Module]:
    """This rank's layers by global index, whichever of the two allowed lists was returned."""
    start, end = request.layer_start, request.layer_end
    n = len(parts.layers)
    if n == request.num_layers:
        return {i: parts.layers[i] for i in range(start, end)}
    if n == end - start:
        return {start + j: layer for j, layer in enumerate(parts.layers)}
    raise ValueError(
        f"model function returned {n} layers; expected all {request.num_layers} of the "
        f"plan's model or the {end - start} of [{start}, {end})"
    )


def local_block(param: Tensor) -> tuple[Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's tensor, its global shape, its offset in every dimension).

    TP plans here shard one dimension evenly over a 1-D mesh (the runtime checks
    divisibility), so a shard's offset is its mesh rank times its size.
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return param, tuple(param.shape), (0,) * param.ndim
    local = param.to_local()
    offsets = [0] * param.ndim
    for placement in param.placements:
        if isinstance(placement, Shard):
            rank = param.device_mesh.get_local_rank()
            offsets[placement.dim] = rank * local.shape[placement.dim]
    return local, tuple(param.shape), tuple(offsets)


def write_full(param: Tensor, full: Tensor) -> None:
    """Copy ``full`` (``param``'s whole value) into ``param``: its block when TP shards it."""
    local, shape, offsets = local_block(param)
    if tuple(full.shape) != shape:
        raise ValueError(f"a value of shape {list(full.shape)} for a parameter of {list(shape)}")
    block = full[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))]
    local.detach().copy_(block)
