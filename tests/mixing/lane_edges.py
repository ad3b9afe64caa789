"""Edges of the mpi backend's lanes (run under mpiexec -n 2 with MCRDL_MPI_BLOCKING=always,
so that small async collectives run as blocking MPI calls on the issue thread):

- a send posted after an async collective of the blocking variant reaches MPI at once,
  not behind that collective: rank 0 sends what rank 1 must receive before it joins the
  collective (a send queued behind it deadlocked both ranks);
- async ops issued under torch.inference_mode() and waited outside it write their
  results (a cast back, AVG's division, list outputs: their finish step ran on the lane
  thread, outside inference mode, and raised on inference tensors);
- a timeout too large for the clock (1e10 s, inf) bounds nothing rather than expiring
  at once; a NaN or negative wait timeout is refused;
- the process exits without mcrdl.finalize() with an unmatched async recv in flight on
  rank 0: its lane is stopped before MPI is finalized (the lane thread went on testing
  the request under MPI_Finalize and crashed the process).
Prints "rank R: lane edges OK"."""

import torch

import mcrdl

mcrdl.init(["mpi"], timeout=1e10)
rank, size = mcrdl.get_rank(), mcrdl.get_size()
assert size == 2, "run with 2 ranks"

# timeouts beyond the clock: the nonblocking path (4 MiB + 1 KiB) completes
big = torch.ones((1 << 20) + 256)
mcrdl.all_reduce("mpi", big)
w = mcrdl.all_reduce("mpi", big, async_op=True)
assert w.wait(timeout=float("inf"))
assert torch.all(big == 4), big[:4]
for bad in (float("nan"), -1.0):
    try:
        w.wait(timeout=bad)
        raise AssertionError(f"wait(timeout={bad}) accepted")
    except mcrdl.InvalidArgumentError as e:
        assert "'timeout'" in str(e), e
mcrdl.init(["mpi"], timeout=30)

# a send after an async collective of the blocking variant
for _ in range(3):
    t, x = torch.ones(4), torch.zeros(4)
    if rank == 0:
        w = mcrdl.all_reduce("mpi", t, async_op=True)
        mcrdl.send("mpi", torch.full((4,), 7.0), dst=1)
        w.wait()
    else:
        mcrdl.recv("mpi", x, src=0)
        assert torch.all(x == 7), x
        mcrdl.all_reduce("mpi", t)
    assert torch.all(t == 2), t

# async ops made in inference mode, waited outside it
with torch.inference_mode():
    half = torch.full((8,), float(rank + 1), dtype=torch.float16)
    avg = torch.full((8,), float(rank))
    outs = [torch.empty(8) for _ in range(size)]
    works = [mcrdl.all_reduce("mpi", half, async_op=True),
             mcrdl.all_reduce("mpi", avg, op=mcrdl.ReduceOp.AVG, async_op=True),
             mcrdl.all_gather("mpi", outs, torch.full((8,), float(rank)), async_op=True)]
for w in works:
    w.wait()
assert torch.all(half == 3), half
assert torch.all(avg == 0.5), avg
assert all(torch.all(o == r) for r, o in enumerate(outs)), outs

mcrdl.barrier("mpi")
if rank == 0:  # nothing ever matches it
    pending = mcrdl.recv("mpi", torch.empty(4), src=1, tag=99, async_op=True)
print(f"rank {rank}: lane edges OK", flush=True)
# no mcrdl.finalize(): the exit hook stops the lane before MPI is finalized
