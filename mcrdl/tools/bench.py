"""mcrdl-bench: nccl-tests style bandwidth/latency benchmark of mcrdl collectives.

Run it under any launcher mcrdl understands; every rank runs the same sweep and rank 0
prints one table per (operation, backend)::

    mpiexec -n 4 mcrdl-bench --op all_reduce all_gather --max-bytes 64M
    mpiexec -n 2 python -m mcrdl.tools.bench --backend mpi gloo --dtype float64 --json out.json
    torchrun --nproc-per-node 4 -m mcrdl.tools.bench --op bcast --backend gloo

Columns (as in nccl-tests):

- ``size(B)``: bytes of the largest buffer one rank touches. That is the reduced or
  broadcast tensor (all_reduce, reduce, bcast); the gathered output, i.e. n x the
  per-rank input (all_gather, gather and their v variants); the scattered input, i.e.
  n x the per-rank output (reduce_scatter, scatter, scatterv); the per-rank send buffer
  (all_to_all, all_to_all_single, all_to_allv). For the operations that split a buffer
  into n blocks the element count is rounded down to a multiple of n (at least n).
- ``count(elements)``: ``size / element size``.
- ``time(us)``: every rank times each iteration (a barrier on the same backend, not
  timed, precedes each one); after the timed loop one ``all_reduce(MAX)`` through mcrdl
  gives the per-iteration maximum over ranks, and the column is the median of those.
- ``algbw(GB/s)``: ``size / time`` (GB = 1e9 bytes).
- ``busbw(GB/s)``: ``algbw x factor``; factor ``2(n-1)/n`` for all_reduce, ``(n-1)/n``
  for all_gather, reduce_scatter and all_to_all*, ``1`` for bcast, reduce, gather and
  scatter; barrier moves no data and reports 0.

``--json PATH`` writes the same results (unrounded) for machines to read.

The header says when a node runs more ranks than the CPUs their affinity masks cover
(``oversubscribed`` in the JSON): the ranks then take turns on the cores, and the table
measures the operating system's scheduling more than the library. Run as many ranks per
node as it has cores (or fewer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

import mcrdl
from mcrdl.launch import affinity_bits, node_id, node_layout, oversubscribed
from mcrdl.ops import COLLECTIVES, OPS, Agreement
from mcrdl.tuning.sizes import add_size_sweep_args, check_size_sweep, format_size, size_range

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}

# Operations whose buffer is split into one block per rank (bytes per rank, counts, or
# an exchange with every peer).
BLOCKED_OPS = frozenset(
    op for op, s in OPS.items() if s.nbytes is not None
    and (s.nbytes.per_rank or s.nbytes.counts or s.agreement is Agreement.EXCHANGE))
DEFAULT_BACKENDS = ("mpi", "gloo")
GPU_BACKENDS = frozenset({"nccl", "rccl"})

def element_count(op: str, nbytes: int, itemsize: int, nranks: int) -> int:
    """Elements of the buffer ``size(B)`` describes for ``op`` (see the module docstring)."""
    if op == "barrier":
        return 0
    count = max(nbytes // itemsize, 1)
    if op in BLOCKED_OPS:
        count = max(count - count % nranks, nranks)
    return count


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcrdl-bench",
        description=(
            "nccl-tests style benchmark of mcrdl collectives. Run under mpiexec, "
            "torchrun or srun; rank 0 prints the tables."
        ),
        epilog=(
            "size(B) is the bytes of the largest buffer one rank touches: the reduced or "
            "broadcast tensor; the gathered OUTPUT for all_gather/gather (n x the per-rank "
            "input, as nccl-tests); the scattered INPUT for reduce_scatter/scatter (n x the "
            "per-rank output); the per-rank send buffer for all_to_all*. Split buffers are "
            "rounded down to a multiple of n elements. time(us) is the median over "
            "iterations of the per-iteration maximum over ranks; algbw = size/time; "
            "busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, "
            "all_to_all*), 1 (bcast, reduce, gather, scatter)."
        ),
    )
    parser.add_argument(
        "--op",
        nargs="+",
        choices=COLLECTIVES,
        default=["all_reduce"],
        metavar="OP",
        help=f"operations to run (default all_reduce); any of: {', '.join(COLLECTIVES)}",
    )
    parser.add_argument(
        "--backend",
        nargs="+",
        metavar="NAME",
        help="backends to run (default: every usable one among mpi, gloo)",
    )
    add_size_sweep_args(parser, factor=2)
    add_run_args(parser)
    return parser


def add_run_args(parser: argparse.ArgumentParser, *, dtypes: Sequence[str] = tuple(DTYPES),
                 iters: int = 20, iters_help: str = "timed iterations") -> None:
    """The options of how each point runs, shared with benchmarks/overhead.py: --dtype
    (one of `dtypes`, keys of DTYPES), --iters (default `iters`), --warmup, --json."""
    parser.add_argument(
        "--dtype", choices=tuple(dtypes), default="float32",
        help="element type (default float32)",
    )
    parser.add_argument(
        "--iters", type=positive_int, default=iters, help=f"{iters_help} (default {iters})"
    )
    parser.add_argument(
        "--warmup",
        type=non_negative_int,
        default=5,
        help="untimed iterations before timing (default 5)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; exits with status 2 and a message on error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_size_sweep(parser, args)
    usable = mcrdl.available_backends()
    if args.backend is None:
        args.backend = [name for name in DEFAULT_BACKENDS if name in usable]
        if not args.backend:
            parser.error(
                f"none of the default backends {', '.join(DEFAULT_BACKENDS)} is usable here "
                f"(usable: {', '.join(usable) or 'none'}); pass --backend"
            )
    unusable = [name for name in args.backend if name != "auto" and name not in usable]
    if unusable:
        parser.error(
            f"backend(s) {', '.join(unusable)} not usable here; usable: "
            f"{', '.join(usable) or 'none'} (and auto)"
        )
    return args


def library_versions() -> dict[str, str]:
    """Versions of mcrdl, torch, mpi4py and the MPI library (when MPI is loaded)."""
    versions = {
        "mcrdl": getattr(mcrdl, "__version__", "unknown"),
        "torch": torch.__version__,
    }
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        versions["mpi"] = "not loaded"
    else:
        versions["mpi4py"] = sys.modules["mpi4py"].__version__
        versions["mpi"] = " ".join(mpi.Get_library_version().splitlines()[0].split())
    return versions


def make_call(
    op: str,
    backend: str,
    count: int,
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
    nranks: int,
    group: mcrdl.Group | None = None,
    async_op: bool = False,
) -> Callable[[], object]:
    """A no-argument closure that runs ``op`` once on preallocated buffers.

    ``rank``/``nranks`` are this process's rank in and the size of ``group`` (the world
    when None); roots are group rank 0. With ``async_op`` the closure returns the Work.
    """
    kw = {"group": group, "async_op": async_op}

    def buf(numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    reduce_op = mcrdl.ReduceOp.BOR if dtype is torch.bool else mcrdl.ReduceOp.SUM
    block = count // nranks
    blocks = [block] * nranks
    root = rank == 0
    if op == "all_reduce":
        t = buf(count)
        return lambda: mcrdl.all_reduce(backend, t, op=reduce_op, **kw)
    if op == "reduce":
        t = buf(count)
        return lambda: mcrdl.reduce(backend, t, dst=0, op=reduce_op, **kw)
    if op == "bcast":
        t = buf(count)
        return lambda: mcrdl.bcast(backend, t, src=0, **kw)
    if op == "barrier":
        return lambda: mcrdl.barrier(backend, **kw)
    if op == "all_gather":
        inp, out = buf(block), buf(count)
        return lambda: mcrdl.all_gather(backend, out, inp, **kw)
    if op == "all_gatherv":
        inp, out = buf(block), buf(count)
        return lambda: mcrdl.all_gatherv(backend, out, inp, blocks, **kw)
    if op == "gather":
        inp, out = buf(block), buf(count) if root else None
        return lambda: mcrdl.gather(backend, out, inp, dst=0, **kw)
    if op == "gatherv":
        inp, out = buf(block), buf(count) if root else None
        return lambda: mcrdl.gatherv(backend, out, inp, blocks, dst=0, **kw)
    if op == "scatter":
        inp, out = buf(count) if root else None, buf(block)
        return lambda: mcrdl.scatter(backend, out, inp, src=0, **kw)
    if op == "scatterv":
        inp, out = buf(count) if root else None, buf(block)
        return lambda: mcrdl.scatterv(backend, out, inp, blocks, src=0, **kw)
    if op == "reduce_scatter":
        inp, out = buf(count), buf(block)
        return lambda: mcrdl.reduce_scatter(backend, out, inp, op=reduce_op, **kw)
    if op == "all_to_all_single":
        inp, out = buf(count), buf(count)
        return lambda: mcrdl.all_to_all_single(backend, out, inp, **kw)
    if op == "all_to_all":
        inputs = [buf(block) for _ in range(nranks)]
        outputs = [buf(block) for _ in range(nranks)]
        return lambda: mcrdl.all_to_all(backend, outputs, inputs, **kw)
    if op == "all_to_allv":
        inp, out = buf(count), buf(count)
        return lambda: mcrdl.all_to_allv(backend, out, inp, blocks, blocks, **kw)
    raise ValueError(f"unknown op {op!r}; expected one of {', '.join(COLLECTIVES)}")


def time_call(
    call: Callable[[], object], backend: str, device: torch.device, iters: int, warmup: int,
    group: mcrdl.Group | None = None,
) -> float:
    """Median over iterations of the per-iteration max over ranks (of `group`), in s."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    backend = barrier_backend(backend)  # pccl has no barrier: line up on another one
    for _ in range(warmup):
        mcrdl.barrier(backend, group=group)
        call()
    sync()
    times = [0.0] * iters
    for i in range(iters):
        mcrdl.barrier(backend, group=group)
        start = time.perf_counter()
        call()
        sync()
        times[i] = time.perf_counter() - start
    worst = torch.tensor(times, dtype=torch.float64, device=device)
    mcrdl.all_reduce(backend, worst, op=mcrdl.ReduceOp.MAX, group=group)
    return statistics.median(worst.tolist())


def _lines_up(backend: str) -> bool:
    """Whether `backend` has what the timing loop lines the ranks up with."""
    from mcrdl.backends.registry import backend_class

    ops = backend_class(backend).supported_ops()
    return "barrier" in ops and "all_reduce" in ops


def barrier_backend(backend: str) -> str:
    """`backend` when it has barrier (and all_reduce), else the first initialized one
    that has (the ranks line up before each timed call and agree on the slowest)."""
    if backend == "auto":  # routes both to a backend that has them
        return backend

    if _lines_up(backend):
        return backend
    return next((b for b in mcrdl.get_backends() if _lines_up(b)), backend)


def crowded_nodes() -> dict[str, tuple[int, int]]:
    """The nodes whose ranks outnumber the CPUs their affinity masks cover together, as
    {node: (ranks, CPUs)} (collective: every rank calls it). The rule and its inputs are
    the ones the mpi backend settles its waiting with at init (mcrdl.launch.node_layout,
    oversubscribed): there the ranks share cores, and the times are mostly the operating
    system's scheduling."""
    masks = mcrdl.all_gather_object((node_id(), affinity_bits()))
    return {node: (n, cpus) for node, (n, cpus) in node_layout(masks).items()
            if oversubscribed(n, cpus)}


def crowded_note(crowded: dict[str, tuple[int, int]]) -> list[str]:
    """The header lines that say so (none for a node with a core per rank)."""
    return [f"# oversubscribed: node {node.split('/')[0]} runs {n} ranks on {cpus} CPU(s) "
            f"(their affinity masks together), so the times below are mostly scheduling "
            f"noise; run at most {cpus} rank(s) per node (e.g. mpiexec -n {cpus})"
            for node, (n, cpus) in sorted(crowded.items())]


def device_for(backend: str) -> torch.device:
    if backend in GPU_BACKENDS:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_HEADER = (
    f"#{'size(B)':>13} {'count(elements)':>16} {'type':>9} {'time(us)':>12} "
    f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"
)


def _format_row(row: dict) -> str:
    return (
        f" {row['size_bytes']:>13} {row['count']:>16} {row['dtype']:>9} "
        f"{row['time_us']:>12.2f} {row['algbw_gbps']:>12.3f} {row['busbw_gbps']:>12.3f}"
    )


def run_table(
    op: str,
    backend: str,
    sizes: Sequence[int],
    args: argparse.Namespace,
    rank: int,
    nranks: int,
    emit: Callable[[str], None],
) -> list[dict]:
    """Benchmark ``op`` on ``backend`` over ``sizes``; print and return the rows."""
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    device = device_for(backend)
    factor = OPS[op].bus_factor(nranks)
    counts = sorted({element_count(op, size, itemsize, nranks) for size in sizes})
    emit("#")
    emit(f"# {op} on {backend}: {nranks} ranks, busbw factor {factor:.4f}")
    emit("#")
    emit(_HEADER)
    rows = []
    for count in counts:
        call = make_call(op, backend, count, dtype, device, rank, nranks)
        seconds = time_call(call, backend, device, args.iters, args.warmup)
        nbytes = count * itemsize
        algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        row = {
            "op": op,
            "backend": backend,
            "size_bytes": nbytes,
            "count": count,
            "dtype": args.dtype,
            "time_us": seconds * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * factor,
            "busbw_factor": factor,
        }
        rows.append(row)
        emit(_format_row(row))
    if rows:
        average = statistics.fmean(row["busbw_gbps"] for row in rows)
        emit(f"# average busbw: {average:.3f} GB/s")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mcrdl-bench``; returns the process exit status."""
    args = parse_args(argv)
    names = [name for name in args.backend if name != "auto"]
    if names and not any(_lines_up(n) for n in names):
        # none of them has barrier and all_reduce (pccl alone): the ranks line up on
        # another backend, as they do beside one that has them
        names += [b for b in ("mpi", "gloo") if b in mcrdl.available_backends()][:1]
    mcrdl.init(names or None)
    rank, nranks = mcrdl.get_rank(), mcrdl.get_size()

    def emit(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    versions = library_versions()
    sizes = size_range(args.min_bytes, args.max_bytes, args.factor)
    emit(f"# mcrdl-bench: world size {nranks}, backends {', '.join(args.backend)}")
    emit("# versions: " + ", ".join(f"{name} {value}" for name, value in versions.items()))
    emit(
        f"# ops {', '.join(args.op)}; sizes {format_size(sizes[0])}..{format_size(sizes[-1])} "
        f"x{args.factor}; dtype {args.dtype}; iters {args.iters}, warmup {args.warmup}"
    )
    emit(
        "# time: median over iterations of the per-iteration max over ranks "
        "(untimed barrier before each iteration)"
    )
    crowded = crowded_nodes()
    for line in crowded_note(crowded):
        emit(line)
    rows: list[dict] = []
    skipped: list[dict] = []
    for op in args.op:
        for backend in args.backend:
            try:
                rows += run_table(op, backend, sizes, args, rank, nranks, emit)
            except mcrdl.UnsupportedOperationError as error:
                emit(f"# {op} on {backend}: skipped, {error}")
                skipped.append({"op": op, "backend": backend, "reason": str(error)})
    if rank == 0 and args.json:
        report = {
            "tool": "mcrdl-bench",
            "world_size": nranks,
            "backends": args.backend,
            "ops": args.op,
            "dtype": args.dtype,
            "iters": args.iters,
            "warmup": args.warmup,
            "versions": versions,
            "oversubscribed": {node: {"ranks": n, "cpus": cpus}
                               for node, (n, cpus) in crowded.items()},
            "rows": rows,
            "skipped": skipped,
        }
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    mcrdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
