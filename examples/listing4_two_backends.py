"""MCR-DL paper, Listing 4: two backends in flight at once, waited in either order.

    mpiexec -n 4 python examples/listing4_two_backends.py          # CPU: mpi + gloo
    mpiexec -n 1 python examples/listing4_two_backends.py --gpu    # GPU: nccl + mpi

An all_to_all_single on one backend and an all_reduce on another are issued back to back
(different order on odd and even ranks) and waited in opposite orders; neither wait
blocks the other backend, so there is no deadlock. Results are checked.
"""

import sys

import torch

import mcrdl

gpu = "--gpu" in sys.argv
AR, A2A = ("nccl", "mpi") if gpu else ("mpi", "gloo")
mcrdl.init([AR, A2A])
rank, size = mcrdl.get_rank(), mcrdl.get_size()
local_rank = mcrdl.launch.detect().local_rank  # the GPU backends use this rank's GPU
device = (torch.device("cuda", local_rank % torch.cuda.device_count()) if gpu
          else torch.device("cpu"))

grads = torch.full((1 << 20,), float(rank), device=device)
tokens = torch.arange(size * 4, dtype=torch.float32) + 100 * rank
routed = torch.empty_like(tokens)

if rank % 2 == 0:
    w_ar = mcrdl.all_reduce(AR, grads, async_op=True)
    w_a2a = mcrdl.all_to_all_single(A2A, routed, tokens, async_op=True)
    w_ar.wait()
    w_a2a.wait()
else:
    w_a2a = mcrdl.all_to_all_single(A2A, routed, tokens, async_op=True)
    w_ar = mcrdl.all_reduce(AR, grads, async_op=True)
    w_a2a.wait()
    w_ar.wait()

assert torch.all(grads == sum(range(size))).item()
expect = torch.cat([torch.arange(rank * 4, rank * 4 + 4, dtype=torch.float32) + 100 * r
                    for r in range(size)])
assert torch.equal(routed, expect)
print(f"rank {rank}: all_reduce on {w_ar.backend} and all_to_all_single on {w_a2a.backend} "
      "completed, results correct")
mcrdl.finalize()
