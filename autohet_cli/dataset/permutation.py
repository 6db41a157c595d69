"""A keyed pseudo-random permutation of ``[0, n)``, evaluated one position at a time.

Shuffling training samples means a permutation of ``[0, num_samples)`` per epoch.
``torch.randperm`` / ``numpy.random.permutation`` would materialise it: 8 GB for a
billion samples, rebuilt at every epoch and on every rank. We need only the few
hundred positions of one global batch, so we evaluate a permutation *function*:

- a balanced **Feistel network** of ``ROUNDS`` rounds over ``2 * half_bits`` bits,
  the smallest even width with ``2 ** (2 * half_bits) >= n``. Each round maps
  ``(L, R) -> (R, L ^ F(R, k_i))``; that is invertible whatever ``F`` is, so the
  network is a bijection of ``[0, 4 ** half_bits)``. ``F`` is the splitmix64
  finaliser of ``R ^ k_i`` cut to ``half_bits``; the round keys ``k_i`` come from
  a SHA-256 of the key parts, so (seed, epoch) picks the permutation.
- **cycle-walking** restricts it to ``[0, n)``: a value that lands at ``>= n`` is
  encrypted again until it lands inside. Following the permutation's cycle from
  an in-range start must come back in range, so this is a bijection of
  ``[0, n)``; since ``4 ** half_bits < 4 * n`` it takes under 4 tries on average.

Four rounds of a good round function are the classic Luby-Rackoff construction;
we need statistical mixing, not cryptographic strength. Written with numpy
uint64 arithmetic (which wraps modulo 2**64) so a batch of positions is a few
vector operations and no Python loop per sample.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

ROUNDS = 4
MAX_HALF_BITS = 31  # sizes up to 2**62: the halves and their mixing fit in uint64

_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def round_keys(*parts: object) -> tuple[int, ...]:
    """``ROUNDS`` 64-bit keys from SHA-256 of the parts (e.g. a purpose, the seed, the epoch)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return tuple(int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(ROUNDS))


@dataclass(frozen=True, slots=True)
class FeistelPermutation:
    """Bijection of ``[0, size)`` picked by ``keys``; call it on an array of positions."""

    size: int
    keys: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.size <= 1 << (2 * MAX_HALF_BITS):
            raise ValueError(f"permutation size {self.size} is outside [1, 2**62]")
        if len(self.keys) != ROUNDS:
            raise ValueError(f"a Feistel permutation needs {ROUNDS} round keys")

    @classmethod
    def keyed(cls, size: int, *parts: object) -> FeistelPermutation:
        return cls(size, round_keys(*parts))

    @property
    def half_bits(self) -> int:
        return max(1, ((self.size - 1).bit_length() + 1) // 2)

    def __call__(self, positions: ArrayLike) -> NDArray[np.int64]:
        """The images of ``positions`` (integers in ``[0, size)``), same shape, int64."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.size):
            raise ValueError(f"positions must lie in [0, {self.size})")
        out = self._encrypt(pos.astype(np.uint64))
        outside = out >= self.size
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.size
        return out.astype(np.int64)

    def _encrypt(self, x: NDArray[np.uint64]) -> NDArray[np.uint64]:
        bits = np.uint64(self.half_bits)
        mask = np.uint64((1 << self.half_bits) - 1)
        left, right = x >> bits, x & mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ np.uint64(key)) & mask)
        result: NDArray[np.uint64] = (left << bits) | right
        return result


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64's finaliser: every input bit flips about half the output bits."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX_1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX_2
    result: NDArray[np.uint64] = x ^ (x >> np.uint64(31))
    return result
