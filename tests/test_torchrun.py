"""Gloo under torchrun (env:// rendezvous, no MPI world) at 3 ranks."""

import os
import shutil
import sys

import pytest

from ._launch import run_launcher

SCRIPT = os.path.join(os.path.dirname(__file__), "torchrun", "run_gloo.py")


@pytest.mark.parametrize("store", ["agent", "rank 0"], ids=["agent", "rank0"])
def test_gloo_under_torchrun(store):
    """Also in debug mode, whose side channel is then a Gloo process group: the two modes
    are two init/finalize sessions of one launch, on the store of torchrun's agent and on
    one rank 0 hosts (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), both outliving a session."""
    torchrun = os.path.join(sys.prefix, "bin", "torchrun")
    if not os.path.exists(torchrun):
        torchrun = shutil.which("torchrun")
    if not torchrun:
        pytest.skip("torchrun not found")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA"))}
    env.update(MCRDL_TIMEOUT="60")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if store == "rank 0":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    debugs = ("0", "1") if store == "agent" else ("1", "0")
    out = run_launcher([torchrun, "--standalone", "--nproc_per_node", "3", SCRIPT,
                        ",".join(debugs)], env=env, timeout=180)
    for debug in debugs:
        for r in range(3):
            assert f"rank {r}: debug {debug}: torchrun gloo OK, {store} store" in out, out
