"""Overhead of mcrdl over the raw libraries it wraps, measured side by side in one run.

For all_reduce, all_gather, all_to_all_single and bcast, the same tensors go through

- ``mcrdl.<op>("mpi", ...)`` and raw mpi4py on a ``MPI.COMM_WORLD.Dup()`` communicator,
  on numpy views of the same tensors, both blocking (``comm.Allreduce(MPI.IN_PLACE, a)``)
  and nonblocking + wait (``comm.Iallreduce(MPI.IN_PLACE, a).Wait()``);
- ``mcrdl.<op>("gloo", ...)`` and raw ``torch.distributed`` on a Gloo process group of
  its own (``dist.all_reduce(t, group=g)`` ...).

Usage::

    mpiexec -n 2 python benchmarks/overhead.py
    mpiexec -n 4 python benchmarks/overhead.py --max-bytes 4M --iters 100 --json o.json

Method: warm up every variant, then time them in alternation, ``--block-iters``
iterations at a time (the order reverses every round) so that drift hits all of them.
An untimed barrier of the baseline library on a communicator of its own (neither ours
nor the raw one, so neither is left warm by it: ``Barrier()`` on another Dup for mpi,
``dist.barrier`` on another group for gloo, which does not spin) precedes each
iteration. After the loop one ``Allreduce(MAX)`` gives the per-iteration maximum over
ranks; each figure is the median of those. ``ratio`` is ours / best raw variant and
``added(us)`` is ours - best raw. Sizes follow ``mcrdl-bench``: all_gather's size is
its output (n x per-rank input), all_to_all_single's the per-rank send buffer.
Messages above 1 MiB run ``iters x 1MiB / size`` iterations (at least ``--min-iters``)
to bound the run time.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Callable, Sequence

import mpi4py
import numpy as np
import torch
import torch.distributed as dist

import mcrdl
from mcrdl.tools.bench import (
    DTYPES,
    add_run_args,
    element_count,
    library_versions,
    positive_int,
)
from mcrdl.tuning.sizes import (
    add_size_sweep_args,
    check_size_sweep,
    format_size,
    size_range,
)

# mcrdl needs MPI_THREAD_MULTIPLE (importing mcrdl sets this too); MPI initialises here.
mpi4py.rc.thread_level = "multiple"
MPI = importlib.import_module("mpi4py.MPI")

OPS = ("all_reduce", "all_gather", "all_to_all_single", "bcast")
BACKENDS = ("mpi", "gloo")
# the element types raw mpi4py reduces on numpy views (mcrdl-bench's, less those numpy
# lacks or MPI does not sum)
RAW_DTYPES = ("float32", "float64", "int32", "int64")
# The raw baselines of each backend; "mcrdl" is always measured beside them.
RAW_VARIANTS = {"mpi": ("blocking", "nonblocking"), "gloo": ("blocking",)}
RAW_BASELINE = {
    "mpi": "best of mpi4py blocking, nonblocking+Wait on a Dup of COMM_WORLD",
    "gloo": "torch.distributed on a Gloo group of its own",
}
MIB = 1 << 20
SMALL_BYTES = 1 << 10  # the "small message" bound of the summary
Variants = dict[str, Callable[[], object]]  # name -> one call of the operation


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="mcrdl vs raw mpi4py / torch.distributed, same buffers, one run.",
    )
    parser.add_argument(
        "--op",
        nargs="+",
        choices=OPS,
        default=list(OPS),
        metavar="OP",
        help=f"operations (default all: {', '.join(OPS)})",
    )
    parser.add_argument(
        "--backend",
        nargs="+",
        choices=BACKENDS,
        metavar="NAME",
        help="backends to compare (default: mpi and gloo when usable)",
    )
    add_size_sweep_args(parser, factor=4, factor_note="; --max-bytes is always measured")
    add_run_args(parser, dtypes=RAW_DTYPES, iters=100,
                 iters_help="timed iterations per variant up to 1 MiB")
    parser.add_argument(
        "--min-iters",
        type=positive_int,
        default=10,
        help="floor of the scaled-down count above 1 MiB (default 10)",
    )
    parser.add_argument(
        "--block-iters",
        type=positive_int,
        default=5,
        help="iterations one variant runs before the next takes over (default 5)",
    )
    args = parser.parse_args(argv)
    check_size_sweep(parser, args)
    return args


def sizes_for(args: argparse.Namespace) -> list[int]:
    sizes = size_range(args.min_bytes, args.max_bytes, args.factor)
    if sizes[-1] != args.max_bytes:
        sizes.append(args.max_bytes)
    return sizes


def iters_for(nbytes: int, args: argparse.Namespace) -> int:
    if nbytes <= MIB:
        return args.iters
    return max(args.min_iters, args.iters * MIB // nbytes)


def make_buffers(op: str, nbytes: int, dtype: torch.dtype, nranks: int):
    """(input, output, size in bytes) for ``op``; in-place ops get ``output = input``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = element_count(op, nbytes, itemsize, nranks)
    if op == "all_gather":
        inp = torch.zeros(count // nranks, dtype=dtype)
        out = torch.zeros(count, dtype=dtype)
    elif op == "all_to_all_single":
        inp, out = torch.zeros(count, dtype=dtype), torch.zeros(count, dtype=dtype)
    else:
        inp = out = torch.zeros(count, dtype=dtype)
    return inp, out, count * itemsize


def mpi_variants(op: str, comm: MPI.Comm, inp: torch.Tensor, out: torch.Tensor) -> Variants:
    """mcrdl on "mpi", raw blocking mpi4py, raw nonblocking mpi4py + Wait."""
    a_in, a_out = inp.numpy(), out.numpy()
    if op == "all_reduce":
        return {
            "mcrdl": lambda: mcrdl.all_reduce("mpi", inp),
            "blocking": lambda: comm.Allreduce(MPI.IN_PLACE, a_in, op=MPI.SUM),
            "nonblocking": lambda: comm.Iallreduce(MPI.IN_PLACE, a_in, op=MPI.SUM).Wait(),
        }
    if op == "all_gather":
        return {
            "mcrdl": lambda: mcrdl.all_gather("mpi", out, inp),
            "blocking": lambda: comm.Allgather(a_in, a_out),
            "nonblocking": lambda: comm.Iallgather(a_in, a_out).Wait(),
        }
    if op == "all_to_all_single":
        return {
            "mcrdl": lambda: mcrdl.all_to_all_single("mpi", out, inp),
            "blocking": lambda: comm.Alltoall(a_in, a_out),
            "nonblocking": lambda: comm.Ialltoall(a_in, a_out).Wait(),
        }
    return {
        "mcrdl": lambda: mcrdl.bcast("mpi", inp, src=0),
        "blocking": lambda: comm.Bcast(a_in, root=0),
        "nonblocking": lambda: comm.Ibcast(a_in, root=0).Wait(),
    }


def gloo_variants(op: str, group, inp: torch.Tensor, out: torch.Tensor) -> Variants:
    """mcrdl on "gloo" and raw torch.distributed on its own Gloo group."""
    if op == "all_reduce":
        return {
            "mcrdl": lambda: mcrdl.all_reduce("gloo", inp),
            "blocking": lambda: dist.all_reduce(inp, group=group),
        }
    if op == "all_gather":
        gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        return {
            "mcrdl": lambda: mcrdl.all_gather("gloo", out, inp),
            "blocking": lambda: gather_single(out, inp, group=group),
        }
    if op == "all_to_all_single":
        return {
            "mcrdl": lambda: mcrdl.all_to_all_single("gloo", out, inp),
            "blocking": lambda: dist.all_to_all_single(out, inp, group=group),
        }
    return {
        "mcrdl": lambda: mcrdl.bcast("gloo", inp, src=0),
        "blocking": lambda: dist.broadcast(inp, src=0, group=group),
    }


def verify(what: str, variants: Variants, inp: torch.Tensor, out: torch.Tensor, rank: int,
           barrier: Callable[[], object]) -> None:
    """After timing (on zeros, which a call that moves nothing would leave right): each
    variant once on rank-dependent data into a sentinel output, which must equal what the
    raw library's blocking call gives. Exits with a message when one differs."""
    results = {}
    for name, call in variants.items():
        with torch.no_grad():
            inp.copy_((torch.arange(inp.numel()) % 7 + 3 * rank + 1).to(inp.dtype))
            if out is not inp:
                out.fill_(-1)
        barrier()
        call()
        results[name] = out.clone()
    ref = results["blocking"]
    bad = [name for name, got in results.items() if not torch.equal(got, ref)]
    if bad:
        raise SystemExit(f"overhead: {what}: {', '.join(bad)} gave other results than the raw "
                         "library's blocking call")


def measure(
    variants: Variants,
    barrier: Callable[[], object],
    comm: MPI.Comm,
    iters: int,
    warmup: int,
    block_iters: int,
) -> dict[str, float]:
    """Per variant: median over iterations of the per-iteration max over ranks (s).

    ``barrier`` (untimed) aligns the ranks before every iteration; ``comm`` reduces the
    times once at the end.
    """
    calls = list(variants.values())
    for call in calls:
        for _ in range(warmup):
            barrier()
            call()
    times = np.zeros((len(calls), iters))
    bounds = [*range(0, iters, block_iters), iters]
    for block, (first, last) in enumerate(itertools.pairwise(bounds)):
        order = range(len(calls)) if block % 2 == 0 else reversed(range(len(calls)))
        for index in order:
            call, row = calls[index], times[index]
            for i in range(first, last):
                barrier()
                start = time.perf_counter()
                call()
                row[i] = time.perf_counter() - start
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return {name: float(np.median(row)) for name, row in zip(variants, times, strict=True)}


class RawGloo:
    """A torch.distributed Gloo communicator independent of mcrdl's own Gloo groups.

    mcrdl never touches torch.distributed's default group, so normally this makes it
    (rendezvous on MASTER_ADDR, default 127.0.0.1, and a free port that rank 0 picks and
    broadcasts); if the default group already exists, a new group of its own is used.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        self.owns_default = not dist.is_initialized()
        if not self.owns_default:
            self.group = dist.new_group(backend="gloo")
            self.sync_group = dist.new_group(backend="gloo")
            return
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = None
        if comm.Get_rank() == 0:
            with socket.socket() as sock:
                sock.bind((addr, 0))
                port = sock.getsockname()[1]
        port = comm.bcast(port, root=0)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{addr}:{port}",
            rank=comm.Get_rank(),
            world_size=comm.Get_size(),
        )
        self.group = dist.group.WORLD
        self.sync_group = dist.new_group(backend="gloo")

    def barrier(self) -> None:
        """Align the ranks on a group of its own (not the measured one)."""
        dist.barrier(group=self.sync_group)

    def close(self) -> None:
        if self.owns_default:
            dist.destroy_process_group()
        else:
            dist.destroy_process_group(self.group)
            dist.destroy_process_group(self.sync_group)


def environment(comm: MPI.Comm) -> dict[str, object]:
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_per_node = node.Get_size()
    node.Free()
    return {
        "ranks": comm.Get_size(),
        "ranks_per_node": ranks_per_node,
        "MCRDL_RANKS_PER_NODE": os.environ.get("MCRDL_RANKS_PER_NODE", "unset"),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        **library_versions(),
        "numpy": np.__version__,
        "mpi_thread_multiple": MPI.Query_thread() == MPI.THREAD_MULTIPLE,
    }


def summary(rows: list[dict], backend: str) -> str:
    mine = [row for row in rows if row["backend"] == backend]
    large = [row for row in mine if row["size_bytes"] >= MIB]
    small = [row for row in mine if row["size_bytes"] <= SMALL_BYTES]
    parts = [f"# summary {backend}:"]
    if large:
        worst = max(large, key=lambda row: row["ratio"])
        parts.append(
            f"worst ratio >= 1 MiB {worst['ratio']:.3f} "
            f"({worst['op']} {format_size(worst['size_bytes'])});"
        )
    else:
        parts.append("worst ratio >= 1 MiB n/a (no size >= 1 MiB);")
    if small:
        worst = max(small, key=lambda row: row["added_us"])
        parts.append(
            f"worst added latency <= 1 KiB {worst['added_us']:+.2f} us "
            f"({worst['op']} {format_size(worst['size_bytes'])}, "
            f"ratio {worst['ratio']:.3f})"
        )
    else:
        parts.append("worst added latency <= 1 KiB n/a (no size <= 1 KiB)")
    return " ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    usable = mcrdl.available_backends()
    backends = args.backend or [name for name in BACKENDS if name in usable]
    missing = [name for name in backends if name not in usable]
    if missing or not backends:
        sys.exit(
            f"overhead.py: backends {missing or list(BACKENDS)} not usable here (usable: {usable})"
        )
    mcrdl.init(backends)
    comm = MPI.COMM_WORLD.Dup()  # the raw baseline's communicator
    sync = MPI.COMM_WORLD.Dup()  # aligns ranks between iterations and reduces the times
    rank, nranks = comm.Get_rank(), comm.Get_size()
    raw_gloo = RawGloo(sync) if "gloo" in backends else None
    dtype = DTYPES[args.dtype]

    def emit(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    sizes = sizes_for(args)

    def run_size(backend: str, op: str, requested: int) -> tuple[int, dict[str, float]]:
        """Bytes actually moved and the median (s) of each variant, "mcrdl" included."""
        inp, out, nbytes = make_buffers(op, requested, dtype, nranks)
        if backend == "mpi":
            variants, barrier = mpi_variants(op, comm, inp, out), sync.Barrier
        else:
            variants = gloo_variants(op, raw_gloo.group, inp, out)
            barrier = raw_gloo.barrier
        medians = measure(
            variants, barrier, sync, iters_for(nbytes, args), args.warmup, args.block_iters
        )
        verify(f"{backend} {op} {nbytes} B", variants, inp, out, rank, barrier)
        return nbytes, medians

    env = environment(sync)
    emit("# mcrdl overhead vs raw libraries (same buffers, interleaved, one run)")
    emit("# " + ", ".join(f"{key} {value}" for key, value in env.items()))
    emit(
        f"# dtype {args.dtype}; iters {args.iters} (>1 MiB: scaled, >= {args.min_iters}), "
        f"warmup {args.warmup}, variants alternate every {args.block_iters} iterations"
    )
    emit(
        "# time: median over iterations of the per-iteration max over ranks; "
        "ratio = ours / best raw; added = ours - best raw"
    )
    rows: list[dict] = []
    for backend in backends:
        for op in args.op:
            raw_names = RAW_VARIANTS[backend]
            emit("#")
            emit(f"# {op} on {backend}, {nranks} ranks; raw = {RAW_BASELINE[backend]}")
            emit(
                f"#{'size(B)':>11} {'ours(us)':>11} {'raw(us)':>11} {'ratio':>8} "
                f"{'added(us)':>10}  " + " ".join(f"{name + '(us)':>16}" for name in raw_names)
            )
            run_size(backend, op, sizes[0])  # unreported: warms up this table
            for requested in sizes:
                nbytes, medians = run_size(backend, op, requested)
                ours = medians.pop("mcrdl")
                best = min(medians.values())
                row = {
                    "backend": backend,
                    "op": op,
                    "size_bytes": nbytes,
                    "ours_us": ours * 1e6,
                    "raw_us": best * 1e6,
                    "ratio": ours / best if best > 0 else float("inf"),
                    "added_us": (ours - best) * 1e6,
                    "raw_variants_us": {name: t * 1e6 for name, t in medians.items()},
                }
                rows.append(row)
                emit(
                    f" {nbytes:>11} {row['ours_us']:>11.2f} {row['raw_us']:>11.2f} "
                    f"{row['ratio']:>8.3f} {row['added_us']:>+10.2f}  "
                    + " ".join(f"{t:>16.2f}" for t in row["raw_variants_us"].values())
                )
    emit("#")
    for backend in backends:
        emit(summary(rows, backend))
    if rank == 0 and args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"environment": env, "args": vars(args), "rows": rows}, handle, indent=2)
    if raw_gloo is not None:
        raw_gloo.close()
    comm.Free()
    sync.Free()
    mcrdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
