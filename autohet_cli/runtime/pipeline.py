"""One pipeline's 1F1B (PipeDream-flush) schedule over its own micro-batches.

Why not ``torch.distributed.pipelining``: each of our pipelines could be one of
its schedules over a per-(pipeline, TP rank) group, but ``Schedule1F1B`` raises
when a pipeline has fewer micro-batches than stages, and the planner's uneven
batch shares produce exactly that (a deep pipeline of slow GPUs may get one or
two micro-batches). Using it only where it applies would mean two code paths for
one schedule, so none of it is used; the other differences (it scales gradients
by the pipeline's own micro-batch count unless ``scale_grads=False``, and infers
boundary shapes with an extra handshake at the first step) would need handling
too. The loop below is Megatron-LM's non-interleaved schedule
(``forward_backward_pipelining_without_interleaving``): the compute order of
``topology.one_f_one_b``, with each steady-state send batched with the receive
that follows it in one ``batch_isend_irecv``, so two neighbours never both sit in
a send waiting for the other's receive (which NCCL would deadlock on). Any
micro-batch count works.

Stage boundaries carry tensors of ``ModelParts.activation_shape`` in the compute
dtype (``comm_dtype``: bf16 under a bf16 plan on a GPU, as the cost model charges;
``autohet_cli.settings`` states the decision); the receiver widens them to fp32,
where the residual stream lives under autocast, and sends their gradients back in
the compute dtype too. The boundary activations are replicated across a stage's
TP ranks, so each rank receives from one rank of its neighbour and sends to the
ranks that receive from it (``Topology.prev_rank``/``send_next``): the same TP rank
when neighbours have one degree, ``k mod a`` when they differ.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from autohet_cli.runtime.stage import StageModule
from autohet_cli.runtime.timing import StepMarks
from autohet_cli.runtime.topology import BACKWARD, FORWARD, RankInfo
from autohet_cli.settings import COMPUTE_DTYPES

Context = contextlib.AbstractContextManager[Any]


def autocast_contexts(
    device_type: str, dtype: torch.dtype, *, recompute: bool
) -> tuple[Context, Context]:
    """(each forward's, the whole step's) autocast contexts of a stage computing in
    ``dtype`` (fp32: neither).

    - Plain stage: each forward under autocast, the step inside a disabled autocast
      (``PipelineSchedule.run``), so autocast's cache of 16-bit weight copies lives
      for the step and its micro-batches share one copy of each weight.
    - Recompute stage: autocast without its cache. A checkpointed forward keeps
      nothing for backward, but a cache would hold every layer's copy until the
      forward's context exits (the whole stage's weights at once); without it each
      weight is cast as it is used and freed, and the re-run in backward holds one
      layer's copies, which is what the cost model charges (``transient_bytes``).
    """
    if dtype == torch.float32:
        return contextlib.nullcontext(), contextlib.nullcontext()
    if recompute:
        return torch.autocast(
            device_type, dtype=dtype, cache_enabled=False
        ), contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype), torch.autocast(device_type, enabled=False)


RESIDUAL_DTYPE = torch.float32  # what a stage computes on between its layers


def comm_dtype(compute: torch.dtype) -> torch.dtype:
    """Stage-to-stage dtype for a run computing in ``compute`` (settings.COMPUTE_DTYPES)."""
    known = {getattr(torch, name) for name in COMPUTE_DTYPES.values()}
    if compute not in known:
        raise ValueError(f"no communication dtype for compute dtype {compute}")
    return compute


class P2P:
    """Activation/gradient exchange with the previous and next stage."""

    def __init__(
        self,
        *,
        prev_rank: int | None,
        next_rank: int | None,
        shape: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype = RESIDUAL_DTYPE,
        send_prev: tuple[int, ...] | None = None,
        send_next: tuple[int, ...] | None = None,
    ) -> None:
        # Global ranks received from (None at the ends) and sent to (by default the
        # same neighbour; stages of different TP degrees send to several or none).
        self.prev, self.next = prev_rank, next_rank
        self.to_prev = _peers(prev_rank) if send_prev is None else send_prev
        self.to_next = _peers(next_rank) if send_next is None else send_next
        self.shape, self.device, self.dtype = shape, device, dtype
        self.marks: StepMarks | None = None  # set by the trainer for each step it times

    def _exchange(
        self,
        *,
        send_prev: Tensor | None = None,
        send_next: Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[Tensor | None, Tensor | None]:
        ops, from_prev, from_next = [], None, None
        if send_prev is not None:
            wire = self._wire(send_prev)
            ops += [dist.P2POp(dist.isend, wire, peer) for peer in self.to_prev]
        if recv_prev and self.prev is not None:
            from_prev = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev))
        if send_next is not None:
            wire = self._wire(send_next)
            ops += [dist.P2POp(dist.isend, wire, peer) for peer in self.to_next]
        if recv_next and self.next is not None:
            from_next = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_next, self.next))
        if ops:
            marks = self.marks
            start = marks.clock.mark() if marks else None
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if marks:
                marks.span("p2p", start, marks.clock.mark())
        return _widen(from_prev), _widen(from_next)

    def _wire(self, t: Tensor) -> Tensor:
        return t.detach().to(self.dtype).contiguous()

    def recv_forward(self) -> Tensor | None:
        return self._exchange(recv_prev=True)[0]

    def send_forward(self, t: Tensor | None) -> None:
        self._exchange(send_next=t)

    def recv_backward(self) -> Tensor | None:
        return self._exchange(recv_next=True)[1]

    def send_backward(self, t: Tensor | None) -> None:
        self._exchange(send_prev=t)

    def send_forward_recv_backward(self, t: Tensor | None) -> Tensor | None:
        return self._exchange(send_next=t, recv_next=True)[1]

    def send_backward_recv_forward(self, t: Tensor | None) -> Tensor | None:
        return self._exchange(send_prev=t, recv_prev=True)[0]


def _peers(rank: int | None) -> tuple[int, ...]:
    return () if rank is None else (rank,)


Microbatch = tuple[Tensor, Tensor]


class PipelineSchedule:
    """Runs one iteration's forwards and backwards on this rank's stage.

    ``loss_fn(output, targets)`` returns the sum of the micro-batch's per-sample
    losses; it is divided by ``global_batch_size`` before backward, so the
    gradients left on the stage are those of this pipeline's share of the mean loss.
    """

    def __init__(
        self,
        *,
        stage: torch.nn.Module,
        info: RankInfo,
        p2p: P2P,
        loss_fn: Callable[[Any, Tensor], Tensor],
        global_batch_size: int,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        loss_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        cast_once: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        pad_to: int = 0,
    ) -> None:
        """``pad_to``: run at least this many micro-batches, the extra ones copies of
        the first with zero weight (a weight-sharded stage's holders must issue the same
        gathers and reduce-scatters, ``runtime.fsdp_stage``)."""
        self.stage, self.info, self.p2p = stage, info, p2p
        self.loss_fn, self.global_batch_size, self.device = loss_fn, global_batch_size, device
        self.autocast, self.loss_context = autocast, loss_context
        self.cast_once = cast_once
        self.loss_scale = 1.0  # fp16 loss scaling multiplies the backward of the loss
        self.trace: list[tuple[str, int]] = []  # compute order of the last run
        self.pad_to = pad_to
        self._real = 0  # the step's own micro-batches; those after them are padding

    def run(self, microbatches: list[Microbatch]) -> Tensor:
        """One iteration; returns this stage's summed loss share (zero off the last stage).

        Inside ``cast_once`` (``torch.autocast(enabled=False)``, so nothing runs under
        autocast that did not before): autocast empties its cache of 16-bit weight
        copies only when the outermost autocast context exits, so with this one
        around the step every micro-batch's forward reuses the copies the first one
        made, instead of each keeping its own until its backward (one copy per
        micro-batch in flight: 16 on the first of 16 stages, more than the
        optimizer state). The copies are the same casts of the same weights, so
        the numbers are too; the weights change only after the step."""
        with self.cast_once():
            return self._run(microbatches)

    def _run(self, microbatches: list[Microbatch]) -> Tensor:
        real = len(microbatches)
        assert real == self.info.num_microbatches, (real, self.info.num_microbatches)
        microbatches = self._padded(microbatches)
        m, self._real = len(microbatches), real
        self.trace = []
        self._counts = {FORWARD: 0, BACKWARD: 0}
        self._loss_sum = torch.zeros((), device=self.device)
        batches = iter(microbatches)
        warmup = min(self.info.num_stages - self.info.stage - 1, m)
        remaining = m - warmup
        in_flight: deque[tuple[Tensor | None, Tensor]] = deque()
        p2p = self.p2p

        for _ in range(warmup):
            received = p2p.recv_forward()
            x, out, to_send = self._forward(next(batches), received)
            p2p.send_forward(to_send)
            in_flight.append((x, out))
        received = p2p.recv_forward() if remaining else None
        for i in range(remaining):
            x, out, to_send = self._forward(next(batches), received)
            grad = p2p.send_forward_recv_backward(to_send)
            in_flight.append((x, out))
            x, out = in_flight.popleft()
            input_grad = self._backward(x, out, grad)
            if i == remaining - 1:
                p2p.send_backward(input_grad)
            else:
                received = p2p.send_backward_recv_forward(input_grad)
        for _ in range(warmup):
            x, out = in_flight.popleft()
            input_grad = self._backward(x, out, p2p.recv_backward())
            p2p.send_backward(input_grad)
        assert not in_flight
        return self._loss_sum

    @torch.no_grad()
    def evaluate(self, microbatches: list[Microbatch]) -> Tensor:
        """Forward only: this stage's summed loss share (zero off the last stage).

        Each stage receives, computes and sends one micro-batch at a time; the
        chain of sends is acyclic, so no batching is needed to avoid deadlock.
        """
        loss_sum = torch.zeros((), device=self.device)
        real = len(microbatches)
        for i, (inputs, targets) in enumerate(self._padded(microbatches)):  # i >= real: pads
            received = self.p2p.recv_forward()
            stage_input = inputs.to(self.device) if self.info.is_first_stage else received
            if not self.info.is_last_stage:
                with self.autocast():
                    out = self.stage(stage_input)
                self.p2p.send_forward(out)
                continue
            assert stage_input is not None
            loss = self._stage_loss(stage_input, targets) / self.global_batch_size
            if i < real:
                loss_sum += _plain(loss.detach()).float()
        return loss_sum

    def _padded(self, microbatches: list[Microbatch]) -> list[Microbatch]:
        """``microbatches`` and copies of the first up to ``pad_to`` (see __init__)."""
        return list(microbatches) + [microbatches[0]] * max(0, self.pad_to - len(microbatches))

    def _record(self, kind: str) -> int:
        index = self._counts[kind]
        self.trace.append((kind, index))
        self._counts[kind] += 1
        return index

    def _forward(
        self, batch: Microbatch, received: Tensor | None
    ) -> tuple[Tensor | None, Tensor, Tensor | None]:
        """(stage input needing a grad, output to backward from, tensor to send on)."""
        index = self._record(FORWARD)
        marks: StepMarks | None = getattr(self.p2p, "marks", None)
        start = marks.clock.mark() if marks else None
        result = self._forward_op(batch, received)
        if marks:
            marks.span(f"F{index}", start, marks.clock.mark())
        return result

    def _forward_op(
        self, batch: Microbatch, received: Tensor | None
    ) -> tuple[Tensor | None, Tensor, Tensor | None]:
        inputs, targets = batch
        x: Tensor | None = None
        if self.info.is_first_stage:
            stage_input = inputs.to(self.device)
        else:
            assert received is not None
            x = received.requires_grad_()
            stage_input = x
        if not self.info.is_last_stage:
            with self.autocast():
                out = self.stage(stage_input)
            return x, out, out.detach()
        loss = self._stage_loss(stage_input, targets) / self.global_batch_size
        if self._counts[FORWARD] > self._real:  # a padding micro-batch: zero weight
            loss = loss * 0.0
        else:
            self._loss_sum += _plain(loss.detach())
        return x, loss, None

    def _stage_loss(self, stage_input: Tensor, targets: Tensor) -> Tensor:
        """The last stage's forward and summed loss: through its last layer's fused
        ``loss`` when it has one (under autocast, as that layer's forward would run),
        else ``loss_fn`` on the output, outside autocast."""
        targets = targets.to(self.device)
        fused: Callable[[Tensor, Tensor], Tensor] | None = None
        if isinstance(self.stage, StageModule):
            fused = self.stage.fused_loss(self.loss_fn)
        with self.autocast():
            out = self.stage(stage_input, but_last=True) if fused else self.stage(stage_input)
        if fused is not None:
            with self.autocast(), self.loss_context():
                return fused(out, targets)
        with self.loss_context():
            loss: Tensor = self.loss_fn(out, targets)
            return loss

    def _backward(self, x: Tensor | None, out: Tensor, grad: Tensor | None) -> Tensor | None:
        index = self._record(BACKWARD)
        marks: StepMarks | None = getattr(self.p2p, "marks", None)
        start = marks.clock.mark() if marks else None
        result = self._backward_op(x, out, grad)
        if marks:
            marks.span(f"B{index}", start, marks.clock.mark())
        return result

    def _backward_op(self, x: Tensor | None, out: Tensor, grad: Tensor | None) -> Tensor | None:
        if self.info.is_last_stage:
            with self.loss_context():
                torch.autograd.backward(out * self.loss_scale)
        else:
            assert grad is not None
            torch.autograd.backward(out, grad.to(out.dtype))
        if x is None:
            return None
        assert x.grad is not None
        return x.grad


def _widen(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.to(RESIDUAL_DTYPE)


def _plain(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t
