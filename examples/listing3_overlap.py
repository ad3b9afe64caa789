"""MCR-DL paper, Listing 3: overlap an async all_reduce with independent compute.

    mpiexec -n 2 python examples/listing3_overlap.py            # CPU, backend "mpi"
    mpiexec -n 2 python examples/listing3_overlap.py gloo
    mpiexec -n 1 python examples/listing3_overlap.py nccl       # GPU: NCCL stream lane

The all-reduce runs on the backend's lane (MPI: mcrdl's progress thread; Gloo: its own
threads) while this thread multiplies matrices; prints compute alone, communication
alone, and both overlapped, so the overlap is visible as overlapped < alone sum.
"""

import sys
import time

import torch

import mcrdl

backend = sys.argv[1] if len(sys.argv) > 1 else "mpi"
mcrdl.init([backend])
rank, size = mcrdl.get_rank(), mcrdl.get_size()
gpu = backend in ("nccl", "rccl")
local_rank = mcrdl.launch.detect().local_rank  # the GPU backends use this rank's GPU
device = (torch.device("cuda", local_rank % torch.cuda.device_count()) if gpu
          else torch.device("cpu"))
torch.set_num_threads(1)

# "gradients": each rank's own value, so that the sums can be checked at the end
grad = torch.full(((64 if gpu else 8) * 1024 * 1024 // 4,), float(rank + 1), device=device)
n = 4096 if gpu else 384
a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)


def sync():
    if gpu:
        torch.cuda.synchronize(device)


def compute():
    for _ in range(20):
        a @ b


def timed(fn, reps=5):
    best = float("inf")
    for _ in range(reps):
        mcrdl.barrier(backend)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def comm():
    mcrdl.all_reduce(backend, grad)


def overlapped():
    work = mcrdl.all_reduce(backend, grad, async_op=True)  # Listing 3: issue ...
    compute()                                              # ... compute meanwhile ...
    work.wait()                                            # ... then wait (on GPUs: the
                                                           # current stream waits)


REPS = 5
t_comp, t_comm = timed(compute, REPS), timed(comm, REPS)
t_both = timed(overlapped, REPS)
# 2 x REPS all_reduces: the first summed the ranks' values (size (size + 1) / 2), each
# later one multiplied that by size (exact in float32 at these sizes)
want = size * (size + 1) / 2 * size ** (2 * REPS - 1)
ok = bool(torch.all(grad == want))
if rank == 0:
    print(f"{backend}, {size} ranks: compute {t_comp * 1e3:.1f} ms, all_reduce "
          f"{t_comm * 1e3:.1f} ms, overlapped {t_both * 1e3:.1f} ms "
          f"(serial sum {(t_comp + t_comm) * 1e3:.1f} ms)")
print(f"rank {rank}: all_reduce results {'OK' if ok else 'WRONG'}", flush=True)
mcrdl.finalize()
sys.exit(0 if ok else 1)
