"""pccl's "mpi" algorithm in both phases of a hierarchical group, blocking and async calls:
results checked, and the blocking MPI collectives its steps ran counted (tests/test_pccl.py
compares the count with MCRDL_MPI_BLOCKING). Usage: blocking_variant.py MODES, a
comma-separated list of MCRDL_MPI_BLOCKING values: each an init/finalize session in turn."""

import os
import sys

import torch

import mcrdl
from mcrdl.backends.pccl import initialized, use_algorithms


def run(op, async_op, *args):
    w = op("pccl", *args, async_op=async_op)
    if async_op:
        w.wait()


def session(mode: str) -> None:
    os.environ["MCRDL_MPI_BLOCKING"] = mode
    mcrdl.init(["pccl"])
    r, n = mcrdl.get_rank(), mcrdl.get_size()
    b = initialized()
    c = b.comm(None)
    ok = True
    with use_algorithms("mpi", "mpi"):
        for async_op in (False, True):
            for k in (1, 3, 1000):
                x = torch.full((k,), float(r + 1))
                out = torch.empty(k * n)
                run(mcrdl.all_gather, async_op, out, x)
                want = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(k)
                ok &= torch.equal(out, want)
                y = torch.ones(k * n) * (r + 1)
                o = torch.empty(k)
                run(mcrdl.reduce_scatter, async_op, o, y)
                ok &= torch.equal(o, torch.full((k,), float(n * (n + 1) // 2)))
                z = torch.full((k,), float(r))
                run(mcrdl.all_reduce, async_op, z)
                ok &= torch.equal(z, torch.full((k,), float(n * (n - 1) // 2)))
    steps = c.blocking_steps + sum(h.inter.blocking_steps for h in b._hier.values())
    layout = f"{c.nodes}x{c.ranks_per_node}"
    os.write(1, f"rank {r} mode={mode} ok={ok} blocking_steps={steps} layout={layout}\n".encode())
    mcrdl.finalize()


for mode in sys.argv[1].split(","):
    session(mode)
