"""Deterministic inputs and numpy reference results for the multi-rank conformance tests.

Every input is a pure function of (seed, rank, key), so each rank can rebuild every other
rank's input and compute the expected result locally with numpy, independently of
mcrdl and torch.distributed.
"""

from __future__ import annotations

import functools
import math
import os
import zlib

import numpy as np
import torch

SEED = int(os.environ.get("MCRDL_TEST_SEED", "20240531"))

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")
FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("int8", "uint8", "int32", "int64")
SHAPES = ((0,), (1,), (7,), (1000,), (3, 5), (2, 0, 3))

FLOAT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
INT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
BOOL_OPS = INT_OPS

# Unit roundoff (half an ulp, relative) of each floating dtype: 2**-p for p significand bits.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24,
                 "float64": 2.0**-53}


def avg_rtol(dtype: str) -> float:
    """Relative bound of an AVG result against the float64 reference (sum / n).

    The sum of values() inputs is exact (see check_reduced), so the error is the
    division's alone: up to two roundings in the working precision (float32 for
    float16/bfloat16, which then round once more to the dtype; a division written as a
    multiplication by 1/n rounds twice), plus the float64 reference's own rounding.
    """
    work = "float32" if dtype in ("float16", "bfloat16") else dtype
    final = UNIT_ROUNDOFF[dtype] if work != dtype else 0.0
    return 2 * UNIT_ROUNDOFF[work] + final + UNIT_ROUNDOFF["float64"]


def tdtype(name: str) -> torch.dtype:
    """Torch dtype of a dtype name."""
    return getattr(torch, name)


def itemsize(name: str) -> int:
    """Bytes per element of a dtype name."""
    return torch.empty((), dtype=tdtype(name)).element_size()


def ops_for(dtype: str) -> tuple[str, ...]:
    """ReduceOp names valid for a dtype."""
    if dtype in FLOATS:
        return FLOAT_OPS
    return BOOL_OPS if dtype == "bool" else INT_OPS


def numel(shape) -> int:
    """Number of elements of a shape."""
    return math.prod(shape)


def rng(*key) -> np.random.Generator:
    """Generator seeded by SEED and a key of str()-able parts (stable across processes)."""
    return np.random.default_rng([SEED] + [zlib.crc32(repr(k).encode()) for k in key])


def _from_bytes(raw: np.ndarray, dtype: str, shape) -> torch.Tensor:
    if raw.size == 0:
        return torch.empty(tuple(shape), dtype=tdtype(dtype))
    return torch.from_numpy(raw).view(tdtype(dtype)).reshape(shape)


def data(dtype: str, shape, rank: int, *key) -> torch.Tensor:
    """Random-bit tensor (any bit pattern, NaNs included; 0/1 for bool) for data movement."""
    n = numel(shape)
    g = rng("data", dtype, tuple(shape), rank, *key)
    if dtype == "bool":
        raw = g.integers(0, 2, size=n, dtype=np.uint8)
    else:
        raw = g.integers(0, 256, size=n * itemsize(dtype), dtype=np.uint8)
    return _from_bytes(raw, dtype, shape)


def elems(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a tensor as an array of shape (numel, itemsize): bit-exact comparisons."""
    t = t.detach().contiguous().reshape(-1)
    if t.numel() == 0:
        return np.empty((0, t.element_size()), dtype=np.uint8)
    return t.view(torch.uint8).numpy().reshape(t.numel(), t.element_size()).copy()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors have the same shape, dtype and bits."""
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(elems(a), elems(b))


def assert_bits(got, expected, what: str = "") -> None:
    """Assert bit equality (tensors, or (numel, itemsize) byte arrays from elems) tersely."""
    if isinstance(got, torch.Tensor):
        if got.shape != expected.shape or got.dtype != expected.dtype:
            raise AssertionError(f"{what}: got {got.dtype}{tuple(got.shape)}, expected "
                                 f"{expected.dtype}{tuple(expected.shape)}")
        got, expected = elems(got), elems(expected)
    if got.shape != expected.shape:
        raise AssertionError(f"{what}: got {got.shape[0]} elements, expected {expected.shape[0]}")
    bad = np.flatnonzero((got != expected).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise AssertionError(
            f"{what}: bits differ at {bad.size} of {got.shape[0]} elements; first at flat index "
            f"{i}: got 0x{got[i][::-1].tobytes().hex()}, expected "
            f"0x{expected[i][::-1].tobytes().hex()}")


def values(dtype: str, op: str, shape, rank: int, *key) -> torch.Tensor:
    """Small-valued input for a reduction with `op`, so results are exact and never overflow."""
    n = numel(shape)
    g = rng("values", dtype, op, tuple(shape), rank, *key)
    if dtype == "bool":
        p = {"PRODUCT": 0.85, "MIN": 0.85, "BAND": 0.85, "BXOR": 0.5}.get(op, 0.25)
        arr = g.random(n) < p
    elif op in ("BAND", "BOR", "BXOR") or (op in ("MIN", "MAX") and dtype in INTS):
        raw = g.integers(0, 256, size=n * itemsize(dtype), dtype=np.uint8)
        return _from_bytes(raw, dtype, shape)
    elif op in ("MIN", "MAX"):
        arr = g.standard_normal(n) * 100.0
    elif op == "PRODUCT":
        arr = g.choice(np.array([1, 2] if dtype == "uint8" else [-2, -1, 1, 2]), size=n)
    else:  # SUM, AVG
        arr = g.integers(0, 9, size=n) if dtype == "uint8" else g.integers(-4, 5, size=n)
    return torch.from_numpy(np.ascontiguousarray(arr)).to(tdtype(dtype)).reshape(shape)


def as_ref(t: torch.Tensor) -> np.ndarray:
    """Numpy view of a reduction operand: float64 for floating types, native dtype otherwise."""
    t = t.detach()
    if t.dtype.is_floating_point:
        return t.to(torch.float64).numpy().copy()
    return t.numpy().copy()


_INT_FN = {
    "SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
    "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor,
}
_BOOL_FN = {
    "SUM": np.logical_or, "MAX": np.logical_or, "BOR": np.logical_or,
    "PRODUCT": np.logical_and, "MIN": np.logical_and, "BAND": np.logical_and,
    "BXOR": np.logical_xor,
}


def reduce_ref(dtype: str, op: str, arrays: list[np.ndarray]) -> np.ndarray:
    """Numpy reduction of per-rank operands (from as_ref) in group order."""
    if dtype == "bool":
        return functools.reduce(_BOOL_FN[op], arrays)
    if dtype in FLOATS:
        if op == "AVG":
            return functools.reduce(np.add, arrays) / len(arrays)
        return functools.reduce(_INT_FN[op], arrays)
    with np.errstate(over="ignore"):
        return functools.reduce(_INT_FN[op], arrays)  # wraps like the dtype


def check_reduced(t: torch.Tensor, dtype: str, op: str, expected: np.ndarray) -> None:
    """Assert a reduction result equals the reference: exactly, except a floating AVG
    (within avg_rtol). values() makes every other result exact in its dtype whatever the
    order of accumulation: a SUM of at most 8 ranks' integers in [-4, 4], a PRODUCT of
    factors +-1 and +-2, MIN/MAX picking an input; the reference is checked to be
    representable, so an input change that breaks this fails here, not as a loose match."""
    assert t.dtype == tdtype(dtype), f"dtype changed to {t.dtype}"
    got = as_ref(t)
    assert got.shape == expected.shape, f"shape {got.shape} != {expected.shape}"
    if dtype in FLOATS and op == "AVG":
        np.testing.assert_allclose(got, expected, rtol=avg_rtol(dtype), atol=0)
        return
    if dtype in FLOATS:
        in_dtype = torch.from_numpy(expected).to(tdtype(dtype)).to(torch.float64).numpy()
        assert np.array_equal(in_dtype, expected, equal_nan=True), (
            f"{op} reference not exact in {dtype}: the inputs must keep float results exact")
    np.testing.assert_array_equal(got, expected.astype(got.dtype))


def layout(counts: list[int], mode: str):
    """(displs argument, total elements, effective displs) for the v variants.

    mode "none": packed, displs=None; "packed": explicit prefix sums; "gapped": blocks in
    reverse rank order with gaps of 2 elements (before, between and after).
    """
    prefix = [sum(counts[:k]) for k in range(len(counts))]
    if mode == "none":
        return None, sum(counts), prefix
    if mode == "packed":
        return list(prefix), sum(counts), prefix
    displs = [0] * len(counts)
    pos = 2
    for k in reversed(range(len(counts))):
        displs[k] = pos
        pos += counts[k] + 2
    return list(displs), pos, displs


# A value whose spacing in the dtype is 2 (1 + 1 is exact, big + 1 rounds back to big),
# per 16-bit float dtype: the exact sum big + 1 + 1 over 3 ranks is representable.
HALF_BIG = {"float16": 2048.0, "bfloat16": 256.0}


def half_sum_inputs(dtype: str, rank: int) -> torch.Tensor:
    """Rank `rank`'s input: HALF_BIG where i % 3 == rank, 1 elsewhere (30 elements), so
    whatever fixed order a reduction combines 3 ranks in, some element meets HALF_BIG + 1
    in its first addition, which the dtype rounds back to HALF_BIG."""
    i = torch.arange(30)
    return torch.where(i % 3 == rank, HALF_BIG[dtype], 1.0).to(tdtype(dtype))
