"""mcrdl-info and the cray-mpich backend class (single process)."""

import json
import subprocess
import sys

from mcrdl.backends.cray_mpich import is_cray_mpich, recommended_env


def test_mcrdl_info_lists_every_backend_with_a_reason():
    out = subprocess.run([sys.executable, "-m", "mcrdl.tools.info", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    info = json.loads(out)
    b = info["backends"]
    assert {"mpi", "gloo", "nccl", "rccl", "pccl", "cray-mpich"} <= set(b)
    for name, entry in b.items():
        assert entry["available"] or entry["why"], name  # every unavailable one says why
    assert b["pccl"]["available"] and b["pccl"]["ops"] == 3
    assert not b["cray-mpich"]["available"]
    assert "not Cray MPICH" in b["cray-mpich"]["why"] and "'mpi'" in b["cray-mpich"]["why"]
    c = info["cpus"]  # the single process's own view of its node
    assert c["mask"] >= 1 and c["node"] >= c["mask"] and c["ranks_spread_over"] >= c["mask"]
    assert c["oversubscribed"] is False
    # a singleton MPI world fits its cores: mcrdl's MPICH selection, named by its digest
    sel = info["mpich_coll_selection"]
    assert sel.startswith("mcrdl:") if "MPICH" in info["mpi"] else sel == "", info
    text = subprocess.run([sys.executable, "-m", "mcrdl.tools.info"], capture_output=True,
                          text=True, timeout=120, check=True).stdout
    assert "cray-mpich" in text and "unavailable" in text and "pccl" in text
    assert "cpus: " in text and "a core each or more" in text, text


def test_cray_mpich_detection_and_settings():
    assert is_cray_mpich("MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)")
    assert not is_cray_mpich("MPICH Version:      5.0.2")
    assert not is_cray_mpich("Open MPI v5.0.3")
    assert recommended_env({}) == {"MPICH_GPU_SUPPORT_ENABLED": "1",
                                   "MPICH_OFI_NIC_POLICY": "GPU"}
    assert recommended_env({"MPICH_GPU_SUPPORT_ENABLED": "1",
                            "MPICH_OFI_NIC_POLICY": "NUMA"}) == {}
