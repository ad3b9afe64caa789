"""Per-op cost of N small async all_reduces posted, then all waited, at two values of N
in one run: rank 0 prints ``ratio <cost at the larger N / cost at the smaller>``.

argv: "mpi4py" (the program imports mpi4py.MPI before mcrdl, so MPI is initialized
without mcrdl's MPICH selection) or "mcrdl" (mcrdl initializes MPI); then the two
counts (default 32 512) and the trials (default 9). The counts alternate trial by trial
(so a change in the machine's load falls on both), each trial's time is the maximum over
the ranks, and each count's cost is the median of its trials.
"""

import sys
import time

if sys.argv[1] == "mpi4py":
    from mpi4py import MPI

    import mcrdl
else:
    import mcrdl
    from mcrdl.bootstrap import mpi_module

    mcrdl.init(["mpi"])
    MPI = mpi_module()

import numpy as np  # noqa: E402
import torch  # noqa: E402

small, large = (int(a) for a in (sys.argv[2:4] if len(sys.argv) > 3 else (32, 512)))
trials = int(sys.argv[4]) if len(sys.argv) > 4 else 9
if not mcrdl.is_initialized():
    mcrdl.init(["mpi"])
sync = MPI.COMM_WORLD.Dup()
tensors = [torch.ones(256) for _ in range(large)]  # 1 KiB each


def burst(n: int) -> float:
    """Seconds per op of n async all_reduces posted, then waited (max over ranks)."""
    sync.Barrier()
    start = time.perf_counter()
    works = [mcrdl.all_reduce("mpi", t, async_op=True) for t in tensors[:n]]
    for w in works:
        w.wait()
    took = np.array([(time.perf_counter() - start) / n])
    sync.Allreduce(MPI.IN_PLACE, took, op=MPI.MAX)
    return float(took[0])


for n in (small, large):  # warm-up
    burst(n)
costs = {small: [], large: []}
for _ in range(trials):
    for n in (small, large):
        costs[n].append(burst(n))
per_op = {n: float(np.median(c)) for n, c in costs.items()}
if sync.Get_rank() == 0:
    print(f"{small}: {per_op[small] * 1e6:.2f} us/op  {large}: {per_op[large] * 1e6:.2f} us/op",
          flush=True)
    print(f"ratio {per_op[large] / per_op[small]:.3f}", flush=True)
sync.Free()
mcrdl.finalize()
