"""The call path on CUDA tensors at world size 1 (nccl beside mpi): "auto" routes by
device, fusion leaves CUDA tensors on nccl as they are, compression passes GPU tensors
through exactly, the log records nccl calls, a CPU and a GPU op in flight together."""

import torch

import mcrdl

mcrdl.init(["nccl", "mpi"])
dev = torch.device("cuda", mcrdl.launch.detect().local_rank % torch.cuda.device_count())
checks = []

# "auto" takes the backend that accepts the tensor's device
g, c = torch.ones(1000, device=dev), torch.ones(1000)
mcrdl.all_reduce("auto", g, async_op=True).wait()  # warm-up: NCCL sets up lazily
w_g = mcrdl.all_reduce("auto", g, async_op=True)
w_c = mcrdl.all_reduce("auto", c, async_op=True)
w_c.wait()
w_g.wait()
assert (w_g.backend, w_c.backend) == ("nccl", "mpi"), (w_g.backend, w_c.backend)
assert torch.all(g == 1).item() and torch.all(c == 1)
checks.append("auto routes cuda->nccl, cpu->mpi")

# fusion: many small async all_reduces of CUDA tensors, mixed dtypes, SUM and AVG
from mcrdl.extensions import fusion_stats  # noqa: E402

fusion_stats(reset=True)
with mcrdl.extensions(fusion=True):
    ts = [torch.full((n,), float(i + 1), device=dev, dtype=dt)
          for i, (n, dt) in enumerate([(7, torch.float32), (300, torch.float32),
                                       (5, torch.bfloat16), (1 << 16, torch.float32),
                                       (9, torch.float16)])]
    refs = [t.clone() for t in ts]
    works = [mcrdl.all_reduce("nccl", t, op=mcrdl.ReduceOp.AVG if i % 2 else mcrdl.ReduceOp.SUM,
                              async_op=True) for i, t in enumerate(ts)]
    for w in works:
        w.wait()
torch.cuda.synchronize(dev)
for t, r in zip(ts, refs, strict=True):
    assert t.device == dev and torch.equal(t, r), (t, r)
stats = fusion_stats()  # CUDA tensors go to nccl as they are, never buffered
assert stats["calls"] == 0 and stats["flushes"] == 0, stats
checks.append("fusion on cuda tensors")

# compression: GPU tensors pass through uncompressed (exact), CPU float32 is compressed
try:
    import zfpy  # noqa: F401
    have_zfp = True
except ImportError:
    have_zfp = False
if have_zfp:
    with mcrdl.extensions(compression={"mode": "accuracy", "tolerance": 1e-3}):
        x = torch.randn(4096, device=dev)
        y = x.clone()
        mcrdl.all_reduce("nccl", y)
        assert torch.equal(x, y)
        out = torch.empty(4096, device=dev)
        mcrdl.all_gather("nccl", out, x)
        assert torch.equal(out, x)
    checks.append("compression passes cuda tensors through exactly")

# logging: nccl calls are recorded with their bytes
mcrdl.reset_log()
with mcrdl.extensions(logging=True):
    t = torch.ones(1 << 20, device=dev)
    for _ in range(3):
        mcrdl.all_reduce("nccl", t)
    mcrdl.all_reduce("nccl", t, async_op=True).wait()
rows = [r for r in mcrdl.log_summary(quiet=True) if r["backend"] == "nccl"]
assert rows and sum(r["count"] for r in rows) == 4, rows
assert sum(r["bytes"] for r in rows) == 4 * (4 << 20), rows
checks.append("log records nccl calls")

# a blocking nccl call orders the caller's stream: its output is read right after (an
# all_gather into a sentinel buffer: at one rank a bcast would write nothing to check)
s = torch.cuda.Stream(device=dev)
with torch.cuda.stream(s):
    z = torch.arange(1 << 22, device=dev, dtype=torch.float32)
    zo = torch.full_like(z, -1.0)
    mcrdl.all_gather("nccl", zo, z)
    total = zo.sum().item()
assert total == float((1 << 22) * ((1 << 22) - 1) // 2), total
checks.append("blocking call on a side stream")

mcrdl.finalize()
print("cuda extensions OK:", "; ".join(checks))
