"""Gloo under torchrun (env:// rendezvous, no MPI world) at 3 ranks."""

import os
import shutil
import sys

import pytest

from ._launch import run_launcher

SCRIPT = os.path.join(os.path.dirname(__file__), "torchrun", "run_gloo.py")


def test_gloo_under_torchrun():
    """Also in debug mode, whose side channel is then a Gloo process group: the two modes
    are two init/finalize sessions of one launch."""
    torchrun = os.path.join(sys.prefix, "bin", "torchrun")
    if not os.path.exists(torchrun):
        torchrun = shutil.which("torchrun")
    if not torchrun:
        pytest.skip("torchrun not found")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA"))}
    env.update(MCRDL_TIMEOUT="60")
    out = run_launcher([torchrun, "--standalone", "--nproc_per_node", "3", SCRIPT, "0,1"],
                       env=env, timeout=180)
    for debug in ("0", "1"):
        for r in range(3):
            assert f"rank {r}: debug {debug}: torchrun gloo OK" in out, out
