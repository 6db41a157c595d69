"""Consecutive groups of tensors under a byte budget (pure): the files of an export
and the slices of a full-gradient sync are both cut this way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class _Sized(Protocol):
    def numel(self) -> int: ...


T = TypeVar("T", bound=_Sized)


def consecutive_groups(items: Sequence[T], max_bytes: int, itemsize: int) -> list[list[T]]:
    """Consecutive groups under ``max_bytes`` each (a larger item gets a group alone)."""
    groups: list[list[T]] = [[]]
    size = 0
    for item in items:
        nbytes = item.numel() * itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups
