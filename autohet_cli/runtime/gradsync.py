"""Gradient sync across pipelines, one all-reduce per layer segment (and tied weight).

Each pipeline's backward leaves on its ranks the gradient of *its* share of the
loss (its samples' losses summed and divided by the global batch size). Summing
those over the pipelines is therefore exactly the gradient of the mean loss over
the global batch, whatever the batch shares: a plain SUM all-reduce per segment,
no re-weighting. A rank joins the groups of the segments it holds; a parameter
tied across layers joins the group of every rank holding any copy of it instead.
Buckets run in the order ``Topology.sync_groups`` gives, the same on every rank.
They reduce in fp32 (``settings.GRAD_REDUCE_DTYPE``, what the cost model charges):
the gradients of fp32 master weights, never rounded to 16 bits before summing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from autohet_cli.runtime.context import Runtime
from autohet_cli.runtime.model_api import layer_of
from autohet_cli.runtime.stage import StageModule, local_tensor, trainable_parameters
from autohet_cli.settings import GRAD_REDUCE_DTYPE

REDUCE_DTYPE = getattr(torch, GRAD_REDUCE_DTYPE)


@dataclass(slots=True, kw_only=True)
class Bucket:
    key: str
    group: ProcessGroup
    params: list[nn.Parameter]


class GradSync:
    def __init__(self, stage: StageModule, runtime: Runtime, tied: list[tuple[str, ...]]) -> None:
        tie_key = {name: f"tied:{names[0]}" for names in tied for name in names}
        segments = runtime.topology.segments()
        by_key: dict[str, list[nn.Parameter]] = {}
        for name, param in trainable_parameters(stage):
            key = tie_key.get(name) or _segment_key(segments, layer_of(name))
            by_key.setdefault(key, []).append(param)
        known = {sync.key for sync, _ in runtime.sync_groups}
        unknown = sorted(set(by_key) - known)
        assert not unknown, f"parameters in no sync group: {unknown}"
        self.buckets = [
            Bucket(key=sync.key, group=pg, params=by_key[sync.key])
            for sync, pg in runtime.sync_groups
            if pg is not None and sync.key in by_key
        ]

    @torch.no_grad()
    def all_reduce(self) -> None:
        """Sum every bucket's gradients over its group, in place."""
        pending = []
        for bucket in self.buckets:
            grads = [local_tensor(p.grad) for p in bucket.params if p.grad is not None]
            assert len(grads) == len(bucket.params), f"{bucket.key}: missing gradients"
            flat = torch.cat([g.reshape(-1).to(REDUCE_DTYPE) for g in grads])
            work = dist.all_reduce(flat, group=bucket.group, async_op=True)
            pending.append((work, flat, grads))
        for work, flat, grads in pending:
            work.wait()
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


def _segment_key(segments: tuple[tuple[int, int], ...], layer: int) -> str:
    for a, b in segments:
        if a <= layer < b:
            return f"segment:{a}-{b}"
    raise AssertionError(f"layer {layer} is in no segment")
