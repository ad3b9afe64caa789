"""Unmodified torch training code over "mcrdl" against the same code over "gloo"; run by
every rank of ``mpiexec -n N`` or ``torchrun --nproc-per-node N`` (N = 2 or 4).

The same functions run twice in one process, the backend name being the only
difference: ``init_process_group("gloo")``, train, ``destroy_process_group()``, then
the same with "mcrdl" (no MASTER_ADDR under mpiexec: mcrdl's rendezvous).

- DDP, 10 steps, small buckets (several per step), ``find_unused_parameters=True`` (a
  branch unused on odd steps), ``no_sync()`` accumulation (every other step):
  parameters within 1e-6 relative of Gloo's (float32 sums of more than two terms may
  differ in the last bit: MPI's and Gloo's allreduce add the ranks' contributions in
  different orders).
- DDP with the built-in fp16 compression hook, 10 steps: with allreduce routed to
  mcrdl's "gloo" (Gloo's own algorithm), within 1e-6; with "auto" (MPI here) within
  1e-3 from 3 ranks on: mcrdl reduces float16 in float32 and rounds once, Gloo rounds
  after each addition, so their sums of three or more float16 terms differ by float16
  roundings (unit roundoff 4.9e-4); at 2 ranks both are the one correctly rounded sum.
- FSDP2 ``fully_shard`` of a 2-layer MLP on a 1-D mesh of the default group, 5 steps.
- At 4 ranks, DTensor tensor parallelism (ColwiseParallel/RowwiseParallel) on the "tp"
  dimension of a 2x2 (dp, tp) mesh with FSDP2 on "dp", 5 steps.
- DCP: the FSDP2 model's sharded state saved and loaded back over "mcrdl" into a fresh
  model (round trip exact).

Prints "rank R: torch backend training OK (...)" on success.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import mcrdl

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
RTOL = 1e-6
# float16 sums rounded once (mcrdl over MPI) vs after each addition (Gloo)
FP16_RTOL = 1e-3


class Net(nn.Module):
    """A small MLP with a branch that odd steps leave unused."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(16, 32)
        self.w2 = nn.Linear(32, 8)
        self.extra = nn.Linear(32, 8)

    def forward(self, x, use_extra=True):
        h = torch.relu(self.w1(x))
        y = self.w2(h)
        return y + self.extra(h) if use_extra else y


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(16, 32, bias=False)
        self.w2 = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def batch(step: int, rank: int, rows: int = 8) -> torch.Tensor:
    return torch.randn(rows, 16, generator=torch.Generator().manual_seed(1000 * step + rank))


def ddp(fp16_hook: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        Net(), bucket_cap_mb=0.001, find_unused_parameters=not fp16_hook)
    if fp16_hook:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(10):
        opt.zero_grad()
        use_extra = fp16_hook or step % 2 == 0
        if step % 2 == 1:  # accumulate a micro-batch without communication
            with model.no_sync():
                model(batch(step + 100, rank), use_extra).square().mean().backward()
        model(batch(step, rank), use_extra).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def fsdp2() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = MLP()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model.w1, model.w2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(5):
        opt.zero_grad()
        model(batch(step, dist.get_rank())).square().mean().backward()
        opt.step()
    return [p.full_tensor() for p in model.parameters()]


def tensor_parallel() -> list[torch.Tensor]:
    """TP on "tp" (each dp replica sees the same data within itself), FSDP2 on "dp"."""
    torch.manual_seed(0)
    model = MLP()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(5):
        opt.zero_grad()
        model(batch(step, dp_rank)).square().mean().backward()
        opt.step()
    return [p.full_tensor() for p in model.parameters()]


def checkpoint_round_trip() -> int:
    """Save the FSDP2 model's sharded state, load it into a fresh model; returns the
    number of tensors compared."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    saved = MLP()
    fully_shard(saved, mesh=mesh)
    saved(batch(0, dist.get_rank())).sum().backward()
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(p.grad)
    box = [tempfile.mkdtemp(prefix="mcrdl-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    dcp.save({"model": saved.state_dict()}, checkpoint_id=box[0])
    torch.manual_seed(1)
    loaded = MLP()
    fully_shard(loaded, mesh=mesh)
    state = {"model": loaded.state_dict()}
    dcp.load(state, checkpoint_id=box[0])
    loaded.load_state_dict(state["model"])
    n = 0
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert isinstance(a, DTensor) and torch.equal(a.to_local(), b.to_local()), name
        n += 1
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(box[0])
    return n


def run(backend: str) -> dict:
    # Gloo rendezvouses on mcrdl's store by name ("mcrdl://"), "mcrdl" by torch's
    # default env:// (mcrdl's store again under mpiexec, torchrun's under torchrun).
    dist.init_process_group(backend, init_method="mcrdl://" if backend == "gloo" else None)
    out = {"ddp": ddp(False), "ddp fp16 hook": ddp(True), "fsdp2": fsdp2()}
    if dist.get_world_size() == 4:
        out["dtensor tp"] = tensor_parallel()
    if backend == "mcrdl":
        mcrdl.set_torch_routes("allreduce=gloo")
        out["ddp fp16 hook on mcrdl's gloo"] = ddp(True)
        mcrdl.set_torch_routes(None)
        out["dcp tensors"] = checkpoint_round_trip()
    dist.destroy_process_group()
    return out


def max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
               for x, y in zip(a, b, strict=True))


gloo = run("gloo")
ours = run("mcrdl")
rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0")))
gloo["ddp fp16 hook on mcrdl's gloo"] = gloo["ddp fp16 hook"]
diffs = {k: max_rel(ours[k], gloo[k]) for k in gloo}
limits = {k: FP16_RTOL if k == "ddp fp16 hook" else RTOL for k in gloo}
bad = {k: d for k, d in diffs.items() if not d <= limits[k]}
assert not bad, f"rank {rank}: parameters differ from Gloo's beyond {limits}: {bad}"
assert ours["dcp tensors"] == 2, ours["dcp tensors"]  # w1, w2
print(f"rank {rank}: torch backend training OK (max relative difference to gloo: "
      + ", ".join(f"{k} {d:.1e}" for k, d in diffs.items())
      + f"; dcp round trip of {ours['dcp tensors']} tensors)", flush=True)
