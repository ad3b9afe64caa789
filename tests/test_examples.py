"""The examples under examples/ run as documented (CPU backends)."""

import os
import sys

import pytest

from ._launch import mpiexec_or_skip, run_launcher

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples")


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_listing3_overlap(backend):
    out = run_launcher([mpiexec_or_skip(), "-n", "2", sys.executable,
                        os.path.join(EXAMPLES, "listing3_overlap.py"), backend],
                       env=dict(os.environ, MCRDL_TIMEOUT="60"), timeout=180)
    assert f"{backend}, 2 ranks: compute" in out and "overlapped" in out, out
    assert out.count("all_reduce results OK") == 2, out  # every sum checked


def test_listing4_two_backends():
    out = run_launcher([mpiexec_or_skip(), "-n", "4", sys.executable,
                        os.path.join(EXAMPLES, "listing4_two_backends.py")],
                       env=dict(os.environ, MCRDL_TIMEOUT="60"), timeout=180)
    for r in range(4):
        assert f"rank {r}: all_reduce on mpi and all_to_all_single on gloo completed" in out
