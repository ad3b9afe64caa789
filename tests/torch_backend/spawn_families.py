"""The c10d families torch's distributed test suite runs on GPUs only, or at world sizes
of 4 and 8 only, on CPU processes that ``torch.multiprocessing.spawn`` started at
world sizes 2 and 3: sub-groups (``new_group`` of some ranks, ``new_subgroups``,
``new_subgroups_by_enumeration``), DeviceMesh (``init_device_mesh("cpu", ...)``, its
dimension groups, DTensor over them), monitored_barrier over the world and a sub-group,
and DDP with communication hooks (allreduce, fp16 compression, PowerSGD), uneven inputs
under ``Join``, a static graph and ``no_sync``.

    python spawn_families.py OUT_DIR WORLD_SIZE BACKEND...

Each rank runs it all for each BACKEND in turn ("gloo mcrdl": the same processes, torch
imported once), with a ``file://`` rendezvous, and writes OUT_DIR/RANK.json: per backend
and check, what the collectives gave and DDP's losses (float.hex) and final parameters'
checksum, for a bitwise comparison between backends.
"""

import datetime
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 4


def subgroups(rank, ws):
    """new_group of some ranks (reversed), new_subgroups and new_subgroups_by_enumeration:
    all_reduce, all_gather, broadcast and an object collective in each."""
    out = {}
    some = dist.new_group([ws - 1, 0])
    if rank in (0, ws - 1):
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=some)
        objs = [None, None]
        dist.all_gather_object(objs, {"rank": rank}, group=some)
        out["some"] = [t.tolist(), objs, dist.get_rank(some)]
    size = 2 if ws % 2 == 0 else ws
    mine, _ = dist.new_subgroups(group_size=size)
    t = torch.arange(4, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t, group=mine)
    gathered = [torch.empty(1) for _ in range(dist.get_world_size(mine))]
    dist.all_gather(gathered, torch.tensor([float(rank)]), group=mine)
    b = torch.full((2,), float(rank))
    dist.broadcast(b, group=mine, group_src=0)
    out["new_subgroups"] = [t.tolist(), [g.item() for g in gathered], b.tolist(),
                            dist.get_rank(mine), dist.get_world_size(mine)]
    evens, odds = list(range(0, ws, 2)), list(range(1, ws, 2))
    mine, _ = dist.new_subgroups_by_enumeration([evens, odds])
    t = torch.full((2,), float(rank * rank))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mine)
    out["by_enumeration"] = [t.tolist(), dist.get_process_group_ranks(mine)]
    return out


def device_mesh(rank, ws):
    """A 2-D mesh on CPU (2 x ws/2, or 1 x ws at an odd world size): all_reduce over
    each dimension's group, a DTensor sharded over both dimensions, redistributed."""
    shape = (2, ws // 2) if ws % 2 == 0 else (1, ws)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    out = {"coordinate": mesh.get_coordinate()}
    for dim in ("dp", "tp"):
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t, group=mesh.get_group(dim))
        out[dim] = [t.tolist(), mesh.get_local_rank(dim), mesh[dim].size()]
    x = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    dt = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    out["local"] = dt.to_local().tolist()
    full = (dt * 2 + 1).redistribute(mesh, [Replicate(), Replicate()]).to_local()
    out["full"] = bool(torch.equal(full, x * 2 + 1))
    out["sum"] = dt.sum().full_tensor().item()
    return out


def monitored(rank, ws):
    """monitored_barrier over the world (both forms) and over a sub-group, which the
    other ranks call as non-members."""
    timeout = datetime.timedelta(seconds=60)
    dist.monitored_barrier(timeout=timeout)
    dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
    sub = dist.new_group(list(range(ws - 1)))
    dist.monitored_barrier(sub, timeout)
    return "passed"


class Net(nn.Module):
    """A small MLP with a branch the forward of some steps does not use."""

    def __init__(self, branch: bool):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.branch = nn.Linear(16, 4) if branch else None

    def forward(self, x, use_branch=False):
        h = torch.relu(self.a(x))
        return self.b(h) + (self.branch(h) if use_branch else 0)


def train(rank, ws, *, hook=None, state=None, steps=STEPS, join=False, static=False,
          unused=False, no_sync=False):
    """DDP training of Net: the branch never used under a static graph, used every
    other step with `unused` (find_unused_parameters)."""
    torch.manual_seed(0)
    model = Net(branch=static or unused)
    ddp = DDP(model, static_graph=static, find_unused_parameters=unused)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    torch.manual_seed(1 + rank)
    losses = []
    batches = steps + rank if join else steps
    with Join([ddp]) if join else _nothing():
        for step in range(batches):
            x, y = torch.randn(6, 8), torch.randn(6, 4)
            if no_sync and step % 2 == 0:
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(x), y).backward()
                continue
            opt.zero_grad() if not no_sync else None
            loss = nn.functional.mse_loss(ddp(x, use_branch=unused and step % 2 == 1), y)
            loss.backward()
            opt.step()
            if no_sync:
                opt.zero_grad()
            losses.append(loss.item().hex())
    params = sum(float(p.detach().double().sum()) for p in model.parameters())
    return {"losses": losses, "params": params.hex()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def ddp_checks(rank, ws):
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                        start_powerSGD_iter=2, random_seed=0)
    return {
        "allreduce_hook": train(rank, ws, hook=default_hooks.allreduce_hook),
        "fp16_compress_hook": train(rank, ws, hook=default_hooks.fp16_compress_hook),
        "powerSGD_hook": train(rank, ws, hook=powerSGD_hook.powerSGD_hook, state=state),
        "join_uneven_inputs": train(rank, ws, join=True),
        "static_graph": train(rank, ws, static=True),
        "find_unused_parameters": train(rank, ws, unused=True),
        "no_sync": train(rank, ws, no_sync=True),
    }


def run_backend(rank, ws, backend, out_dir):
    if backend == "mcrdl":
        import mcrdl  # noqa: F401 - registers the backend
    path = os.path.join(out_dir, f"{backend}-init_file")
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank,
                            world_size=ws)
    result = {"backend": dist.get_backend(), "subgroups": subgroups(rank, ws),
              "device_mesh": device_mesh(rank, ws), "monitored_barrier": monitored(rank, ws),
              "ddp": ddp_checks(rank, ws)}
    dist.destroy_process_group()
    return result


def main(rank, ws, backends, out_dir):
    results = {b: run_backend(rank, ws, b, out_dir) for b in backends}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    out_dir, ws, backends = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    work = tempfile.mkdtemp(dir=out_dir)
    mp.spawn(main, args=(ws, backends, work), nprocs=ws, join=True)
    for rank in range(ws):
        os.replace(os.path.join(work, f"{rank}.json"), os.path.join(out_dir, f"{rank}.json"))
