"""GPU paths (NCCL stream lanes), world size 1. Skipped where no CUDA device exists."""

import os
import sys

import pytest
import torch

from ._launch import mpiexec_or_skip, run_launcher

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device (torch.cuda.is_available() is False): the nccl/rccl lanes and "
    "the GPU examples run only on a GPU machine",
)
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples")


def test_listing3_overlap_on_nccl():
    out = run_launcher([mpiexec_or_skip(), "-n", "1", sys.executable,
                        os.path.join(EXAMPLES, "listing3_overlap.py"), "nccl"], timeout=300)
    assert "nccl, 1 ranks: compute" in out, out


def test_listing4_nccl_and_mpi():
    out = run_launcher([mpiexec_or_skip(), "-n", "1", sys.executable,
                        os.path.join(EXAMPLES, "listing4_two_backends.py"), "--gpu"],
                       timeout=300)
    assert "all_reduce on nccl and all_to_all_single on mpi completed" in out, out


def test_nccl_ops_world_of_one():
    out = run_launcher([mpiexec_or_skip(), "-n", "1", sys.executable,
                        os.path.join(os.path.dirname(__file__), "gpu", "nccl_ops.py")],
                       timeout=300)
    assert "nccl ops OK" in out, out
