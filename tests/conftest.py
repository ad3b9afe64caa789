"""Root test configuration."""

import os

# Multi-rank tests (tests/dist) run only under mpiexec, via tests/test_dist_launch.py
# or by hand with MCRDL_DIST_TEST=1; plain `pytest tests` does not collect them.
collect_ignore = [] if os.environ.get("MCRDL_DIST_TEST") == "1" else ["dist"]
