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

Full parameter names are ``layers.<layer index>.<name inside the layer>``: the
names the whole model would have as ``nn.ModuleList`` attribute ``layers``. Every
rank's ``state_dict`` uses them, so a checkpoint written under one plan loads
under any other.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from autohet_cli.models import ModelSpec

DEFAULT_MODEL_FN = "autohet_cli.runtime.models:build"


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


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelParts:
    """What a model function returns; see the module docstring for the contract."""

    layers: Sequence[nn.Module]
    loss_fn: Callable[[Any, Tensor], Tensor]
    vocab_size: int
    activation_shape: Callable[[int, int], tuple[int, ...]] | None = None
    tied: Sequence[tuple[str, ...]] = ()


ModelFn = Callable[[ModelRequest], ModelParts]


def load_model_fn(spec: str) -> ModelFn:
    """Resolve ``package.module:function``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model-fn {spec!r}: expected package.module:function")
    try:
        module = importlib.import_module(module_name)
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


def layer_of(full_name: str) -> int:
    """The layer index in a full parameter name ``layers.<i>.<...>``."""
    head, index, _rest = full_name.split(".", 2)
    if head != "layers" or not index.isdigit():
        raise ValueError(f"{full_name!r} is not a full parameter name (layers.<i>.<name>)")
    return int(index)
