"""Every operation through "nccl" on CUDA tensors at world size 1, async and blocking,
plus the stream semantics: wait() orders the caller's stream without a host sync.

At one rank every collective copies its input: each output starts as a sentinel that
differs from the input everywhere, so an op that writes nothing fails."""

import torch

import mcrdl

mcrdl.init(["nccl"])
dev = torch.device("cuda", mcrdl.launch.detect().local_rank % torch.cuda.device_count())
ok = []


def sentinel(x: torch.Tensor) -> torch.Tensor:
    """A tensor like `x` that differs from it in every element."""
    return x.logical_not() if x.dtype == torch.bool else x + 7


for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.bool):
    x = (torch.arange(10, device=dev) % 2).to(dt)
    y = x.clone()
    mcrdl.all_reduce("nccl", y)
    assert torch.equal(y, x), (dt, y)
    out = sentinel(x)
    w = mcrdl.all_gather("nccl", out, x, async_op=True)
    w.wait()
    assert torch.equal(out, x) and w.backend == "nccl", (dt, out)
    y = x.clone()
    mcrdl.bcast("nccl", y, src=0)
    assert torch.equal(y, x), (dt, y)
    out = sentinel(x)
    mcrdl.reduce_scatter("nccl", out, x.clone())
    assert torch.equal(out, x), (dt, out)
    out = sentinel(x)
    mcrdl.all_to_all_single("nccl", out, x)
    assert torch.equal(out, x), (dt, out)
    ok.append(str(dt))
# wait() on a side stream orders that stream after the op: the all_gather's output is
# read by the next kernel on the stream, with no host synchronization in between (were
# it not ordered, the multiply would read the sentinel or be overwritten by the gather)
s = torch.cuda.Stream(device=dev)
with torch.cuda.stream(s):
    src = torch.full((1 << 24,), 3.0, device=dev)
    big = torch.full((1 << 24,), -1.0, device=dev)
    w = mcrdl.all_gather("nccl", big, src, async_op=True)
    w.wait()  # the stream waits; the host does not
    big.mul_(2)
torch.cuda.synchronize(dev)
assert torch.all(big == 6).item(), big[:4]
try:
    mcrdl.all_reduce("nccl", torch.ones(3))
    raise AssertionError("CPU tensor on nccl did not raise")
except mcrdl.BackendUnavailableError as e:
    assert "cuda" in str(e)
mcrdl.finalize()
print("nccl ops OK:", ", ".join(ok))
