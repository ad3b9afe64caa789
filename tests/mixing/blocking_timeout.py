"""The blocking MPI path's timeout (run under mpiexec -n N, N >= 2): rank 0 never joins a
small blocking all_reduce. Under MCRDL_MPI_BLOCKING=always the other ranks' watchdog
prints the CommTimeoutError text and ends the job with MPI_Abort; under "never" they
raise CommTimeoutError (its text printed, to compare). "async" waits on an async op
instead, which raises CommTimeoutError in every mode; rank 0 then waits for the others
through idle_rank.py. "pccl" runs the all_reduce on pccl instead of "mpi" (with
MCRDL_PCCL_INTER=mpi its MPI collectives follow MCRDL_MPI_BLOCKING). "late=S" (pccl,
2 ranks) has rank 0 join the all_reduce's first phase alone, S s late, by calling the
reduce_scatter that phase is: the blocking all-gather phase after it then has only what
is left of the timeout.
Usage: blocking_timeout.py TIMEOUT_S [async] [pccl] [late=S]"""

import os
import sys
import time

import torch
from idle_rank import done, wait_for_others

import mcrdl

limit = float(sys.argv[1])
use_async = "async" in sys.argv[2:]
backend = "pccl" if "pccl" in sys.argv[2:] else "mpi"
late = [float(a.split("=", 1)[1]) for a in sys.argv[2:] if a.startswith("late=")]
mcrdl.init([backend], timeout=limit)
rank = mcrdl.get_rank()
print(f"rank {rank}: pid {os.getpid()}", flush=True)
mcrdl.all_reduce(backend, torch.ones(4))  # a healthy op first: sequence number 1
if rank != 0:
    print(f"rank {rank}: calling at {time.time():.3f}", flush=True)
    start = time.monotonic()
    try:
        if use_async:
            mcrdl.all_reduce(backend, torch.ones(4), async_op=True).wait()
        else:
            mcrdl.all_reduce(backend, torch.ones(4))
        raise AssertionError("all_reduce without rank 0 returned")
    except mcrdl.CommTimeoutError as e:
        print(f"rank {rank}: raised after {time.monotonic() - start:.2f} s: "
              f"CommTimeoutError: {e}", flush=True)
    done(rank)
else:
    if late:  # the first phase of a 4-element all_reduce over 2 ranks: 2 elements each
        time.sleep(late[0])
        mcrdl.reduce_scatter(backend, torch.empty(2), torch.ones(4))
        print(f"rank 0: joined the first phase at {time.time():.3f}", flush=True)
    # past the others' timeout and the 5 s the tests allow for the job's end (an abort
    # ends this wait: no rank is through then)
    wait_for_others(mcrdl.get_size() - 1, limit + 5, limit + 5)
    print("rank 0: skipped the collective", flush=True)
mcrdl.finalize()
print(f"rank {rank}: finalized", flush=True)
