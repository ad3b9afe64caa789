"""A bcast whose ranks disagree on its size, outside debug mode (run under mpiexec -n N,
N >= 2; ranks 0 and 1 in a group of their own): MPI reports a truncated message to the
receiver, and mcrdl's error says what the likeliest cause is and how to check it. On
the blocking path (MCRDL_MPI_BLOCKING=always) that is MPI_Bcast's own error; on the
nonblocking one the request's ("See the MPI_ERROR field in MPI_Status", no more)."""

import os

import torch

import mcrdl

mcrdl.init(["mpi"], timeout=30)
rank = mcrdl.get_rank()
pair = mcrdl.new_group([0, 1])
mode = os.environ.get("MCRDL_MPI_BLOCKING", "auto")
if rank in (0, 1):
    try:
        mcrdl.bcast("mpi", torch.ones(8 if rank == 0 else 4), src=0, group=pair)
        print(f"rank {rank}: mismatch ({mode}): no error", flush=True)
    except mcrdl.MCRDLError as e:
        text = " ".join(str(e).split())
        print(f"rank {rank}: mismatch ({mode}): {type(e).__name__}: {text}", flush=True)
mcrdl.finalize()
