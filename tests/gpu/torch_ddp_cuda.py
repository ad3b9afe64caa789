"""torch.distributed on mcrdl with CUDA tensors (world size 1): DDP's broadcast and
bucketed gradient all-reduces reach nccl through "auto"; the losses equal a plain
(non-DDP) run of the same model on the same GPU."""

import torch
import torch.distributed as dist
from torch import nn

import mcrdl

dist.init_process_group("mcrdl")
dev = torch.device("cuda", mcrdl.launch.detect().local_rank % torch.cuda.device_count())
torch.cuda.set_device(dev)


def run(ddp: bool) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(dev)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index],
                                                    bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.randn(32, generator=torch.Generator().manual_seed(1)).to(dev)
    losses = []
    for step in range(10):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)).to(dev)
        loss = (model(x).squeeze(1) - x @ target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


with mcrdl.extensions(logging=True):
    ddp = run(True)
plain = run(False)
assert ddp == plain, (ddp, plain)
t = torch.ones(8, device=dev)
dist.all_reduce(t)
dist.barrier()
assert torch.all(t == 1).item()
rows = mcrdl.log_summary(quiet=True)
backends = sorted({r["backend"] for r in rows if r["level"] == "wire"} or
                  {r["backend"] for r in rows})
assert "nccl" in backends, rows
dist.destroy_process_group()
print(f"torch ddp cuda OK: 10 steps equal to the plain run, wire backends {backends}")
