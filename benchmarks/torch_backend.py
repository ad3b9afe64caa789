"""torch.distributed on "mcrdl" vs on "gloo": a DDP and an FSDP2 training step, and the
cost the torch-facing layer adds to a small collective.

Usage::

    mpiexec -n 2 python benchmarks/torch_backend.py
    mpiexec -n 4 python benchmarks/torch_backend.py --json torch_backend.json
    mpiexec -n 1 python benchmarks/torch_backend.py --only overhead

Steps: the default group is Gloo (under mpiexec it rendezvouses on mcrdl's store), and
``new_group(backend="mcrdl")`` makes an mcrdl group of every rank. Two copies of the
same model (same initial weights, same data) train side by side, one wrapped by DDP
(or FSDP2's ``fully_shard`` on a 1-D mesh of the group) over each group; the step is
the unmodified training step (zero_grad, forward, backward with its communication,
optimizer step). The two alternate in blocks (the order reverses every block) so that
drift hits both; an untimed barrier on an MPI communicator of its own aligns the ranks
before each step; after the loop one MAX reduction gives each step's slowest rank.
Each figure is the median of those; ``ratio`` is mcrdl / gloo (below 1: mcrdl faster).
mcrdl routes the steps' operations by "auto" (or MCRDL_TORCH_ROUTES).

Per-call cost: a 16-byte all_reduce through each layer, on the same mcrdl backend
(``--backend``, default "mpi" where it exists), timed in alternating blocks: mcrdl's
own ``mcrdl.all_reduce``; the process group's ``allreduce`` method (what the layer
adds: reading torch's options object, routing, the call); ``dist.all_reduce`` (plus
torch's own Python front); torch's option reads alone, as the layer reads them
(``hash(opts.reduceOp)`` looked up, ``opts.asyncOp``: what any Python process group
pays in some form); the async forms (+ the c10d Work; ``wait()``, or ``get_future().wait()``
as DDP's buckets); and ``dist.all_reduce`` on the
Gloo group for reference. CPU time of the calling thread (``time.thread_time``) is
reported beside wall time: on a shared machine it is the steadier measure of work done
per call. Figures: medians over blocks, rank 0.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import itertools
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import mpi4py
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import mcrdl
from mcrdl.torch_backend import convert

mpi4py.rc.thread_level = "multiple"  # as mcrdl needs; MPI initializes here
MPI = importlib.import_module("mpi4py.MPI")
warnings.filterwarnings("ignore", category=FutureWarning)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("steps", "overhead"), help="run one part only")
    p.add_argument("--width", type=int, default=512, help="MLP width (default 512)")
    p.add_argument("--layers", type=int, default=4, help="MLP layers (default 4)")
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    p.add_argument("--block", type=int, default=2, help="steps per alternation block")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb")
    p.add_argument("--backend", help="mcrdl backend of the per-call part (default: mpi "
                   "where initialized, else gloo)")
    p.add_argument("--calls", type=int, default=200, help="calls per per-call block")
    p.add_argument("--rounds", type=int, default=30, help="per-call blocks per variant")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if min(args.width, args.layers, args.batch, args.steps, args.block, args.calls,
           args.rounds) < 1 or args.warmup < 0:
        p.error("sizes and counts must be >= 1 (--warmup >= 0)")
    return args


def mlp(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def step_of(model: nn.Module, width: int, batch: int) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    return step


def time_steps(variants: dict[str, Callable[[], None]], comm, args) -> dict[str, float]:
    """Median over steps of the slowest rank's step time (s), variants alternating."""
    calls = list(variants.values())
    for call in calls:
        for _ in range(args.warmup):
            call()
    times = np.zeros((len(calls), args.steps))
    bounds = [*range(0, args.steps, args.block), args.steps]
    for block, (first, last) in enumerate(itertools.pairwise(bounds)):
        order = range(len(calls)) if block % 2 == 0 else reversed(range(len(calls)))
        for k in order:
            for i in range(first, last):
                comm.Barrier()
                start = time.perf_counter()
                calls[k]()
                times[k, i] = time.perf_counter() - start
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return {name: float(np.median(row)) for name, row in zip(variants, times, strict=True)}


def steps(gloo_group, mcrdl_group, comm, args) -> list[dict]:
    rows = []
    base = mlp(args.width, args.layers)
    ddp = {name: step_of(nn.parallel.DistributedDataParallel(
        copy.deepcopy(base), process_group=group, bucket_cap_mb=args.bucket_mb),
        args.width, args.batch) for name, group in (("gloo", gloo_group), ("mcrdl", mcrdl_group))}
    fsdp = {}
    for name, group in (("gloo", gloo_group), ("mcrdl", mcrdl_group)):
        model = copy.deepcopy(base)
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fsdp[name] = step_of(model, args.width, args.batch)
    for what, variants in (("DDP step", ddp), ("FSDP2 step", fsdp)):
        t = time_steps(variants, comm, args)
        rows.append({"what": what, "gloo_ms": t["gloo"] * 1e3, "mcrdl_ms": t["mcrdl"] * 1e3,
                     "ratio": t["mcrdl"] / t["gloo"]})
    return rows


def per_call(gloo_group, mcrdl_group, backend: str, args) -> dict[str, dict[str, float]]:
    """us per call (CPU of this thread, wall) of each variant; rank 0's medians."""
    t = torch.ones(4)
    blocking, async_opts = dist.AllreduceOptions(), dist.AllreduceOptions()
    blocking.asyncOp = False
    by_hash = convert.BY_HASH

    def options_only():  # as the layer reads them
        return by_hash.get(hash(blocking.reduceOp)) and blocking.asyncOp

    variants = {
        "mcrdl.all_reduce": lambda: mcrdl.all_reduce(backend, t),
        "group.allreduce": lambda: mcrdl_group.allreduce([t], blocking),
        "dist.all_reduce": lambda: dist.all_reduce(t, group=mcrdl_group),
        "torch option reads": options_only,
        "mcrdl.all_reduce async+wait": lambda: mcrdl.all_reduce(backend, t,
                                                                async_op=True).wait(),
        "group.allreduce async+wait": lambda: mcrdl_group.allreduce([t], async_opts).wait(),
        "group.allreduce async+future": lambda: mcrdl_group.allreduce(
            [t], async_opts).get_future().wait(),
        "dist.all_reduce on gloo": lambda: dist.all_reduce(t, group=gloo_group),
    }
    samples: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in variants}
    for call in variants.values():  # warm up
        for _ in range(20):
            call()
    for rnd in range(args.rounds):
        order = list(variants.items()) if rnd % 2 == 0 else list(reversed(variants.items()))
        for name, call in order:
            cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
            for _ in range(args.calls):
                call()
            samples[name][0].append((time.thread_time_ns() - cpu0) / args.calls / 1e3)
            samples[name][1].append((time.perf_counter_ns() - wall0) / args.calls / 1e3)
    return {k: {"cpu_us": statistics.median(c), "wall_us": statistics.median(w)}
            for k, (c, w) in samples.items()}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mcrdl.set_torch_routes(None)
    dist.init_process_group("gloo")
    mcrdl_group = dist.new_group(backend="mcrdl")  # every rank: mcrdl's creator
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    backend = args.backend or ("mpi" if "mpi" in mcrdl.get_backends() else "gloo")
    env = {"ranks": size, "cpu_count": os.cpu_count(), "python": platform.python_version(),
           "torch": torch.__version__, "mpi": MPI.Get_library_version().splitlines()[0],
           "mcrdl backends": mcrdl.get_backends(), "routes": mcrdl.torch_routes()}
    result: dict[str, object] = {"environment": env}
    if rank == 0:
        print("# " + "; ".join(f"{k}: {v}" for k, v in env.items()))
    if args.only != "overhead":
        rows = steps(dist.group.WORLD, mcrdl_group, comm, args)
        result["steps"] = rows
        if rank == 0:
            print(f"# {args.layers}x{args.width} MLP, batch {args.batch}/rank, "
                  f"{args.steps} timed steps; median of the slowest rank's step")
            print(f"{'':12} {'gloo(ms)':>10} {'mcrdl(ms)':>10} {'ratio':>7}")
            for r in rows:
                print(f"{r['what']:12} {r['gloo_ms']:10.2f} {r['mcrdl_ms']:10.2f} "
                      f"{r['ratio']:7.3f}")
    if args.only != "steps":
        mcrdl.set_torch_routes(f"allreduce={backend}")
        costs = per_call(dist.group.WORLD, mcrdl_group, backend, args)
        mcrdl.set_torch_routes(None)
        direct, direct_async = costs["mcrdl.all_reduce"], costs["mcrdl.all_reduce async+wait"]
        added = {
            "group.allreduce - mcrdl.all_reduce": {
                k: costs["group.allreduce"][k] - direct[k] for k in direct},
            "dist.all_reduce - mcrdl.all_reduce": {
                k: costs["dist.all_reduce"][k] - direct[k] for k in direct},
            "async: group - mcrdl": {
                k: costs["group.allreduce async+wait"][k] - direct_async[k] for k in direct},
            "future: group - mcrdl": {
                k: costs["group.allreduce async+future"][k] - direct_async[k] for k in direct},
        }
        result["per_call"] = {"backend": backend, "us": costs, "added_us": added}
        if rank == 0:
            print(f"# 16-byte all_reduce on mcrdl backend '{backend}', {size} ranks: "
                  f"us per call, median of {args.rounds} blocks of {args.calls}")
            print(f"{'':38} {'cpu(us)':>9} {'wall(us)':>9}")
            for k, v in (*costs.items(), *added.items()):
                print(f"{k:38} {v['cpu_us']:9.2f} {v['wall_us']:9.2f}")
    if rank == 0 and args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    comm.Free()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
