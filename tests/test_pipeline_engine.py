"""The pipeline engine's messages over each p2p backend (tests/training/check_pipe_p2p.py)."""

import os
import sys

from ._launch import mpiexec_or_skip, pythonpath, run_launcher

HERE = os.path.join(os.path.dirname(__file__), "training")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pipeline_p2p_backends_agree_with_serial():
    env = dict(os.environ, MCRDL_TIMEOUT="90", PYTHONPATH=pythonpath(ROOT))
    out = run_launcher([mpiexec_or_skip(), "-n", "3", sys.executable,
                        os.path.join(HERE, "check_pipe_p2p.py")], env=env, timeout=300)
    assert "pipeline p2p OK" in out, out
