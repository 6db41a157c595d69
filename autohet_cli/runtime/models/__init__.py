"""The built-in model families: one module per architecture, picked by ``ModelSpec.family``.

Each family module (``gpt2``, ``llama``) holds its layers, their Megatron-style TP
plans and its HuggingFace name mapping side by side, and provides:

- ``make_layer(spec, index, request) -> nn.Module``: partitionable layer ``index``;
- ``tied_names(spec)``: groups of full names that are one weight;
- ``RESIDUAL``: name suffixes of the residual projections (scaled at init);
- ``problems(spec, request) -> list[str]``: what the family cannot build;
- ``hf_sources(spec) -> dict[str, HFSource]``: for every full parameter name, where
  the tensor lives in a HuggingFace checkpoint (``--init-from``, ``autohet export``).

``build`` is the default ``--model-fn``: it builds the family's layers for the
plan's architecture. This module imports no torch until ``build`` runs, so the
planner can ask ``unsupported_reason`` cheaply.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from autohet_cli.models import ModelSpec, get_model

if TYPE_CHECKING:
    from autohet_cli.runtime.model_api import ModelParts, ModelRequest

# ModelSpec.family (the HF model_type) -> the module that builds it.
FAMILIES: dict[str, str] = {
    "gpt2": "gpt2",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "phi3": "llama",
}


def unsupported_reason(spec: ModelSpec) -> str | None:
    """Why the built-in runtime cannot train ``spec`` (None: it can), with the way out."""
    if spec.family in FAMILIES:
        return None
    return (
        f"the built-in runtime trains the families {', '.join(sorted(FAMILIES))}, not "
        f"{spec.family!r} (model {spec.name}); launch it with your own model function: "
        "--train-arg=--model-fn=package.module:build (see autohet_cli/runtime/model_api.py)"
    )


def family_module(spec: ModelSpec) -> ModuleType:
    reason = unsupported_reason(spec)
    if reason is not None:
        raise ValueError(reason)
    return importlib.import_module(f"{__name__}.{FAMILIES[spec.family]}")


def spec_of(request: ModelRequest) -> ModelSpec:
    """The plan's architecture; plans written before they carried one name a zoo model."""
    return request.architecture or get_model(request.model_name)


def build(request: ModelRequest) -> ModelParts:
    """The default model function: the plan's architecture, built by its family module."""
    from autohet_cli.runtime.models.common import assemble

    spec = spec_of(request)
    return assemble(spec, request, family_module(spec))
