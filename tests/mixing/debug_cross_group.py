"""Debug mode keeps the ordering rule per (backend, group) (run with MCRDL_DEBUG=1 under
mpiexec -n N, N >= 2): even ranks issue a collective on group A (async) and then one on
group B (blocking) of the same backend, odd ranks B first (blocking) and then A. Valid
(every group sees one order on every rank), so it must complete; an agreement check
serialized per backend instead would hold B behind A on the even ranks while the odd
ones wait in B: a deadlock, here a CommTimeoutError after the short timeout.
BACKENDS is a comma-separated list, checked in turn in one init.
Usage: debug_cross_group.py BACKENDS [TIMEOUT_S]"""

import os
import sys
import time

import torch

import mcrdl

assert os.environ.get("MCRDL_DEBUG") == "1"
backends = sys.argv[1].split(",")
limit = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
mcrdl.init(backends, timeout=limit)
rank, size = mcrdl.get_rank(), mcrdl.get_size()
everyone = list(range(size))
expect = float(sum(range(size)))
for backend in backends:
    pairs = [(None, mcrdl.new_group(everyone)),  # world and a group of the same ranks
             (mcrdl.new_group(everyone), mcrdl.new_group(list(reversed(everyone))))]
    start = time.monotonic()
    for k, (a, b) in enumerate(pairs):
        ta, tb = torch.full((4,), float(rank)), torch.full((8,), float(rank))
        if rank % 2 == 0:
            wa = mcrdl.all_reduce(backend, ta, group=a, async_op=True)
            mcrdl.all_reduce(backend, tb, group=b)
            wa.wait()
        else:
            mcrdl.all_reduce(backend, tb, group=b)
            mcrdl.all_reduce(backend, ta, group=a)
        assert ta.eq(expect).all() and tb.eq(expect).all(), (backend, k, ta, tb)
    mcrdl.barrier(backend)
    print(f"rank {rank}: cross-group order OK on {backend} in "
          f"{time.monotonic() - start:.2f} s", flush=True)
mcrdl.finalize()
