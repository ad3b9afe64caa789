"""A third-party backend, found through the mcrdl.backends entry-point group, runs
collectives at 3 ranks (tests/plugin/: the backend, its dist-info, the rank script)."""

import os
import sys

import pytest

from ._launch import mpiexec_or_skip, pythonpath, run_launcher

HERE = os.path.join(os.path.dirname(__file__), "plugin")


def test_entry_point_backend_runs_collectives():
    mpiexec = mpiexec_or_skip()
    env = dict(os.environ, PYTHONPATH=pythonpath(HERE),
               MCRDL_TIMEOUT="60")
    out = run_launcher([mpiexec, "-n", "3", sys.executable, os.path.join(HERE, "run_toy.py")],
                       env=env, timeout=180)
    for r in range(3):
        assert f"rank {r}: toy backend OK" in out


def test_register_backend_rejects_non_backend():
    import mcrdl

    with pytest.raises(TypeError):
        mcrdl.register_backend("bad", object)
    with pytest.raises(ValueError):
        mcrdl.register_backend("auto", mcrdl.Backend)
