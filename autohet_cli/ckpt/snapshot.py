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

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

# Host memory left free beside the buffers: the kernel, the loader's workers, the
# writer threads' own buffers. A save that would eat into it runs synchronously.
RESERVE_BYTES = 2 << 30
MEMINFO = "/proc/meminfo"


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


def available_memory_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (None: unknown)."""
    try:
        with open(MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryVerdict:
    """Whether a snapshot fits in host memory; ``reason`` says why not."""

    fits: bool
    need_bytes: int  # new buffers for every rank on this host
    available_bytes: int | None
    reason: str = ""


def memory_verdict(
    new_bytes: int,
    *,
    ranks_on_host: int,
    available_bytes: int | None,
    reserve_bytes: int = RESERVE_BYTES,
) -> MemoryVerdict:
    """Every rank of a host allocates its buffers at once (their first save), so
    each checks for all of them: ``new_bytes`` times the ranks on the host, plus a
    reserve. Unknown availability (no /proc) counts as enough."""
    need = new_bytes * max(1, ranks_on_host)
    if new_bytes == 0 or available_bytes is None or need + reserve_bytes <= available_bytes:
        return MemoryVerdict(fits=True, need_bytes=need, available_bytes=available_bytes)
    gb = 1e9
    return MemoryVerdict(
        fits=False,
        need_bytes=need,
        available_bytes=available_bytes,
        reason=(
            f"a snapshot of the training state needs {need / gb:.1f} GB of host memory "
            f"({ranks_on_host} rank(s) on this host) and {available_bytes / gb:.1f} GB is "
            f"available, {reserve_bytes / gb:.0f} GB of which stays free"
        ),
    )


def ranks_on_this_host() -> int:
    """torchrun's LOCAL_WORLD_SIZE (1 outside torchrun)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class Snapshotter:
    """Reusable host buffers for one rank's state (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}
        self._pinned: list[int] = []  # data pointers registered with CUDA

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
            self._buffers[prefix] = self._allocate(state.detach())
        buf = self._buffers[prefix]
        local_tensor(buf).copy_(src, non_blocking=src.is_cuda)
        return buf

    def _allocate(self, t: Tensor) -> Tensor:
        """A host tensor (a DTensor with a host shard for a DTensor) shaped like ``t``.
        DTensor's own ``.to("cpu")`` keeps its mesh and placements, which DCP plans
        with, so a host copy of a GPU DTensor saves like the GPU one."""
        if isinstance(t, DTensor):
            buf: Tensor = t.to("cpu", copy=True)  # a CPU DTensor would be returned as is
        else:
            buf = torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format)
        local = local_tensor(buf)
        if local_tensor(t).is_cuda and local.numel() > 0:
            self._pin(local)
        return buf

    def _pin(self, local: Tensor) -> None:
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
            self._pinned.append(local.data_ptr())

    def release(self) -> None:
        """Unpin and drop the buffers (at the end of a run)."""
        for ptr in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]
        self._pinned.clear()
        self._buffers.clear()
