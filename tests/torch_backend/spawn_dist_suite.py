"""torch's own distributed test suite (``torch.testing._internal.distributed.
distributed_test``, the one torch holds gloo, nccl, mpi and ucc to) against a backend,
driven as torch's test/distributed/test_distributed_spawn.py drives it: every test
starts WORLD_SIZE processes, each given its rank, the world size and a ``file://``
rendezvous (no launcher).

    BACKEND=mcrdl WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) \\
        python tests/torch_backend/spawn_dist_suite.py -k test_all_reduce_sum

The processes are spawned, as torch's driver does; ``START_METHOD=fork`` forks them
instead (torch's former test_distributed_fork.py): a test then takes a fraction of a
second instead of several, since the ranks do not import torch and the suite again.

BACKEND=mcrdl runs mcrdl as a drop-in for gloo: the suite is the one gloo runs (its
BACKEND is "gloo" while its classes are made, since its decorators choose the tests
then, and in the test bodies, which take their CPU branches by it), and every
``init_process_group`` of the ranks, the harness's and the tests' own, that names gloo
makes an mcrdl group instead. The tests of the backend's name (NAMED) see "mcrdl". The
suite's feature table (DistTestCases.backend_feature) lists mcrdl wherever it lists
gloo, for the lookups that use the group's backend name.
"""

import os

import torch.distributed as dist
import torch.multiprocessing
from torch.testing._internal.common_distributed import DistTestCases

BACKEND = os.environ["BACKEND"]
#: the tests that check the backend's name against the suite's BACKEND
NAMED = ("test_get_backend", "test_Backend_enum_class")

if BACKEND == "mcrdl":
    import mcrdl  # noqa: F401 - registers the backend (in every spawned process too)

    for feature, backends in DistTestCases.backend_feature.items():
        if "gloo" in backends or feature == "plugin":
            backends.add("mcrdl")
    os.environ["BACKEND"] = "gloo"

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


def _as_mcrdl(test_name: str) -> None:
    """In a rank of a BACKEND=mcrdl run: init_process_group(backend="gloo") makes an
    mcrdl group."""
    init = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        if backend == "gloo":
            backend = "mcrdl"
        return init(backend, *args, **kwargs)

    dist.init_process_group = init_process_group
    if test_name in NAMED:
        os.environ["BACKEND"] = distributed_test.BACKEND = BACKEND


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if os.environ.get("START_METHOD", "spawn") == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        if BACKEND == "mcrdl":
            _as_mcrdl(test_name)
        super()._run(rank, test_name, file_name, pipe, **kwargs)


if __name__ == "__main__":
    run_tests()
