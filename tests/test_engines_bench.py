"""benchmarks/engines.py: a reduced run (2 ranks, 2 steps, one round) passes the parity
step and prints its table, chart and per-engine lines (no speed assertion: the figures
depend on the machine). It launches six mpiexec jobs, so it runs with MCRDL_TEST_FULL=1."""

import os
import pathlib
import re
import subprocess
import sys

from ._launch import FULL, mpiexec_or_skip

ROOT = pathlib.Path(__file__).resolve().parent.parent


@FULL
def test_reduced_benchmark_runs_and_passes_parity(tmp_path):
    mpiexec_or_skip()
    png = tmp_path / "engines.png"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engines.py"), "--ranks", "2",
         "--steps", "2", "--warmup", "0", "--rounds", "1", "--parity-steps", "2",
         "--png", str(png)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=dict(os.environ, MCRDL_TEST_FULL="0"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for peer in ("ddp-gloo", "ddp-mcrdl"):
        assert re.search(rf"parity {peer}: .* ok$", text, re.M), text
        assert re.search(rf"^{peer} +\d+", text, re.M), text
    assert re.search(r"^engines: pipeline-data \d+\.\d+x best peer \(ddp-(gloo|mcrdl)\)$",
                     text, re.M), text
    assert png.stat().st_size > 0
