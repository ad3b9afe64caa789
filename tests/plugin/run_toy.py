"""Runs on every rank (mpiexec -n 3): collectives through the third-party 'toy' backend."""

import torch

import mcrdl

assert "toy" in mcrdl.available_backends(), mcrdl.available_backends()
mcrdl.init(["toy", "mpi"])
rank, size = mcrdl.get_rank(), mcrdl.get_size()

t = torch.arange(5, dtype=torch.float64) + rank
mcrdl.all_reduce("toy", t)
expect = torch.arange(5, dtype=torch.float64) * size + sum(range(size))
assert torch.equal(t, expect), (t, expect)

t = torch.full((3,), rank, dtype=torch.int32)
w = mcrdl.all_reduce("toy", t, op=mcrdl.ReduceOp.MAX, async_op=True)
assert w.wait() and w.backend == "toy" and isinstance(w, mcrdl.Work)
assert t.tolist() == [size - 1] * 3

t = torch.full((4,), rank + 10.0)
mcrdl.bcast("toy", t, src=size - 1)
assert t.tolist() == [size + 9.0] * 4

out = torch.empty(2 * size, dtype=torch.int64)
mcrdl.all_gather("toy", out, torch.tensor([rank, -rank]))
assert out.tolist() == [v for r in range(size) for v in (r, -r)], out

try:  # not in its capabilities: the message names backends that can do it
    mcrdl.all_to_all_single("toy", torch.empty(size), torch.empty(size))
    raise AssertionError("all_to_all_single on 'toy' did not raise")
except mcrdl.UnsupportedOperationError as e:
    assert "'toy'" in str(e) and "mpi" in str(e) and "gloo" in str(e), e

try:  # mcrdl's validation runs before the plug-in sees the call
    mcrdl.all_gather("toy", torch.empty(size + 1), torch.ones(1))
    raise AssertionError("bad output size on 'toy' did not raise")
except mcrdl.InvalidArgumentError as e:
    assert "'output'" in str(e), e

mcrdl.barrier("toy")
mcrdl.finalize()
print(f"rank {rank}: toy backend OK")
