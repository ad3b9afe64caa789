"""zfp compression: the guarantees of each mode on the blocks mcrdl sends (single
process), and every compressed operation on a real 3-rank world over mpi and gloo
(tests/fusion/compression_ranks.py)."""

import os
import re
import sys

import numpy as np
import pytest
import torch

import mcrdl
from mcrdl.extensions.compression import _RAW, _ZFP, decode, encode

from ._launch import import_or_skip, mpiexec_or_skip, pythonpath, run_launcher

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fusion"))
import zfp_checks  # noqa: E402

import_or_skip("zfpy")

# (1, 256) and (32, 1, 24): size-1 dims are dropped (as given, zfp did not shrink them)
SHAPES = [(1000,), (37,), (64, 48), (9, 10, 11), (2, 3, 4, 5, 6), (1, 256), (32, 1, 24)]
DTYPES = [np.float32, np.float64]


def roundtrip(a: np.ndarray, **mode) -> tuple[np.ndarray, torch.Tensor]:
    block = encode(torch.from_numpy(a), mode)
    out = torch.empty(a.shape, dtype=torch.from_numpy(a).dtype)
    decode(block, out, "test")
    return out.numpy(), block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tol", [1e-1, 1e-3, 1e-6])
def test_fixed_accuracy_keeps_every_value_within_the_tolerance(dtype, tol):
    for k, shape in enumerate(SHAPES):
        for name, a in (("random", zfp_checks.random_data(shape, dtype, k)),
                        ("smooth", zfp_checks.smooth_data(shape, dtype))):
            got, block = roundtrip(a, tolerance=tol)
            err = float(np.abs(got.astype(np.float64) - a).max())
            assert err <= tol, (name, shape, dtype, tol, err)
            if name == "smooth" and tol >= 1e-3 and a.size >= 64:
                assert int(block[0]) == _ZFP and block.numel() < a.nbytes / 2, (name, shape)
            elif int(block[0]) == _RAW:  # zfp would not shrink it: sent exactly
                assert np.array_equal(got, a), (name, shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", [8, 14, 20])
def test_fixed_precision_error_bound_per_block(dtype, precision):
    for k, shape in enumerate(SHAPES):
        for name, a in (("random", zfp_checks.random_data(shape, dtype, k)),
                        ("smooth", zfp_checks.smooth_data(shape, dtype) * 1e3)):
            got, block = roundtrip(a, precision=precision)
            assert zfp_checks.precision_violations(a, got, precision) == 0, (name, shape)
            if name == "smooth" and precision <= 14 and a.size >= 64:  # zfp shrinks these
                assert int(block[0]) == _ZFP and block.numel() < a.nbytes, (name, shape)
            if int(block[0]) == _RAW:  # sent exactly when zfp does not shrink it
                assert np.array_equal(got, a)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rate", [2, 4.5, 8, 16])
def test_fixed_rate_gives_the_exact_size(dtype, rate):
    for k, shape in enumerate(SHAPES):
        a = zfp_checks.random_data(shape, dtype, k)
        got, block = roundtrip(a, rate=rate)
        expect = zfp_checks.rate_bytes(shape, rate, a.itemsize)
        if expect is not None and expect < a.nbytes:
            assert int(block[0]) == _ZFP and block.numel() == 1 + expect, (shape, rate)
        elif int(block[0]) == _RAW:  # zfp would not shrink it: sent exactly
            assert np.array_equal(got, a), (shape, rate)
        else:  # below zfp's minimum rate for this block shape: no size guarantee
            assert expect is None and np.abs(got - a).max() < 1e-3, (shape, rate)
    big = zfp_checks.random_data((64, 64), dtype, 1)
    _, block = roundtrip(big, rate=rate)
    bits_per_value = (block.numel() - 1) * 8 / big.size
    assert abs(bits_per_value - rate) < 0.05, bits_per_value


def test_non_finite_and_empty_blocks_are_sent_exactly():
    a = np.array([1.0, np.nan, -np.inf, 3.5, 2.0, 0.0], dtype=np.float32)
    got, block = roundtrip(a, tolerance=1e-3)
    assert int(block[0]) == _RAW and np.array_equal(got, a, equal_nan=True)
    empty = torch.empty(0)
    assert encode(empty, {"rate": 8}).numel() == 0
    decode(torch.empty(0, dtype=torch.uint8), empty, "test")
    with pytest.raises(mcrdl.DesyncError, match="received 3 float32 values where 5"):
        decode(encode(torch.ones(3), {"rate": 8}), torch.empty(5), "test")


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_zfp_cannot_keep_are_sent_exactly(dtype):
    """Magnitudes near the float maximum (zfp decoded some as Inf) and tolerances finer
    than a subnormal block's zeros go raw; just below the limit zfp keeps every mode's
    guarantee; all-subnormal blocks decode as zeros in the other modes, an error below
    the smallest normal value."""
    info = np.finfo(dtype)
    limit = 2.0 ** (info.maxexp - 2)
    rng = np.random.default_rng(3)
    for shape in ((1024,), (32, 32), (8, 8, 16)):
        near = (rng.uniform(-1, 1, shape) * 2.0 ** (info.maxexp - 1)).astype(dtype)
        near.flat[0] = np.nextafter(dtype(2.0 ** (info.maxexp - 1)), dtype(0))
        for mode in ({"rate": 4}, {"precision": 1}, {"precision": 2}, {"tolerance": 1e-3}):
            got, block = roundtrip(near, **mode)
            assert int(block[0]) == _RAW and np.array_equal(got, near), (shape, mode)
        below = (near / 2).astype(dtype)  # under the limit: zfp takes it, all finite
        below.flat[0] = np.nextafter(dtype(limit), dtype(0))
        for mode in ({"rate": 4}, {"precision": 1}, {"precision": 8}):
            got, block = roundtrip(below, **mode)
            assert int(block[0]) == _ZFP and np.isfinite(got).all(), (shape, mode)
            if "precision" in mode:
                assert zfp_checks.precision_violations(below, got, mode["precision"]) == 0
    sub = (rng.uniform(-1, 1, (256,)) * info.tiny).astype(dtype)
    got, block = roundtrip(sub, tolerance=float(info.tiny) / 8)
    assert int(block[0]) == _RAW and np.array_equal(got, sub)
    for mode in ({"tolerance": float(info.tiny)}, {"precision": 16}, {"rate": 16}):
        got, _ = roundtrip(sub, **mode)
        assert float(np.abs(got.astype(np.float64) - sub).max()) <= info.tiny, mode


def test_compression_config_checks_its_fields():
    for kwargs, word in (({"mode": "lossless"}, "mode"), ({"mode": "rate"}, "needs 'rate'"),
                         ({"mode": "rate", "rate": 0}, "rate"),
                         ({"mode": "accuracy", "tolerance": 1e-3, "rate": 8}, "'rate' is set"),
                         ({"mode": "precision", "precision": 2.5}, "precision"),
                         ({"mode": "precision", "precision": 65}, "64 bit planes"),
                         ({"mode": "rate", "rate": 8, "ops": {"reduce"}}, "ops"),
                         # a compressed send alone delivered its size message as data
                         ({"mode": "rate", "rate": 8, "ops": {"send", "bcast"}},
                          "'send' without 'recv'"),
                         ({"mode": "rate", "rate": 8, "ops": {"recv"}},
                          "'recv' without 'send'")):
        with pytest.raises(mcrdl.InvalidArgumentError, match=re.escape(word)):
            mcrdl.CompressionConfig(**kwargs)
    with pytest.raises(mcrdl.InvalidArgumentError, match="say which zfp mode"):
        mcrdl.configure(compression=True)
    assert mcrdl.CompressionConfig("precision", precision=16).zfp_args() == {"precision": 16}


def test_compressed_operations_on_three_ranks():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = run_launcher([mpiexec_or_skip(), "-n", "3", sys.executable,
                        os.path.join(os.path.dirname(__file__), "fusion",
                                     "compression_ranks.py")], env=env, timeout=240)
    assert "compression OK" in out, out
    for mode in ("rate", "precision", "accuracy"):
        m = re.search(rf"{mode}\s.*wire/raw (\d\.\d+)", out)
        assert m and 0 < float(m.group(1)) < 1, (mode, out)
    print(out[out.index("# compressed"):])
