"""The zfp guarantees the compression tests check (shared by the single-process and the
multi-rank tests; see mcrdl/fusion/compression.py and the zfp 1.0 FAQ, Q18 and Q20).

- fixed accuracy: every value within the tolerance;
- fixed precision p: per block of 4**d values, error <= k(d) * 2**(emax - p), where emax
  is the exponent of the block's largest magnitude and k(1) = 20, k(2) = 125,
  k(3) = 1125/4, k(4) = 16875/16;
- fixed rate R: every block takes round(4**d * R) bits; with the header (96 bits, or
  148 when a block takes more than 2048 bits and the mode needs its long 64-bit form)
  the stream is written in 64-bit words.
"""

from __future__ import annotations

import math

import numpy as np

K = {1: 20.0, 2: 125.0, 3: 1125.0 / 4, 4: 16875.0 / 16}


def random_data(shape, dtype, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def smooth_data(shape, dtype) -> np.ndarray:
    """A smooth field (sums of low-frequency sines) of the given shape."""
    grids = np.meshgrid(*[np.linspace(0, 1, n) for n in shape], indexing="ij")
    field = sum(np.sin(2 * math.pi * (k + 1) * g + k) for k, g in enumerate(grids))
    return (3.0 * field).astype(dtype)


def zfp_shape(shape: tuple) -> tuple:
    """The shape mcrdl gives zfp: size-1 dims dropped, up to 4 dims, more folded into
    the first."""
    shape = tuple(n for n in shape if n != 1)
    if not shape:
        return (1,)
    return tuple(shape) if len(shape) <= 4 else (math.prod(shape[:-3]), *shape[-3:])


def blocks(a: np.ndarray):
    """Index tuples of zfp's blocks of `a` (4 values per dimension, C order)."""
    starts = [range(0, n, 4) for n in a.shape]
    for corner in np.ndindex(*[len(s) for s in starts]):
        yield tuple(slice(4 * c, 4 * c + 4) for c in corner)


def precision_violations(orig: np.ndarray, got: np.ndarray, p: int) -> int:
    """Number of blocks whose max error exceeds k(d) * 2**(emax - p)."""
    a = orig.reshape(zfp_shape(orig.shape))
    b = got.reshape(a.shape)
    k = K[a.ndim]
    bad = 0
    for idx in blocks(a):
        fmax = float(np.abs(a[idx]).max())
        if fmax == 0.0:
            bad += float(np.abs(b[idx]).max()) != 0.0
            continue
        emax = math.floor(math.log2(fmax))
        bad += float(np.abs(a[idx].astype(np.float64) - b[idx]).max()) > k * 2.0 ** (emax - p)
    return bad


def block_bounds(orig: np.ndarray, mode: str, value: float) -> np.ndarray:
    """Per value of `orig`, the error bound of its zfp block (shape of `orig`): precision
    `value` p, k(d) * 2**(emax - p); rate, a share of the block's largest magnitude, 1/2
    in 1-D blocks and 1/8 in larger ones (zfp gives no bound; measured at 8 bits a value
    on normal data over 20 seeds: within 25% in 1-D blocks of 4 values, 6.5% in 2-D,
    4% in 3-D); accuracy, the tolerance `value`."""
    a = orig.reshape(zfp_shape(orig.shape)).astype(np.float64)
    out = np.zeros_like(a)
    if mode == "accuracy":
        out[...] = value
        return out.reshape(orig.shape)
    for idx in blocks(a):
        fmax = float(np.abs(a[idx]).max())
        if fmax == 0.0:
            continue
        out[idx] = (K[a.ndim] * 2.0 ** (math.floor(math.log2(fmax)) - value)
                    if mode == "precision" else fmax / (2 if a.ndim == 1 else 8))
    return out.reshape(orig.shape)


def rate_bytes(shape: tuple, rate: float, itemsize: int) -> int | None:
    """Bytes zfpy writes for an array of `shape` in fixed-rate mode, header included;
    None when a block would get fewer bits than zfp's minimum for floats (the common
    exponent plus one bit: 9 for float32, 12 for float64), where zfp cannot keep the
    rate."""
    s = zfp_shape(shape)
    d = len(s)
    per_block = round(4 ** d * rate)
    if per_block < (9 if itemsize == 4 else 12):
        return None
    nblocks = math.prod(-(-n // 4) for n in s)
    header = 32 + 52 + (12 if per_block <= 2048 else 64)  # magic, field, mode
    bits = header + nblocks * per_block
    return -(-bits // 64) * 8
