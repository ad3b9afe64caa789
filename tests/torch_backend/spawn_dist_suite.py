"""torch's own distributed test suite (``torch.testing._internal.distributed.
distributed_test``, the one torch holds gloo, nccl, mpi and ucc to) against a backend,
driven as torch's test/distributed/test_distributed_spawn.py drives it: every test
spawns WORLD_SIZE processes, each given its rank, the world size and a ``file://``
rendezvous (no launcher).

    BACKEND=mcrdl WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) \\
        python tests/torch_backend/spawn_dist_suite.py -k test_all_reduce_sum

For BACKEND=mcrdl the suite's feature table (DistTestCases.backend_feature) lists mcrdl
wherever it lists gloo, before the suite is imported (its skip decorators read the table
when the classes are made), so that mcrdl is held to the tests gloo runs.
"""

import os

from torch.testing._internal.common_distributed import DistTestCases

if os.environ.get("BACKEND") == "mcrdl":
    import mcrdl  # noqa: F401 - registers the backend (in every spawned process too)

    for feature, backends in DistTestCases.backend_feature.items():
        if "gloo" in backends or feature == "plugin":
            backends.add("mcrdl")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
