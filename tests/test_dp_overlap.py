"""DataParallelAdamW's gradient buckets (training/core/optim.py): bitwise equal to the
flatten path they replace, every bucket's all-reduce posted from the backward (a lost
overlap fails), gradients without accumulation reduced as zeros, over-accumulation
refused, --bucket-mib honoured (tests/training/check_dp_overlap.py at 2 ranks); the
bucket bounds from the model's size."""

import os
import sys

from training.core.optim import FIRST_BUCKET_BYTES, MAX_BUCKET_BYTES, bucket_bytes

from ._launch import mpiexec_or_skip, pythonpath, run_launcher

HERE = os.path.join(os.path.dirname(__file__), "training")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bucketed_overlapped_all_reduce_at_two_ranks():
    out = run_launcher([mpiexec_or_skip(), "-n", "2", sys.executable,
                        os.path.join(HERE, "check_dp_overlap.py")],
                       env=dict(os.environ, MCRDL_TIMEOUT="90", PYTHONPATH=pythonpath(ROOT)),
                       timeout=300)
    for line in ("bitwise ok", "overlap ok", "unused parameter ok", "over-accumulation ok",
                 "bucket sizes ok", "dp overlap OK"):
        assert line in out, out


def test_bucket_bounds():
    mib = 2**20
    # from the size: half the stage per later bucket, the first a quarter of that, at
    # most 1 MiB
    assert bucket_bytes(2 * mib, None) == (mib // 4, mib)
    assert bucket_bytes(20 * mib, None) == (mib, 10 * mib)
    # large models: DDP's 1 MiB first bucket and 25 MiB cap
    assert bucket_bytes(10_000 * mib, None) == (FIRST_BUCKET_BYTES, MAX_BUCKET_BYTES)
    assert bucket_bytes(10_000 * mib, None)[0] == mib
    # small ones are not one bucket: at least 64 KiB per later bucket
    first, later = bucket_bytes(100_000, None)
    assert later == 64 * 1024 and first == 16 * 1024
    # --bucket-mib wins; the first bucket still at most 1 MiB
    assert bucket_bytes(20 * mib, 4.0) == (mib, 4 * mib)
    assert bucket_bytes(20 * mib, 0.5) == (mib // 2, mib // 2)
