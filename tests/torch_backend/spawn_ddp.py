"""PyTorch's DDP tutorial ("Getting Started with Distributed Data Parallel", Basic Use
Case) under ``torch.multiprocessing.spawn``, then the other ways torch hands a spawned
process its world: ``init_method="file://"``, ``store=FileStore`` and ``store=TCPStore``,
each with an all_reduce over the world and over ``new_group`` sub-groups.

    python spawn_ddp.py OUT_DIR PORTS BACKEND...

No launcher: every rank is given its rank and the world size by the program. Each rank
runs it all for each BACKEND in turn ("gloo mcrdl": the same processes, so torch is
imported once), backend i with MASTER_PORT and the TCPStore's port at PORTS[2i] and
PORTS[2i+1] (a comma-separated list), and writes OUT_DIR/RANK.json: per backend, the
tutorial's losses (float.hex, for a bitwise comparison between backends), its final
parameters' checksum and what each init mode's collectives gave.

The tutorial's program, changed only where CPU processes and a comparison need it: the
backend string is an argument (it says "gloo"), MASTER_PORT comes from the command line
(it says 12355), the model stays on the CPU (no ``.to(rank)`` nor ``device_ids``), the
random generators are seeded and it takes a few SGD steps, recording each loss, where it
takes one.
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 5


# -- the tutorial -------------------------------------------------------------------------
def setup(rank, world_size, backend, port):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = port
    # initialize the process group
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size, backend, port):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size, backend, port)

    # create model and move it to GPU with id rank
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    torch.manual_seed(1 + rank)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item().hex())
    params = sum(float(p.detach().double().sum()) for p in model.parameters())
    backends = _mcrdl_backends(backend)
    cleanup()
    return {"losses": losses, "params": params.hex(), "backends": backends}


# -- the other init modes ------------------------------------------------------------------
def _mcrdl_backends(backend):
    if backend != "mcrdl":
        return None
    import mcrdl

    return mcrdl.get_backends()


def collectives(rank, world_size, backend):
    """all_reduce over the world, over a new_group of every rank (reversed) and over one
    of rank 1 alone, and a broadcast from the last rank; then destroys the group."""
    t = torch.arange(4, dtype=torch.float32) + rank
    dist.all_reduce(t)
    every = dist.new_group(list(reversed(range(world_size))))
    s = torch.full((3,), float(rank + 1))
    dist.all_reduce(s, group=every)
    alone = dist.new_group([1])
    a = torch.full((2,), float(rank + 10))
    if rank == 1:
        dist.all_reduce(a, group=alone)
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=world_size - 1)
    out = {"name": dist.get_backend(), "world": t.tolist(), "every": s.tolist(),
           "alone": a.tolist(),
           "broadcast": b.tolist(), "backends": _mcrdl_backends(backend)}
    dist.destroy_process_group()
    return out


def run_backend(rank, world_size, backend, out_dir, port, tcp_port):
    if backend == "mcrdl":
        import mcrdl  # noqa: F401 - registers the backend
    result = {"ddp": demo_basic(rank, world_size, backend, port)}

    path = os.path.join(out_dir, f"{backend}-init_file")
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank,
                            world_size=world_size)
    result["file://"] = collectives(rank, world_size, backend)

    store = dist.FileStore(os.path.join(out_dir, f"{backend}-file_store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    result["FileStore"] = collectives(rank, world_size, backend)

    store = dist.TCPStore("127.0.0.1", int(tcp_port), world_size, rank == 0)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    result["TCPStore"] = collectives(rank, world_size, backend)
    return result


def main(rank, world_size, runs, out_dir):
    """Each backend's run in turn, in one process per rank (torch imported once)."""
    results = {backend: run_backend(rank, world_size, backend, out_dir, port, tcp_port)
               for backend, port, tcp_port in runs}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    out_dir, ports, backends = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
    runs = [(b, ports[2 * i], ports[2 * i + 1]) for i, b in enumerate(backends)]
    world_size = 2
    work = tempfile.mkdtemp(dir=out_dir)
    mp.spawn(main, args=(world_size, runs, work), nprocs=world_size, join=True)
    for rank in range(world_size):
        os.replace(os.path.join(work, f"{rank}.json"), os.path.join(out_dir, f"{rank}.json"))
