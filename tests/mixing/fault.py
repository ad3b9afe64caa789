"""Fault (run under mpiexec -n N): rank 1 dies mid-run (SIGKILL); the survivors must
not hang: the launcher exits non-zero well within the timeout. Usage: fault.py BACKEND"""

import os
import signal
import sys

import torch

import mcrdl

backend = sys.argv[1]
mcrdl.init([backend], timeout=float(os.environ.get("MCRDL_TIMEOUT", "10")))
rank = mcrdl.get_rank()
print(f"rank {rank}: pid {os.getpid()}", flush=True)
t = torch.ones(1000)
for it in range(100000):
    if it == 50:  # the test checks the kill, not a timeout before it, ended the loop
        os.write(1, f"rank {rank}: reached iteration 50\n".encode())
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    mcrdl.all_reduce(backend, t)
    t.fill_(1.0)
print(f"rank {rank}: loop finished, which a dead peer should have made impossible", flush=True)
