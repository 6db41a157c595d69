"""The optimizer, its learning-rate schedule and gradient clipping by the global norm.

``LRSchedule`` (``runtime.lr_schedule``) is a pure function of the step: warmup,
then cosine or linear decay to ``min_lr``. Why not ``torch.optim.lr_scheduler``:
LambdaLR would compute the same numbers, but its state (``last_epoch``, per-group
``base_lrs``) would have to travel in checkpoints and be reconciled across plans
whose parameter groups hold different parameters. Setting each group's ``lr``
from the step makes a resumed run, under any plan, use exactly the rate the
uninterrupted run used.

``clip_grad_norm`` is torch's ``clip_grad_norm_`` over the whole model, which no
rank holds: each parameter's gradient is counted once (pipeline 0 holds every
layer; a TP-sharded gradient on each of its TP ranks, a replicated one on TP rank
0; a tied weight under its first name), one world-wide all-reduce sums the squares,
and every rank scales its gradients by the same factor. torch's own version
handles one DTensor mesh, not pipeline stages nor replicas that cut layers
differently, so this is written here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence, Set

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autohet_cli.runtime.lr_schedule import LRSchedule as LRSchedule  # where it lived first
from autohet_cli.runtime.model_api import layer_of
from autohet_cli.runtime.stage import (
    StageModule,
    is_tp_sharded,
    local_tensor,
    trainable_parameters,
)

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def build_optimizer(
    stage: StageModule,
    *,
    kind: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    momentum: float,
    skip: Set[int] = frozenset(),
) -> torch.optim.Optimizer | None:
    """AdamW (plan optimizer ``adam``) or SGD; weight decay on matrices only (nanoGPT):
    biases and norm gains (1-D) are in a group without decay. ``skip``: ids of
    parameters another optimizer steps (ZeRO-1 slices, ``runtime.zero``); None when
    that leaves nothing."""
    params = [(p, p.ndim >= 2) for _, p in trainable_parameters(stage) if id(p) not in skip]
    return optimizer_for(
        params, kind=kind, lr=lr, weight_decay=weight_decay, betas=betas, momentum=momentum
    )


def optimizer_for(
    params: Sequence[tuple[nn.Parameter, bool]],
    *,
    kind: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    momentum: float,
) -> torch.optim.Optimizer | None:
    """The optimizer over (parameter, takes weight decay) pairs: a decay group, then
    a no-decay group, each only where it has parameters (DCP's optimizer state dict
    cannot load an empty group); None without parameters. AdamW is torch's fused
    kernel wherever the installed torch has one for the parameters' device and dtype
    (CPU and CUDA since 2.4) and no parameter is a DTensor, else torch's default; its
    state and checkpoints are the same either way."""
    groups = [
        {"params": [p for p, d in params if d], "weight_decay": weight_decay},
        {"params": [p for p, d in params if not d], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        return None
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    # One kernel over all parameters: 120 ms against 700 ms for 173M on 2 cores. Not
    # over DTensors (TP stages): DTensor's dispatch of the fused kernel refuses the
    # plain tensors beside them (norm weights; step counts after a resume).
    if not any(isinstance(p, DTensor) for p, _ in params):
        try:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
        except RuntimeError:  # a device or dtype this torch has no fused kernel for
            pass
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def counted_parameters(
    stage: StageModule, *, pipeline: int, tp_rank: int, tied: Sequence[Sequence[str]]
) -> list[nn.Parameter]:
    """The parameters whose gradients this rank counts in the global norm (see module doc).

    A tied weight is counted by the stage that holds its group's first name, whatever
    name ``named_parameters`` happens to report it under here.
    """
    if pipeline != 0:
        return []
    every = dict(stage.named_parameters(remove_duplicate=False))
    held = {int(i) for i in stage.layers.keys()}
    skip: set[int] = set()
    for group in tied:
        ids = {id(every[n]) for n in group if n in every}
        if layer_of(group[0]) not in held:
            skip |= ids
    out = []
    for _, p in trainable_parameters(stage):
        if id(p) in skip:
            continue
        if is_tp_sharded(p) or tp_rank == 0:
            out.append(p)
    return out


def sum_of_squares(params: Iterable[nn.Parameter], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None:
            total += local_tensor(p.grad).detach().float().pow(2).sum()
    return total


@torch.no_grad()
def clip_grad_norm(
    stage: StageModule,
    counted: Sequence[nn.Parameter],
    max_norm: float,
    device: torch.device,
    extra: Sequence[nn.Parameter] = (),
) -> float:
    """The global gradient norm (before clipping); scales every gradient (the stage's
    and ``extra``'s: ZeRO-1 slices) when above ``max_norm`` (> 0), exactly as
    ``torch.nn.utils.clip_grad_norm_`` would on one process."""
    squares = sum_of_squares(counted, device)
    dist.all_reduce(squares)
    norm = float(squares.sqrt().item())
    if max_norm > 0 and math.isfinite(norm):  # a non-finite step is skipped (trainer)
        coef = min(max_norm / (norm + CLIP_EPS), 1.0)
        for p in [p for _, p in trainable_parameters(stage)] + list(extra):
            if p.grad is not None:
                local_tensor(p.grad).mul_(coef)
    return norm


class LossScaler:
    """Dynamic loss scaling for fp16, agreed over the world so every rank skips together."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 1000) -> None:
        self.scale, self.growth_interval, self._good = scale, growth_interval, 0

    @torch.no_grad()
    def unscale_and_check(self, params: Sequence[torch.nn.Parameter], device: torch.device) -> bool:
        found = torch.zeros((), device=device)
        for p in params:
            if p.grad is not None:
                g = local_tensor(p.grad)
                g.mul_(1.0 / self.scale)
                found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        overflow = bool(found.item())
        self._good = 0 if overflow else self._good + 1
        if overflow:
            self.scale /= 2
        elif self._good % self.growth_interval == 0:
            self.scale *= 2
        return overflow
