"""Every operation through "nccl" on CUDA tensors at world size 1, async and blocking,
plus the stream semantics: wait() orders the caller's stream without a host sync."""

import torch

import mcrdl

mcrdl.init(["nccl"])
dev = torch.device("cuda", mcrdl.launch.detect().local_rank % torch.cuda.device_count())
ok = []
for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.bool):
    x = (torch.arange(10, device=dev) % 2).to(dt)
    y = x.clone()
    mcrdl.all_reduce("nccl", y)
    assert torch.equal(y, x), (dt, y)
    out = torch.empty(10, dtype=dt, device=dev)
    w = mcrdl.all_gather("nccl", out, x, async_op=True)
    w.wait()
    assert torch.equal(out, x) and w.backend == "nccl"
    mcrdl.bcast("nccl", y, src=0)
    mcrdl.reduce_scatter("nccl", out, x.clone())
    assert torch.equal(out, x)
    mcrdl.all_to_all_single("nccl", out, x)
    assert torch.equal(out, x)
    ok.append(str(dt))
s = torch.cuda.Stream(device=dev)
with torch.cuda.stream(s):
    big = torch.ones(1 << 24, device=dev)
    w = mcrdl.all_reduce("nccl", big, op=mcrdl.ReduceOp.AVG, async_op=True)
    w.wait()  # the stream waits; the host does not
    big.mul_(2)
torch.cuda.synchronize(dev)
assert torch.all(big == 2).item()
try:
    mcrdl.all_reduce("nccl", torch.ones(3))
    raise AssertionError("CPU tensor on nccl did not raise")
except mcrdl.BackendUnavailableError as e:
    assert "cuda" in str(e)
mcrdl.finalize()
print("nccl ops OK:", ", ".join(ok))
