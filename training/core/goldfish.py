"""The Goldfish loss (Hans et al., "Be like a Goldfish, Don't Memorize!", 2024): a target
token leaves the loss when a hash of the ``h`` tokens before it selects it, 1 in ``k``.

The mask is a function of token ids alone: the target at position ``p`` of a split is
dropped when ``hash(data[p-h:p]) % k == 0``. A passage that recurs anywhere in the data
(a repeated document) is therefore masked the same way at every occurrence, so the
model never sees its dropped tokens as targets and cannot reproduce the passage
verbatim, and every rank, data-parallel split and layout drops the same targets
(``Batches`` reads the ``h`` tokens before each window from the split, whatever the
window's offset). Positions before the split's start count as a sentinel token.

The hash is a multiply-xor chain over the ``h`` ids finished by splitmix64's mixer, in
wrapping uint64 arithmetic: fixed across numpy versions and platforms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: The target of a token outside the loss (F.cross_entropy's default ignore_index).
IGNORE_INDEX = -100

_MULT = np.uint64(0x9E3779B97F4A7C15)
_SENTINEL = np.uint64(0xFFFFFFFFFFFFFFFF)  # a "token" before the split's first


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (wrapping uint64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class Goldfish:
    """Drop 1 in ``k`` targets by the hash of the ``h`` tokens before each."""

    k: int
    h: int = 13

    def __post_init__(self):
        if self.k < 2:
            raise ValueError(f"--goldfish-k {self.k}: expected 2 or more (1 in k targets "
                             "leaves the loss; k=1 would drop every target)")
        if self.h < 1:
            raise ValueError(f"--goldfish-h {self.h}: expected 1 or more preceding tokens")

    def dropped(self, data: np.ndarray, first: int, n: int) -> np.ndarray:
        """Bool [n]: whether the targets at positions ``first .. first+n-1`` of `data` (a
        split's token ids) leave the loss."""
        h = self.h
        lo = first - h
        context = np.asarray(data[max(0, lo):first + n - 1], dtype=np.uint64)
        if lo < 0:
            context = np.concatenate([np.full(-lo, _SENTINEL, np.uint64), context])
        acc = np.zeros(n, np.uint64)
        for i in range(h):  # position p's context: context[p - first + i], i < h
            acc = _mix((acc * _MULT) ^ context[i:i + n])
        return acc % np.uint64(self.k) == 0

    def mask_rows(self, data: np.ndarray, offsets, block_size: int) -> np.ndarray:
        """Bool [len(offsets), block_size]: the dropped targets of the windows starting at
        `offsets` (a window's targets are positions ``o+1 .. o+block_size``)."""
        return np.stack([self.dropped(data, int(o) + 1, block_size) for o in offsets])

    def describe(self) -> str:
        return f"Goldfish loss k={self.k}, h={self.h}"
