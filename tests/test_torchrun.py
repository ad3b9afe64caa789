"""Gloo under torchrun (env:// rendezvous, no MPI world) at 3 ranks."""

import os
import shutil
import sys

import pytest

from ._launch import run_launcher

SCRIPT = os.path.join(os.path.dirname(__file__), "torchrun", "run_gloo.py")


@pytest.mark.parametrize("debug", ["0", "1"])
def test_gloo_under_torchrun(debug):
    """Also in debug mode, whose side channel is then a Gloo process group."""
    torchrun = os.path.join(sys.prefix, "bin", "torchrun")
    if not os.path.exists(torchrun):
        torchrun = shutil.which("torchrun")
    if not torchrun:
        pytest.skip("torchrun not found")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA"))}
    env.update(MCRDL_TIMEOUT="60", MCRDL_DEBUG=debug)
    out = run_launcher([torchrun, "--standalone", "--nproc_per_node", "3", SCRIPT], env=env,
                       timeout=180)
    for r in range(3):
        assert f"rank {r}: torchrun gloo OK" in out, out
