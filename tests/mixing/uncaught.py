"""An exception that rank 1 does not catch ends the job (run under mpiexec -n N, N >= 2):
mcrdl's excepthook prints the traceback and calls MPI_Abort, where the other ranks, in
a collective rank 1 never joins, would otherwise wait out the timeout (60 s here)."""

import torch

import mcrdl

mcrdl.init(["mpi"], timeout=60)
x = torch.ones(1)
mcrdl.all_reduce("mpi", x)
if mcrdl.get_rank() == 1:
    raise RuntimeError("not caught on rank 1")
mcrdl.all_reduce("mpi", x)
print(f"rank {mcrdl.get_rank()}: went on without rank 1", flush=True)
mcrdl.finalize()
