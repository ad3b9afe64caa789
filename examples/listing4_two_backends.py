"""MCR-DL paper, Listing 4: two backends in flight at once, waited in either order.

    mpiexec -n 4 python examples/listing4_two_backends.py

An all_to_all_single on "gloo" and an all_reduce on "mpi" are issued back to back
(different order on odd and even ranks) and waited in opposite orders; neither wait
blocks the other backend, so there is no deadlock. Results are checked.
"""

import torch

import mcrdl

mcrdl.init(["mpi", "gloo"])
rank, size = mcrdl.get_rank(), mcrdl.get_size()

grads = torch.full((1 << 20,), float(rank))
tokens = torch.arange(size * 4, dtype=torch.float32) + 100 * rank
routed = torch.empty_like(tokens)

if rank % 2 == 0:
    w_ar = mcrdl.all_reduce("mpi", grads, async_op=True)
    w_a2a = mcrdl.all_to_all_single("gloo", routed, tokens, async_op=True)
    w_ar.wait()
    w_a2a.wait()
else:
    w_a2a = mcrdl.all_to_all_single("gloo", routed, tokens, async_op=True)
    w_ar = mcrdl.all_reduce("mpi", grads, async_op=True)
    w_a2a.wait()
    w_ar.wait()

assert torch.all(grads == sum(range(size)))
expect = torch.cat([torch.arange(rank * 4, rank * 4 + 4, dtype=torch.float32) + 100 * r
                    for r in range(size)])
assert torch.equal(routed, expect)
print(f"rank {rank}: all_reduce on {w_ar.backend} and all_to_all_single on {w_a2a.backend} "
      "completed, results correct")
mcrdl.finalize()
