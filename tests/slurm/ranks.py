"""Rank programs of tests/test_slurm.py, run by every task of ``srun --mpi=pmi2 -n N``.

- ``discovery``: mcrdl's launch discovery agrees with MPI's world and Slurm's step
  (rank, size, local rank and size, this node in SLURM_STEP_NODELIST), the bootstrap
  finds one node, and pccl numbers the ranks' nodes from Slurm's placement; an
  all_reduce over each of mpi, gloo and pccl.
- ``torch``: ``init_process_group("mcrdl")`` with no MASTER_ADDR or MASTER_PORT (mcrdl's
  rendezvous over the MPI world srun's PMI made), an all_reduce, a broadcast and a
  barrier through torch.distributed.
- ``kill R``: rank R kills itself with SIGKILL once every rank is in mcrdl; the others
  wait in an all_reduce that cannot complete (Slurm must end the step).
- ``raise R``: rank R raises an exception nobody catches; the others wait likewise
  (mcrdl's excepthook must end the job through MPI_Abort, Slurm's PMI server the step).
- ``module NAME ARGS...``: ``python -m NAME ARGS...`` in this process (tests/_multi.py
  runs script files; the training entry points are modules of a package).

Each prints, first, ``slurm job <SLURM_JOB_ID> step <SLURM_STEP_ID>``, then ``rank R:
<mode> OK`` on success (the fault modes: ``waiting since <time.time()>`` once their rank
is blocked).
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import sys
import time

import torch

import mcrdl


def discovery() -> None:
    from mcrdl.backends.pccl import PCCLBackend
    from mcrdl.launch import detect, slurm_step

    mcrdl.init(["mpi", "gloo", "pccl"])
    rank, size = mcrdl.get_rank(), mcrdl.get_world_size()
    info, step = detect(), slurm_step()
    assert (info.launcher, info.rank, info.size) == ("mpi", rank, size), info
    assert (info.local_rank, info.local_size) == (rank, size), info  # one node
    assert step is not None, {k: v for k, v in os.environ.items() if k.startswith("SLURM")}
    assert (step.rank, step.size, step.local_rank, step.node) == (rank, size, rank, 0), step
    assert step.nodes == (socket.gethostname().split(".")[0],), step
    assert step.tasks_per_node == (size,), step
    boot = mcrdl.api.current_runtime().bootstrap
    assert boot.single_node(), "the bootstrap found several nodes on one"
    assert PCCLBackend.current().world_nodes == [0] * size, PCCLBackend.current().world_nodes
    for backend in ("mpi", "gloo", "pccl"):
        t = torch.full((5,), float(rank + 1))
        mcrdl.all_reduce(backend, t)
        assert torch.equal(t, torch.full((5,), size * (size + 1) / 2)), (backend, t)
    mcrdl.finalize()
    print(f"rank {rank}: discovery OK (node {step.node_name}, {size} tasks)", flush=True)


def torch_backend() -> None:
    import torch.distributed as dist

    assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ
    dist.init_process_group("mcrdl")
    rank, size = dist.get_rank(), dist.get_world_size()
    assert (rank, size) == (int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]))
    t = torch.arange(6, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(6, dtype=torch.float64) * size * (size + 1) / 2), t
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=size - 1)
    assert torch.equal(b, torch.full((3,), float(size - 1))), b
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: torch OK", flush=True)


def fault(kind: str, victim: int) -> None:
    mcrdl.init(["mpi"])
    rank = mcrdl.get_rank()
    mcrdl.barrier("mpi")  # every rank is in mcrdl before the fault
    if rank == victim:
        time.sleep(2)  # the others print and block first (4 ranks share 2 cores)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"rank {rank}: the fault this test injects")
    print(f"rank {rank}: waiting since {time.time():.3f}", flush=True)
    mcrdl.all_reduce("mpi", torch.ones(4))  # never completes: the victim is gone
    print(f"rank {rank}: the all_reduce completed without rank {victim}", flush=True)
    mcrdl.finalize()


def main() -> None:
    print(f"slurm job {os.environ.get('SLURM_JOB_ID')} step {os.environ.get('SLURM_STEP_ID')}",
          flush=True)
    mode = sys.argv[1]
    if mode == "module":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    elif mode == "discovery":
        discovery()
    elif mode == "torch":
        torch_backend()
    elif mode in ("kill", "raise"):
        fault(mode, int(sys.argv[2]))
    else:
        raise SystemExit(f"ranks.py: unknown mode {mode!r} (discovery, torch, kill R, "
                         "raise R, module NAME ARGS)")


if __name__ == "__main__":
    main()
