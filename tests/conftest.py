"""Root test configuration."""

import os

from ._launch import pythonpath

# Every process the tests start loads tests/_site/sitecustomize.py, which makes its exit
# skip the collection of what is still alive (0.6 s of CPU per process: see there).
# Helpers that set PYTHONPATH extend this one (tests._launch.pythonpath).
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
if _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = pythonpath(_SITE)

# Multi-rank tests (tests/dist) run only under mpiexec, via tests/test_dist_launch.py
# or by hand with MCRDL_DIST_TEST=1; plain `pytest tests` does not collect them.
collect_ignore = [] if os.environ.get("MCRDL_DIST_TEST") == "1" else ["dist"]
