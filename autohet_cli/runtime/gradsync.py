"""Gradient sync across pipelines, one all-reduce per layer segment (and tied weight).

Each pipeline's backward leaves on its ranks the gradient of *its* share of the
loss (its samples' losses summed and divided by the global batch size). Summing
those over the pipelines is therefore exactly the gradient of the mean loss over
the global batch, whatever the batch shares: a plain SUM all-reduce per segment,
no re-weighting. A rank joins the groups of the segments it holds; a parameter
tied across layers joins the group of every rank holding any copy of it instead.
Buckets run in the order ``Topology.sync_groups`` gives, the same on every rank.
A segment held by stages of different TP degrees syncs through the full gradient
(``SyncGroup.full``; ``topology`` says why): DTensor gathers it over the stage's TP
group, TP rank 0 of each holding stage all-reduces it, broadcasts the sum to its
TP group, and DTensor keeps each rank's shard of it. It runs in slices of at most
``FULL_SYNC_BYTES`` so that a rank never holds more than that much of a full
gradient beyond its own shards. They reduce in fp32 (``settings.GRAD_REDUCE_DTYPE``,
what the cost model charges): the gradients of fp32 master weights, never rounded
to 16 bits before summing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Shard

from autohet_cli.runtime.context import Runtime
from autohet_cli.runtime.grouping import consecutive_groups
from autohet_cli.runtime.model_api import layer_of
from autohet_cli.runtime.stage import StageModule, local_tensor, trainable_parameters
from autohet_cli.runtime.zero import ShardedBucket, ZeroState
from autohet_cli.settings import GRAD_REDUCE_DTYPE

REDUCE_DTYPE = getattr(torch, GRAD_REDUCE_DTYPE)


FULL_SYNC_BYTES = 64 * 2**20  # of fp32 full gradient per slice of a full-gradient sync


@dataclass(slots=True, kw_only=True)
class Bucket:
    key: str
    group: ProcessGroup | None  # None: a full-gradient member that is not its stage's TP rank 0
    params: list[nn.Parameter]
    full: bool = False


class GradSync:
    """``zero``: the buckets of one-degree segments held by several pipelines are
    sharded (``runtime.zero``, ZeRO-1): reduce-scattered here, all-gathered after
    the optimizer step (``self.zero``)."""

    def __init__(
        self,
        stage: StageModule,
        runtime: Runtime,
        tied: list[tuple[str, ...]],
        *,
        zero: bool = False,
        optimizer: str = "adam",
        skip: frozenset[int] = frozenset(),
    ) -> None:
        """``skip``: ids of parameters reduced elsewhere (FSDP's, ``runtime.fsdp_stage``)."""
        tie_key = {name: f"tied:{names[0]}" for names in tied for name in names}
        segments = runtime.topology.segments()
        by_key: dict[str, list[nn.Parameter]] = {}
        names: dict[str, list[str]] = {}
        for name, param in trainable_parameters(stage):
            if id(param) in skip:
                continue
            key = tie_key.get(name) or _segment_key(segments, layer_of(name))
            by_key.setdefault(key, []).append(param)
            names.setdefault(key, []).append(name)
        known = {sync.key for sync, _ in runtime.sync_groups}
        unknown = sorted(set(by_key) - known)
        assert not unknown, f"parameters in no sync group: {unknown}"
        self.tp_group = runtime.tp_group
        # TP rank 0 of this rank's stage, the source of a full-gradient sync's broadcast.
        info = runtime.info
        self.tp_root = runtime.peer(runtime.topology.rank_of(info.pipeline, info.stage, 0))
        self.buckets: list[Bucket] = []
        sharded: list[ShardedBucket] = []
        for sync, pg in runtime.sync_groups:
            if sync.key not in by_key or (pg is None and not sync.full):
                continue
            if zero and pg is not None and not sync.full and not sync.key.startswith("tied:"):
                sharded.append(
                    ShardedBucket(
                        key=sync.key,
                        group=pg,
                        members=len(sync.ranks),
                        index=sync.ranks.index(info.rank),
                        names=names[sync.key],
                        params=by_key[sync.key],
                    )
                )
                continue
            self.buckets.append(
                Bucket(key=sync.key, group=pg, params=by_key[sync.key], full=sync.full)
            )
        self.zero = ZeroState(sharded, optimizer) if zero else None

    @torch.no_grad()
    def all_reduce(self) -> None:
        """Sum every bucket's gradients over its group, in place (a sharded bucket's
        into this rank's slices only)."""
        if self.zero is not None:
            self.zero.reduce_scatter()
        pending = []
        for bucket in self.buckets:
            if bucket.full:
                self._full_sync(bucket)
                continue
            grads = [local_tensor(p.grad) for p in bucket.params if p.grad is not None]
            assert len(grads) == len(bucket.params), f"{bucket.key}: missing gradients"
            flat = torch.cat([g.reshape(-1).to(REDUCE_DTYPE) for g in grads])
            work = dist.all_reduce(flat, group=bucket.group, async_op=True)
            pending.append((work, flat, grads))
        for work, flat, grads in pending:
            work.wait()
            _unflatten(flat, grads)

    def _full_sync(self, bucket: Bucket) -> None:
        """Gather, reduce over the holding stages' TP rank 0, broadcast, keep the shard."""
        assert all(p.grad is not None for p in bucket.params), f"{bucket.key}: missing gradients"
        # numel of a DTensor is its full size; 4 bytes of fp32 gradient each
        for params in consecutive_groups(bucket.params, FULL_SYNC_BYTES, 4):
            fulls = [_full(p.grad) for p in params]
            flat = torch.cat([f.reshape(-1).to(REDUCE_DTYPE) for f in fulls])
            if bucket.group is not None:
                dist.all_reduce(flat, group=bucket.group)
            if self.tp_group is not None:
                dist.broadcast(flat, src=self.tp_root, group=self.tp_group)
            _unflatten(flat, fulls)
            for p, full in zip(params, fulls, strict=True):
                grad = p.grad
                if isinstance(grad, DTensor):
                    local_tensor(grad).copy_(_my_shard(full, grad))
                else:
                    assert grad is not None
                    if grad is not full:
                        grad.copy_(full)


def _my_shard(full: Tensor, like: DTensor) -> Tensor:
    """This rank's part of ``full`` laid out like ``like`` (DTensor's even chunks,
    ``torch.chunk``'s). By hand, not ``distribute_tensor(src_data_rank=None)``: that
    argument needs torch 2.7, and the runtime supports older releases."""
    out = full
    for dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            size = like.device_mesh.size(dim)
            out = torch.chunk(out, size, dim=placement.dim)[like.device_mesh.get_local_rank(dim)]
    return out


def _full(grad: Tensor | None) -> Tensor:
    """The full gradient: gathered over the TP group for a DTensor (a collective)."""
    assert grad is not None
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _unflatten(flat: Tensor, grads: list[Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _segment_key(segments: tuple[tuple[int, int], ...], layer: int) -> str:
    for a, b in segments:
        if a <= layer < b:
            return f"segment:{a}-{b}"
    raise AssertionError(f"layer {layer} is in no segment")
