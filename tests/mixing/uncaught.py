"""An exception that rank 1 does not catch ends the job (run under mpiexec -n N, N >= 2):
mcrdl's excepthook prints the traceback and calls MPI_Abort, where the other ranks, in
a collective rank 1 never joins, would otherwise wait out the timeout (60 s here).
With "buffered", a hook chained after mcrdl's holds the traceback until it returns, as
torch.distributed's does (to prefix every line with the rank): the job must end after
that hook printed it. Usage: uncaught.py [buffered]"""

import io
import sys

import torch

import mcrdl

mcrdl.init(["mpi"], timeout=60)
if sys.argv[1:] == ["buffered"]:
    inner = sys.excepthook

    def buffered(*args):  # torch.distributed.distributed_c10d's _distributed_excepthook
        old, sys.stderr = sys.stderr, io.StringIO()
        try:
            inner(*args)
        finally:
            text, sys.stderr = sys.stderr.getvalue(), old
        sys.stderr.write("".join(f"[rank{mcrdl.get_rank()}]: {line}"
                                 for line in text.splitlines(True)))
        sys.stderr.flush()

    sys.excepthook = buffered
x = torch.ones(1)
mcrdl.all_reduce("mpi", x)
if mcrdl.get_rank() == 1:
    raise RuntimeError("not caught on rank 1")
mcrdl.all_reduce("mpi", x)
print(f"rank {mcrdl.get_rank()}: went on without rank 1", flush=True)
mcrdl.finalize()
