"""Run on every rank (mpiexec -n 3): "auto" follows a crafted tuning table.

The table says: mpi wins all_reduce up to 1 KiB and gloo above; gloo wins all_gather
everywhere at 3 ranks; pccl wins reduce_scatter. Async works report the backend that
ran them."""

import sys

import torch

import mcrdl

mcrdl.init(["mpi", "gloo", "pccl"], tuning_table=sys.argv[1])
n = mcrdl.get_size()
small, large = torch.ones(16), torch.ones(4096)  # 64 B and 16 KiB
w = mcrdl.all_reduce("auto", small, async_op=True)
w.wait()
assert w.backend == "mpi", w.backend
w = mcrdl.all_reduce("auto", large, async_op=True)
w.wait()
assert w.backend == "gloo", w.backend
assert torch.all(small == n) and torch.all(large == n)
out = torch.empty(4 * n)
w = mcrdl.all_gather("auto", out, torch.ones(4), async_op=True)
w.wait()
assert w.backend == "gloo", w.backend
piece = torch.empty(4)
w = mcrdl.reduce_scatter("auto", piece, torch.ones(4 * n), async_op=True)
w.wait()
assert w.backend == "pccl", w.backend
assert torch.all(piece == n), piece
w = mcrdl.bcast("auto", small, async_op=True)  # no data for bcast: the fixed rule ("mpi")
w.wait()
assert w.backend == "mpi", w.backend
try:  # bad arguments still raise the right error through "auto"
    mcrdl.all_reduce("auto", torch.ones(4, 2).t())
    raise AssertionError("no error")
except mcrdl.InvalidArgumentError:
    pass
mcrdl.finalize()
print("auto routing OK")
