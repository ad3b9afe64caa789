"""Pure-Python (mpi4py) reference of the PCCL algorithms of csrc/pccl.cpp: ring and
recursive doubling all-gather, ring and recursive halving reduce-scatter, each for any
process count (the first 2 (p - p2) ranks fold in pairs before and unfold after).

Same steps, same partners, same reduction order as the C++ version, so the two agree
bit for bit (on integer data always; on floating data too, since every reduction is
``acc = acc (op) received`` in the same order). Used by the tests to cross-check the C++
implementation and by ``benchmarks/pccl.py`` to measure what C++ buys.

Buffers are flat numpy arrays (``tensor.numpy()`` of a CPU tensor shares its memory).
"""

from __future__ import annotations

import numpy as np

_REDUCE = {
    "sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}


class _Fold:
    def __init__(self, p: int):
        self.p2 = 1 << (p.bit_length() - 1)
        self.rem = p - self.p2

    def survivor(self, r: int) -> int:
        if r < 2 * self.rem:
            return r // 2 if r % 2 == 0 else -1
        return r - self.rem

    def rank_of(self, s: int) -> int:
        return 2 * s if s < self.rem else s + self.rem

    def lo(self, s: int) -> int:
        return 2 * s if s < self.rem else s + self.rem

    def hi(self, s: int) -> int:
        return 2 * s + 2 if s < self.rem else s + self.rem + 1


def _exchange(comm, sends, recvs, tag: int) -> None:
    """Post every receive and send of one step, then wait for all."""
    from mpi4py import MPI

    reqs = [comm.Irecv(buf, source=src, tag=tag) for buf, src in recvs]
    reqs += [comm.Isend(buf, dest=dst, tag=tag) for buf, dst in sends]
    MPI.Request.Waitall(reqs)


def _check_algo(op: str, algo: str) -> None:
    if algo not in ("ring", "rd"):
        raise ValueError(f"{op}: algo must be 'ring' or 'rd', got {algo!r}")


def _fold_in(comm, f: _Fold, r: int, odd_sends: np.ndarray, even_receives: np.ndarray,
             tag: int) -> bool:
    """The fold step of recursive doubling/halving: in each of the first ``f.rem`` pairs
    of ranks (2i, 2i + 1) the odd rank sends `odd_sends` to the even one, which receives
    it into `even_receives`. True on the ranks that received."""
    if r >= 2 * f.rem:
        return False
    if r % 2:
        _exchange(comm, [(odd_sends, r - 1)], [], tag)
        return False
    _exchange(comm, [], [(even_receives, r + 1)], tag)
    return True


def all_gather(comm, buf: np.ndarray, n: int, algo: str, tag: int = 0) -> None:
    """All-gather of p blocks of n elements in `buf`, this rank's block already in place."""
    p, r = comm.Get_size(), comm.Get_rank()
    blk = lambda lo, hi: buf[lo * n:hi * n]  # noqa: E731
    if p == 1:
        return
    _check_algo("all_gather", algo)
    if algo == "ring":
        right, left = (r + 1) % p, (r - 1) % p
        for k in range(p - 1):
            sb, rb = (r - k) % p, (r - k - 1) % p
            _exchange(comm, [(blk(sb, sb + 1), right)], [(blk(rb, rb + 1), left)], tag)
        return
    f = _Fold(p)
    me = f.survivor(r)
    _fold_in(comm, f, r, blk(r, r + 1), blk(r + 1, r + 2), tag)
    if me >= 0:
        d = 1
        while d < f.p2:
            other = me ^ d
            mine, theirs = me & ~(d - 1), other & ~(d - 1)
            peer = f.rank_of(other)
            _exchange(comm, [(blk(f.lo(mine), f.hi(mine + d - 1)), peer)],
                      [(blk(f.lo(theirs), f.hi(theirs + d - 1)), peer)], tag)
            d *= 2
    if r < 2 * f.rem:
        if r % 2:
            _exchange(comm, [], [(blk(0, r), r - 1), (blk(r + 1, p), r - 1)], tag)
        else:
            _exchange(comm, [(blk(0, r + 1), r + 1), (blk(r + 2, p), r + 1)], [], tag)


def reduce_scatter(comm, acc: np.ndarray, out: np.ndarray, n: int, op: str, algo: str,
                   tag: int = 0) -> None:
    """Reduce-scatter of p blocks of n elements: `acc` (overwritten as the work buffer)
    holds this rank's input; its reduced block ends in `out`."""
    p, r = comm.Get_size(), comm.Get_rank()
    red = _REDUCE[op]
    blk = lambda a, lo, hi: a[lo * n:hi * n]  # noqa: E731
    tmp = np.empty_like(acc)
    if p == 1:
        out[:] = blk(acc, 0, 1)
        return
    _check_algo("reduce_scatter", algo)
    if algo == "ring":
        right, left = (r + 1) % p, (r - 1) % p
        t = blk(tmp, 0, 1)
        for k in range(p - 1):
            sb, rb = (r - k - 1) % p, (r - k - 2) % p
            _exchange(comm, [(blk(acc, sb, sb + 1), right)], [(t, left)], tag)
            a = blk(acc, rb, rb + 1)
            red(a, t, out=a)
        out[:] = blk(acc, r, r + 1)
        return
    f = _Fold(p)
    me = f.survivor(r)
    if _fold_in(comm, f, r, blk(acc, 0, p), blk(tmp, 0, p), tag):
        red(acc, tmp, out=acc)
    if me < 0:
        _exchange(comm, [], [(out, r - 1)], tag)
        return
    base, d = 0, f.p2 // 2
    while d >= 1:
        other = me ^ d
        peer = f.rank_of(other)
        lower = (me & d) == 0
        keep0, send0 = (base, base + d) if lower else (base + d, base)
        klo, khi = f.lo(keep0), f.hi(keep0 + d - 1)
        slo, shi = f.lo(send0), f.hi(send0 + d - 1)
        _exchange(comm, [(blk(acc, slo, shi), peer)], [(blk(tmp, klo, khi), peer)], tag)
        a = blk(acc, klo, khi)
        red(a, blk(tmp, klo, khi), out=a)
        base = keep0
        d //= 2
    if me < f.rem:
        _exchange(comm, [(blk(acc, r + 1, r + 2), r + 1)], [], tag)
    out[:] = blk(acc, r, r + 1)
