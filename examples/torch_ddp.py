"""Unmodified DDP training on mcrdl: the one-line switch ``init_process_group("mcrdl")``.

    mpiexec -n 4 python examples/torch_ddp.py              # no MASTER_ADDR needed
    torchrun --nproc-per-node 4 examples/torch_ddp.py
    MCRDL_TORCH_ROUTES="allreduce=gloo" mpiexec -n 2 python examples/torch_ddp.py

Every c10d operation DDP makes (the parameter broadcast, the gradient all-reduces of
its buckets) goes to "auto" (the fastest initialized backend per call, from the tuning
table) unless MCRDL_TORCH_ROUTES pins it. Rank 0 prints the loss, the routes, and
mcrdl's communication log: each operation, the backend it went to, bytes and latency.
"""

import torch
import torch.distributed as dist
from torch import nn

import mcrdl  # registers the "mcrdl" backend

mcrdl.configure(logging=True)  # record where each operation went
dist.init_process_group("mcrdl")  # was: dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)), bucket_cap_mb=0.01)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
target = torch.randn(32, generator=torch.Generator().manual_seed(1))
for step in range(30):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step * size + rank))
    loss = (model(x).squeeze(1) - x @ target).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0 and step % 10 == 9:
        print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)

if rank == 0:
    print("routes: " + ", ".join(f"{op}->{b}" for op, b in mcrdl.torch_routes().items()))
mcrdl.log_summary(gather=True)  # collective: every rank calls it, rank 0 prints
dist.destroy_process_group()
