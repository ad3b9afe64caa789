"""finalize is bounded (run under mpiexec -n 2): rank 1 reaches mcrdl.finalize() only
after sleeping DELAY_S; rank 0's finalize raises CommTimeoutError naming finalize after
twice the timeout (TIMEOUT_S, plus as much for the one backend's draining of ops in
flight on the other ranks) instead of waiting without end, and rank 1's finalize then
completes. Usage: slow_finalize.py TIMEOUT_S DELAY_S"""

import sys
import time

import mcrdl

limit, delay = float(sys.argv[1]), float(sys.argv[2])
mcrdl.init(["mpi"], timeout=limit)
rank = mcrdl.get_rank()
print(f"rank {rank}: initialized", flush=True)
if rank == 1:
    time.sleep(delay)
start = time.monotonic()
try:
    mcrdl.finalize()
    print(f"rank {rank}: finalized after {time.monotonic() - start:.2f} s", flush=True)
except mcrdl.CommTimeoutError as e:
    print(f"rank {rank}: CommTimeoutError after {time.monotonic() - start:.2f} s: {e}",
          flush=True)
assert not mcrdl.is_initialized()
