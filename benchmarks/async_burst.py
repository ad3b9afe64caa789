"""Bursts of small async ops: N async all_reduces posted, then all waited, per op cost by
N and by variant, the contenders alternating trial by trial in one run.

Usage::

    mpiexec -n 2 python benchmarks/async_burst.py
    mpiexec -n 2 python benchmarks/async_burst.py --order mpi4py --counts 64 512 \\
        --variants default nonblocking blocking nonblocking@8 nonblocking@1000000

``--order``: "mcrdl" (mcrdl initializes MPI, with its MPICH selection) or "mpi4py" (the
program imports mpi4py.MPI first, as many do: MPI_THREAD_MULTIPLE under MPICH's own
selection). A variant is "default" (the backend's choice), or one forced for all_reduce
("blocking": the blocking MPI collective, which async calls run on the communicator's
issue thread; "nonblocking": the nonblocking one, polled); "@W" also sets how many
nonblocking collectives a communicator keeps in MPI at once (``_C.set_mpi_window``,
default 32).

Method: each trial runs every (variant, count) once, in that order, after an untimed
mpi4py barrier of a communicator of its own; a trial's time is the maximum over the
ranks; each figure is the median over ``--trials`` (``post``: the part spent posting).
``ratio`` = cost per op at the largest count / at the smallest: 1 when the cost per op
does not depend on how many ops are in flight.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import time
from collections.abc import Sequence


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="per-op cost of bursts of small async ops")
    p.add_argument("--order", choices=("mcrdl", "mpi4py"), default="mcrdl",
                   help="who initializes MPI (default mcrdl)")
    p.add_argument("--counts", type=int, nargs="+", default=[64, 512],
                   help="ops per burst (64 512)")
    p.add_argument("--bytes", type=int, default=1024, help="bytes of each op (1024)")
    p.add_argument("--variants", nargs="+", default=["default", "nonblocking", "blocking"],
                   metavar="VARIANT[@W]")
    p.add_argument("--trials", type=int, default=9, help="timed trials (9)")
    p.add_argument("--backend", default="mpi")
    args = p.parse_args(argv)
    if min(args.counts) < 1 or args.bytes < 4 or args.bytes % 4 or args.trials < 1:
        p.error("--counts and --trials must be >= 1, --bytes a multiple of 4")
    for v in args.variants:
        name, _, win = v.partition("@")
        if name not in ("default", "blocking", "nonblocking") or (win and not win.isdigit()):
            p.error(f"--variants: {v!r} is not default, blocking or nonblocking, "
                    "optionally with @W (a window of W >= 1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.order == "mpi4py":
        MPI = importlib.import_module("mpi4py.MPI")
    import numpy as np
    import torch

    import mcrdl
    from mcrdl import _C

    mcrdl.init([args.backend])
    if args.order == "mcrdl":
        from mcrdl.bootstrap import mpi_module
        MPI = mpi_module()
    impl = mcrdl.api.current_runtime().backend(args.backend)
    sync = MPI.COMM_WORLD.Dup()
    tensors = [torch.ones(args.bytes // 4) for _ in range(max(args.counts))]

    @contextlib.contextmanager
    def variant(v: str):
        name, _, win = v.partition("@")
        old = _C.mpi_window()
        if win:
            _C.set_mpi_window(int(win))
        try:
            with (contextlib.nullcontext() if name == "default"
                  else impl.variant("all_reduce", name)):
                yield
        finally:
            _C.set_mpi_window(old)

    def burst(n: int) -> np.ndarray:
        sync.Barrier()
        start = time.perf_counter()
        works = [mcrdl.all_reduce(args.backend, t, async_op=True) for t in tensors[:n]]
        posted = time.perf_counter()
        for w in works:
            w.wait()
        out = np.array([(time.perf_counter() - start) / n, (posted - start) / n])
        sync.Allreduce(MPI.IN_PLACE, out, op=MPI.MAX)
        return out

    runs = {(v, n): [] for v in args.variants for n in args.counts}
    for v in args.variants:  # warm-up
        with variant(v):
            for n in args.counts:
                burst(n)
    for _ in range(args.trials):
        for v in args.variants:
            with variant(v):
                for n in args.counts:
                    runs[(v, n)].append(burst(n))
    if sync.Get_rank() == 0:
        mode = impl.init_mode if hasattr(impl, "init_mode") else {}
        print(f"# {args.backend}, {sync.Get_size()} ranks, {args.bytes} B all_reduces, "
              f"order {args.order}, init mode {sorted(mode.items())}; "
              f"median of {args.trials} trials, us per op (post)", flush=True)
        lo, hi = min(args.counts), max(args.counts)
        for v in args.variants:
            med = {n: np.median(np.array(runs[(v, n)]), axis=0) * 1e6 for n in args.counts}
            cells = "  ".join(f"{n}: {med[n][0]:7.2f} ({med[n][1]:5.2f})" for n in args.counts)
            print(f"{v:<20} {cells}  ratio {med[hi][0] / med[lo][0]:.3f}", flush=True)
    sync.Free()
    mcrdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
