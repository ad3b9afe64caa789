"""Root test configuration."""

import os

import pytest

from ._launch import gpus_visible, hide_gpus, pythonpath

# Every process the tests start loads tests/_site/sitecustomize.py, which makes its exit
# skip the collection of what is still alive (0.6 s of CPU per process: see there).
# Helpers that set PYTHONPATH extend this one (tests._launch.pythonpath).
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
if _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = pythonpath(_SITE)

# Multi-rank tests (tests/dist) run only under mpiexec, via tests/test_dist_launch.py
# or by hand with MCRDL_DIST_TEST=1; plain `pytest tests` does not collect them.
collect_ignore = [] if os.environ.get("MCRDL_DIST_TEST") == "1" else ["dist"]


@pytest.fixture(autouse=True, scope="session")
def _children_environment(tmp_path_factory):
    """The environment of the processes the tests start (ranks, launchers).

    - Their temporary files (torchrun's logs, mpiexec's topology file, the training
      checks' outputs) go under this session's pytest folder, which pytest prunes (it
      keeps the last 3 sessions'), not into /tmp.
    - One OpenMP thread per process unless OMP_NUM_THREADS is set (torchrun's default;
      for mpiexec, the usual one rank per core): worlds of 2 to 8 ranks share this
      machine's 2 cores, where torch's default of a thread per core made the training
      checks about 8% slower.
    - They see no GPU (tests._launch.hide_gpus): the CPU suite is the same on a GPU
      machine; tests/test_gpu.py makes the GPUs visible to its own launches. This
      process keeps seeing them where CUDA was initialized before (CUDA reads the
      variables once; test_gpu.py's collection initializes it).

    The ranks of tests/dist run pytest too and inherit their launcher's environment."""
    if os.environ.get("MCRDL_DIST_TEST") == "1":
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("processes")))
        if "OMP_NUM_THREADS" not in os.environ:
            mp.setenv("OMP_NUM_THREADS", "1")
        hide_gpus()
        yield
        gpus_visible()
