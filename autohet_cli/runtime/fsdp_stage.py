"""Weight-sharded stages (plan ``shard: weights``, issue 48): torch's FSDP2 over the holders.

A stage whose plan says ``shard: weights`` keeps 1/P of its parameters, gradients
and optimizer state, P being its *holders*: the stages of every pipeline over the
same layers (the plan's validation makes them share the cut and the TP degree).
Their TP rank ``k`` ranks form the stage's data-parallel group, which is exactly
the gradient-sync group of its segment (``Topology.sync_groups``), so the group
already exists on every rank (``Runtime.build_sync_groups``) and is reused here as
FSDP's 1-D mesh. With TP > 1, FSDP shards each TP shard further over the holders of
the same TP rank: FSDP2 needs its mesh and the parameters' TP mesh to be the two
dimensions of one (holders x TP) mesh, which ``context._sharded_tp_meshes`` builds
before the model is parallelised (its "tp" dimension is the stage's TP mesh).

- ``fully_shard`` per layer (the unit of all-gather and reduce-scatter) and on the
  stage (what no layer takes), ``reshard_after_forward`` as the plan says. The last
  layer's fused ``loss`` is registered as a forward method, so its weights are
  gathered when the pipeline calls it instead of ``forward``.
- Gradient reduction is a SUM: the pipeline already divides each loss by the global
  batch, so the holders' gradients add up to the gradient of the mean loss whatever
  their batch shares (as ``gradsync`` does for replicated stages). FSDP's default
  differs by release (2.13 averages, 2.8 sums); a divide factor of 1 with forced
  SUM reduction gives a SUM on all of them (the factor alone asks gloo for
  PREMUL_SUM, which it does not have).
- Gradients are reduce-scattered after every micro-batch's backward (FSDP's
  default) and accumulate in the shards: ZeRO-3's memory, what the memory model
  counts (one layer's unsharded gradient at a time, ``costmodel.sharding``), at a
  reduce-scatter per micro-batch and layer, which the cost model charges. Reducing
  after the last backward only would keep the stage's whole unsharded gradient
  through the step: 4 bytes per parameter beside the 1/P state.
- Every forward and backward is a collective over the holders, so they must run the
  same number of micro-batches: a pipeline with fewer runs extra zero-weight ones
  (``padded_microbatches``; the pipeline schedule multiplies their loss by 0).
- Parameters tied across layers (a GPT's embedding and head) are left out
  (``ignored_params``): they may be held by two stages, and ``gradsync`` already
  sums their copies over every holder; they stay replicated.

The sharded parameters are DTensors (``Shard(0)`` over the holders): ``gradsync``
and ZeRO-1 leave them alone (FSDP reduced them), the optimizer steps their local
shards, and the global gradient norm counts each holder's shard once.

Checkpoints need nothing more: torch.distributed.checkpoint saves each holder's
DTensor shard as a chunk of the full tensor (the format's per-name tensors, loadable
under any plan) and reshards on load; the trainer draws a sharded stage's weights
whole before sharding, so a ``--resume`` that finds nothing starts as one process.

Validation losses pad as training does (``PipelineSchedule.evaluate``). Under
``--compile`` the blocks are compiled in place before they are sharded (as
torchtitan orders them); FSDP's hooks stay outside the compiled graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard

from autohet_cli.plan import Plan, weight_sharded
from autohet_cli.runtime.context import Runtime
from autohet_cli.runtime.stage import StageModule, layer_loss
from autohet_cli.settings import GRAD_REDUCE_DTYPE


def padded_microbatches(plan: Plan, pipeline: int) -> int:
    """How many micro-batches pipeline ``pipeline`` runs per step: its own count, or,
    when a stage is weight-sharded, the largest count of any pipeline. Every pipeline
    holds every layer, so each holds a stage of each sharded one and must issue the
    same gathers; the extra ones carry zero weight."""
    own = plan.pipelines[pipeline].num_microbatches
    if not weight_sharded(plan.pipelines):
        return own
    return max(p.num_microbatches for p in plan.pipelines)


@dataclass(slots=True, kw_only=True)
class ShardedStage:
    """This rank's stage under FSDP2: the ids of the parameters FSDP shards (and
    reduces), which gradsync, ZeRO-1 and the global norm's count treat apart."""

    params: frozenset[int]


def attach_sharding(
    stage: StageModule,
    runtime: Runtime,
    tied: Sequence[Sequence[str]],
    init_weights: Callable[[], None],
    uninitialised: bool,
    compute: torch.dtype = torch.float32,
) -> ShardedStage | None:
    """The trainer's one call: draw this rank's weights whole if they have no values
    yet, then shard (``shard_stage``). Drawn before sharding, as one process draws
    them: ``init_layer`` on FSDP's DTensor shards would draw other numbers; a load
    (``--resume``) overwrites them afterwards."""
    plan, info = runtime.plan, runtime.info
    if not weight_sharded(plan.pipelines):
        return None
    if plan.pipelines[info.pipeline].stages[info.stage].shard == "weights" and uninitialised:
        init_weights()
    return shard_stage(stage, runtime, tied, compute)


def mixed_precision(compute: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP's gathers in the compute dtype (bf16/fp16 on a GPU: half the bytes and the
    working set the cost and memory models count, ``costmodel.sharding``), its
    reduce-scatters in ``GRAD_REDUCE_DTYPE`` as every other gradient reduction here;
    fp32 (a CPU) changes nothing. The fp32 master weights stay in the shards."""
    reduce = getattr(torch, GRAD_REDUCE_DTYPE)
    return MixedPrecisionPolicy(
        param_dtype=None if compute == torch.float32 else compute, reduce_dtype=reduce
    )


def shard_stage(
    stage: StageModule,
    runtime: Runtime,
    tied: Sequence[Sequence[str]],
    compute: torch.dtype = torch.float32,
) -> ShardedStage | None:
    """Apply FSDP2 to this rank's stage if its plan stage says ``shard: weights``;
    None otherwise. After ``Runtime.build_sync_groups`` (the holders' group) and
    with the weights already in place (all holders built the same values)."""
    info, plan = runtime.info, runtime.plan
    spec = plan.pipelines[info.pipeline].stages[info.stage]
    if spec.shard != "weights":
        return None
    holders = runtime.topology.holders(range(info.layer_start, info.layer_end), info.tp_rank)
    if len(holders) < 2:
        raise ValueError(f"stage of rank {info.rank} is weight-sharded over {len(holders)} holder")
    if info.tp_size > 1:  # the (holders x TP) mesh's "dp" (context._sharded_tp_meshes)
        assert runtime.shard_mesh is not None, holders
        mesh = runtime.shard_mesh
    else:
        # Every rank created this group in build_sync_groups (the segment's sync
        # group): asking for it now creates nothing, so no rank waits in new_group.
        assert holders in runtime._groups, holders
        pg = runtime.group(holders)
        assert pg is not None
        mesh = DeviceMesh.from_group(pg, runtime.device.type)
    every = dict(stage.named_parameters(remove_duplicate=False))
    ignored = {every[n] for names in tied for n in names if n in every}
    ignored_ids = {id(p) for p in ignored}
    shard = partial(
        fully_shard,
        mesh=mesh,
        reshard_after_forward=spec.reshard_after_forward,
        ignored_params=ignored,
        mp_policy=mixed_precision(compute),
    )
    layers = list(stage.layers.values())
    modules: list[FSDPModule] = []
    for layer in layers:
        if all(id(p) in ignored_ids for p in layer.parameters()):
            continue  # nothing of its own to shard (only tied weights)
        modules.append(shard(layer))
        if layer is layers[-1] and layer_loss(layer) is not None:
            register_fsdp_forward_method(layer, "loss")  # the pipeline's fused loss
    modules.append(shard(stage))
    for module in modules:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    sharded = frozenset(id(p) for p in stage.parameters() if id(p) not in ignored_ids)
    return ShardedStage(params=sharded)


def sharded_parameters(
    stage: nn.Module, sharded: ShardedStage | None, tp_rank: int = 0
) -> list[nn.Parameter]:
    """The trainable parameters FSDP shards that this rank counts in the global
    gradient norm: each holder its own shard; under TP, a parameter TP splits on
    every TP rank, one it replicates (a norm's weight) on TP rank 0 only, as
    ``optim.counted_parameters`` does."""
    if sharded is None:
        return []
    out = []
    for p in stage.parameters():
        if not p.requires_grad or id(p) not in sharded.params:
            continue
        placements = p.placements if isinstance(p, DTensor) else ()
        tp_split = len(placements) > 1 and isinstance(placements[1], Shard)
        if tp_rank == 0 or tp_split:
            out.append(p)
    return out
