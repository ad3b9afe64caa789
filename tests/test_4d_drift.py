"""The 4D engine step by step against the serial run on the 4-rank grids that mix a
tensor axis with a sharded or replicated one: losses, the clip's global gradient norm
and the step-1 gradients per parameter, to tolerances derived from fp32
(tests/training/check_4d_drift.py states the derivation)."""

import os
import re
import sys

from ._launch import mpiexec_or_skip, pythonpath, run_launcher

HERE = os.path.join(os.path.dirname(__file__), "training")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRIDS = ("2,1,2,1", "2,1,1,2", "1,1,2,2", "2,2,1,1")


def test_4d_steps_follow_the_serial_run():
    """4 ranks, (x2, z2), (x2, d2), (z2, d2), (x2, y2), 10 steps of a 2-block GPT with
    every step clipped: each step's loss within 1e-6 of the serial run's, the global
    norm within 1e-5, step 1's gradients per tensor within 4.3e-5 of their scale. A
    norm counting a replicated piece on every rank (7e-1 off), one counting the column
    shards at half weight (1.1e-2 off, the 1e-5 loss drift of a peer built that way)
    or a replicated gradient not summed over Z (5.7e-1 off) fail it."""
    env = dict(os.environ, MCRDL_TIMEOUT="120", PYTHONPATH=pythonpath(ROOT),
               OMP_NUM_THREADS="1")
    out = run_launcher([mpiexec_or_skip(), "-n", "4", sys.executable,
                        os.path.join(HERE, "check_4d_drift.py"), "--grids", ";".join(GRIDS),
                        "--steps", "10", "--check"], env=env, timeout=600)
    assert "4d drift OK" in out, out
    for grid in GRIDS:
        shown = "(" + ", ".join(grid.split(",")) + ")"
        m = re.search(rf"{re.escape(shown)}: 10 steps, loss rel <= (\S+), norm rel <= "
                      r"(\S+), step-1 grads rel <= (\S+), 10 clipped", out)
        assert m, (grid, out)
        loss, norm, grad = (float(v.rstrip(",")) for v in m.groups())
        assert loss <= 1e-6 and norm <= 1e-5 and grad <= 4.3e-5, (grid, m.group(0))
