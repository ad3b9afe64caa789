"""init's first collective is bounded by its timeout: rank 1 calls mcrdl.init LATE_S
seconds after the others, past their timeout. Those raise CommTimeoutError naming init
(before, they waited in MPI_Comm_dup until rank 1 came). Usage: late_init.py TIMEOUT_S
LATE_S"""

import sys
import time

import torch  # noqa: F401  (before mcrdl, as users import it)
from mpi4py import MPI

import mcrdl

limit, late = float(sys.argv[1]), float(sys.argv[2])
rank = MPI.COMM_WORLD.Get_rank()
print(f"rank {rank}: pid started", flush=True)
if rank == 1:
    time.sleep(late)
start = time.monotonic()
try:
    mcrdl.init(["mpi"], timeout=limit)
    print(f"rank {rank}: init returned after {time.monotonic() - start:.2f} s", flush=True)
except mcrdl.CommTimeoutError as e:
    print(f"rank {rank}: raised after {time.monotonic() - start:.2f} s: {e}", flush=True)
    sys.exit(3)
