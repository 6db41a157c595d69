"""Snapshots: a rank's training state copied into host memory, so that its files are
written while training goes on (the blocking half of an asynchronous save).

The buffers are allocated at the first save and reused by every later one (a
training state keeps its shapes); on a GPU they are page-locked, so the copy runs
at the link's speed and without a sync per tensor (one synchronize at the end).
Allocating and pinning is slow (10.7 s for 14.8 GB on an H100 host), copying into
pinned buffers is not (0.27 s): only the first save pays the allocation.

Why not DCP's own staging (``async_save``, ``BlockingAsyncStager``): across the
torch releases we admit it differs (2.5 caches only unpinned-or-pinned by a writer
object tied to one path, 2.9+ has its own stager options), it pins unconditionally
where it caches (which fails on a CPU-only torch), and it cannot say beforehand how
much host memory a save needs, which is what decides here between an asynchronous
save and a synchronous one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def local_tensor(t: Tensor) -> Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(t: Tensor) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()


def _tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _tensors(value, f"{prefix}/{key}")
    elif isinstance(state, Tensor):
        yield prefix, state


def state_bytes(state: Any) -> int:
    """Bytes of every tensor this rank holds in ``state`` (what its files will hold)."""
    return sum(tensor_bytes(t) for _, t in _tensors(state))


class Snapshotter:
    """Reusable host buffers for one rank's state (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}
        self._pinned: dict[str, int] = {}  # buffer key -> data pointer registered with CUDA
        self.last_alloc_s = 0.0  # of the latest take: allocating (and pinning) new buffers

    def new_bytes(self, state: Any) -> int:
        """Bytes a snapshot of ``state`` would allocate (0 once the buffers exist)."""
        return sum(tensor_bytes(t) for key, t in _tensors(state) if not self._fits(key, t))

    def _fits(self, key: str, t: Tensor) -> bool:
        buf = self._buffers.get(key)
        if buf is None:
            return False
        a, b = local_tensor(buf), local_tensor(t)
        return a.shape == b.shape and a.dtype == b.dtype and type(buf) is type(t)

    def take(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this snapshotter's host buffers.
        Non-tensor values are kept as they are (the trainer builds them afresh for
        every save, and DCP pickles them)."""
        cuda_seen = [False]
        self.last_alloc_s = 0.0
        out = self._copy(state, "", cuda_seen)
        if cuda_seen[0]:
            torch.cuda.synchronize()  # the copies were non-blocking
        return out

    def _copy(self, state: Any, prefix: str, cuda_seen: list[bool]) -> Any:
        if isinstance(state, dict):
            return {k: self._copy(v, f"{prefix}/{k}", cuda_seen) for k, v in state.items()}
        if not isinstance(state, Tensor):
            return state
        src = local_tensor(state.detach())
        if src.is_cuda:
            cuda_seen[0] = True
        if not self._fits(prefix, state):
            self._unpin(prefix)  # a buffer of another shape goes: its pages are unlocked first
            started = time.perf_counter()
            self._buffers[prefix] = self._allocate(state.detach(), prefix)
            self.last_alloc_s += time.perf_counter() - started
        buf = self._buffers[prefix]
        local_tensor(buf).copy_(src, non_blocking=src.is_cuda)
        return buf

    def _allocate(self, t: Tensor, key: str = "") -> Tensor:
        """A host tensor (a DTensor with a host shard for a DTensor) shaped like ``t``.
        DTensor's own ``.to("cpu")`` keeps its mesh and placements, which DCP plans
        with, so a host copy of a GPU DTensor saves like the GPU one."""
        if isinstance(t, DTensor):
            buf: Tensor = t.to("cpu", copy=True)  # a CPU DTensor would be returned as is
        else:
            buf = torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format)
        local = local_tensor(buf)
        if local_tensor(t).is_cuda and local.numel() > 0:
            self._pin(key, local)
        return buf

    def _pin(self, key: str, local: Tensor) -> None:
        """Page-lock ``local`` in place (what torch's own stager does), so copies from
        the GPU are asynchronous DMA; a failure leaves it pageable (slower, correct)."""
        err = int(
            torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                local.data_ptr(),
                local.numel() * local.element_size(),
                1,  # cudaHostRegisterPortable
            )
        )
        if err == 0:
            self._pinned[key] = local.data_ptr()

    def _unpin(self, key: str) -> None:
        ptr = self._pinned.pop(key, None)
        if ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]

    def release(self) -> None:
        """Unpin and drop the buffers (at the end of a run, or before a synchronous save)."""
        for key in list(self._pinned):
            self._unpin(key)
        self._buffers.clear()
