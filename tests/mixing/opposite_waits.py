"""Two backends in flight at once, issued and waited in opposite orders on neighbouring
ranks (run under mpiexec -n N). Under a single-thread design that progresses a backend
only while waiting on it, rank 0 (waiting on MPI, whose peer is blocked in Gloo) and
rank 1 (waiting on Gloo, whose peer is blocked in MPI) deadlock."""

import torch

import mcrdl

mcrdl.init(["mpi", "gloo"], timeout=60)
rank, size = mcrdl.get_rank(), mcrdl.get_size()
for it in range(200):
    n = 1 + (it * 7919) % 70000
    a = torch.full((n,), float(rank + it))
    b = torch.full((n,), rank + it, dtype=torch.int64)
    if rank % 2 == 0:
        wm = mcrdl.all_reduce("mpi", a, async_op=True)
        wg = mcrdl.all_reduce("gloo", b, async_op=True)
        wm.wait()
        wg.wait()
    else:
        wg = mcrdl.all_reduce("gloo", b, async_op=True)
        wm = mcrdl.all_reduce("mpi", a, async_op=True)
        wg.wait()
        wm.wait()
    total = sum(range(size)) + size * it
    assert torch.all(a == total) and torch.all(b == total), (it, a[:3], b[:3])
    # a blocking call on one backend while the other backend's op is still in flight
    c = torch.full((3,), float(rank))
    if rank % 2 == 0:
        w = mcrdl.bcast("mpi", c, src=size - 1, async_op=True)
        mcrdl.barrier("gloo")
    else:
        w = mcrdl.barrier("gloo", async_op=True)
        mcrdl.bcast("mpi", c, src=size - 1)
    w.wait()
    assert torch.all(c == size - 1), c
mcrdl.finalize()
print(f"rank {rank}: opposite waits OK")
