"""This rank's stage made ready to train: built, compiled, given weights, wired.

Split from ``runtime.trainer``, which orchestrates: the decisions here are made
once, before the first step, and read nothing of the loop. The model is built
(``stage.build_stage``: on the meta device, or by a model function on the CPU),
compiled block by block when ``--compile`` says so (``compiling``), and its
weights are drawn, taken from ``--init-from`` (``hf_init``), or left empty when a
checkpoint is about to fill them (``--resume``). The dtype the stage computes in
and the point-to-point links to its pipeline neighbours follow from the plan and
the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autohet_cli.errors import ConfigError
from autohet_cli.plan import Plan
from autohet_cli.runtime.compiling import CompileClock, compile_blocks
from autohet_cli.runtime.compiling import setup as compile_setup
from autohet_cli.runtime.context import Runtime
from autohet_cli.runtime.model_api import ModelFn, ModelParts
from autohet_cli.runtime.models.loss import compile_loss
from autohet_cli.runtime.pipeline import P2P, comm_dtype
from autohet_cli.runtime.stage import StageModule, build_stage, init_params
from autohet_cli.runtime.train_config import TrainConfig
from autohet_cli.workerbase.records import say


@dataclass(frozen=True, slots=True, kw_only=True)
class BuiltModel:
    """The stage on its device, what the model function said of it, the compile
    clock (None: not compiled), and whether its parameters still wait for values."""

    stage: StageModule
    parts: ModelParts
    compile_clock: CompileClock | None
    uninitialised: bool


def build_model(
    fn: ModelFn, runtime: Runtime, plan: Plan, config: TrainConfig, *, defer_init: bool
) -> BuiltModel:
    """The stage on the device; its weights drawn unless a load will give them
    (``defer_init``: a checkpoint; ``config.init_from``: a Hugging Face model)."""
    built = build_stage(fn, runtime, config.seed)
    compile_clock: CompileClock | None = None
    try:
        compiling, note = compile_setup(config.compile, runtime.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if note and runtime.global_rank == 0:
        say(note)
    if compiling:
        compile_clock = CompileClock().start()
        compile_blocks(built.stage.layers, plan.num_layers)
        compile_loss()
    uninitialised = built.empty  # parameters allocated, no values yet
    loads = defer_init or bool(config.init_from)
    if loads and not built.empty and runtime.global_rank == 0:
        say(
            "note: the model function builds its layers on the CPU, so their weights "
            "are drawn there even though a checkpoint or --init-from may replace them; "
            "build on the meta device to skip that (autohet_cli/runtime/model_api.py)"
        )
    if config.init_from:
        from autohet_cli.models import get_model
        from autohet_cli.runtime.hf_init import init_from

        spec = plan.architecture or get_model(plan.model_name)
        init_from(
            built.stage,
            spec,
            config.init_from,
            info=runtime.info,
            global_rank=runtime.global_rank,
            say=say,
        )
        uninitialised = False
    elif not defer_init and uninitialised:
        init_params(built.stage, built.parts)  # what ``Trainer.init_weights`` does
        uninitialised = False
    return BuiltModel(
        stage=built.stage,
        parts=built.parts,
        compile_clock=compile_clock,
        uninitialised=uninitialised,
    )


def compute_dtype(device: torch.device, precision: str) -> torch.dtype:
    """fp32 on CPU whatever the plan says; the plan's precision on GPU."""
    if device.type != "cuda":
        return torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def stage_p2p(runtime: Runtime, parts: ModelParts, plan: Plan, dtype: torch.dtype) -> P2P:
    """The links to the previous and next stage of this rank's pipeline, carrying
    activations of the model's ``activation_shape`` in ``comm_dtype(dtype)``."""
    info, t = runtime.info, plan.training
    shape: tuple[int, ...] = ()
    if info.num_stages > 1:
        if parts.activation_shape is None:
            raise ValueError(
                "the model function gave no activation_shape, needed for plans with "
                "more than one stage per pipeline"
            )
        shape = tuple(parts.activation_shape(t.micro_batch_size, t.seq_len))
    topo = runtime.topology
    return P2P(
        prev_rank=runtime.peer(topo.prev_rank(info.rank)),
        next_rank=runtime.peer(topo.next_rank(info.rank)),
        send_prev=tuple(runtime.to_global[r] for r in topo.send_prev(info.rank)),
        send_next=tuple(runtime.to_global[r] for r in topo.send_next(info.rank)),
        shape=shape,
        device=runtime.device,
        dtype=comm_dtype(dtype),
    )
