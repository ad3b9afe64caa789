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

# Relative tolerance of float reductions (float16/bfloat16 accumulate in float32, round once).
RTOL = {"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-5, "float64": 1e-12}


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
    """Assert a reduction result equals the reference (floats within RTOL for sums/products)."""
    assert t.dtype == tdtype(dtype), f"dtype changed to {t.dtype}"
    got = as_ref(t)
    assert got.shape == expected.shape, f"shape {got.shape} != {expected.shape}"
    if dtype in FLOATS and op not in ("MIN", "MAX"):
        np.testing.assert_allclose(got, expected, rtol=RTOL[dtype], atol=1e-6)
    else:
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
