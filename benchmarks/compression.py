"""zfp compression: bytes on the wire vs uncompressed, error and time, per mode.

For each zfp mode (fixed rate, fixed precision, fixed accuracy; two settings each), data
kind (random normals; a smooth 2-D field) and operation (all_gather, bcast,
all_to_all_single, send/recv ring, all_reduce SUM), one float32 tensor of ``--values``
values (2-D, square) per rank goes through ``mcrdl.extensions(compression=...)``.
Printed per row: the bytes this rank handed to the backend (zfp blocks with their tag
byte and the 8-byte sizes) / the uncompressed bytes, summed over ranks; the max
absolute error over every received value (all_reduce: against the exact sum); and the
time compressed / uncompressed (median of the per-iteration max over ranks).

Usage::

    mpiexec -n 2 python benchmarks/compression.py
    mpiexec -n 4 python benchmarks/compression.py --backend gloo --values 1M
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from collections.abc import Sequence

import mpi4py
import numpy as np
import torch

import mcrdl
from mcrdl.extensions import compression_stats
from mcrdl.tuning.sizes import parse_size

mpi4py.rc.thread_level = "multiple"
MPI = importlib.import_module("mpi4py.MPI")

MODES = [
    ("rate", {"mode": "rate", "rate": 4}), ("rate", {"mode": "rate", "rate": 12}),
    ("precision", {"mode": "precision", "precision": 12}),
    ("precision", {"mode": "precision", "precision": 20}),
    ("accuracy", {"mode": "accuracy", "tolerance": 1e-2}),
    ("accuracy", {"mode": "accuracy", "tolerance": 1e-5}),
]
OPS = ("all_gather", "bcast", "all_to_all_single", "send_recv", "all_reduce")


def field(kind: str, side: int, r: int) -> torch.Tensor:
    if kind == "random":
        return torch.from_numpy(np.random.default_rng(r).standard_normal((side, side))
                                .astype(np.float32))
    x = np.linspace(0, 1, side)
    xx, yy = np.meshgrid(x, x, indexing="ij")
    return torch.from_numpy((np.sin(6 * xx + r) * np.cos(4 * yy) * 10).astype(np.float32))


def run_op(op: str, backend: str, x: torch.Tensor, rank: int, size: int):
    """One call of `op`; returns (received tensor(s), what they should be)."""
    side = x.shape[0]
    if op == "all_gather":
        out = torch.empty((size, *x.shape))
        mcrdl.all_gather(backend, out, x)
        return out, None  # compared with every rank's field by the caller
    if op == "bcast":
        t = x.clone()
        mcrdl.bcast(backend, t, src=0)
        return t, 0
    if op == "all_to_all_single":
        rows = side // size * size
        out = torch.empty((rows, side))
        mcrdl.all_to_all_single(backend, out, x[:rows].contiguous())
        return out, "a2a"
    if op == "send_recv":
        out = torch.empty_like(x)
        w = mcrdl.send(backend, x, dst=(rank + 1) % size, tag=9, async_op=True)
        mcrdl.recv(backend, out, src=(rank - 1) % size, tag=9)
        w.wait()
        return out, (rank - 1) % size
    t = x.clone()
    mcrdl.all_reduce(backend, t)
    return t, "sum"


def max_error(op, got, ref, fields, rank, size) -> float:
    if op == "all_gather":
        return max(float((got[r] - fields[r]).abs().max()) for r in range(size))
    if ref == "sum":
        exact = sum(f.double() for f in fields)
        return float((got.double() - exact).abs().max())
    if ref == "a2a":
        rows = got.shape[0] // size
        return max(float((got[r * rows:(r + 1) * rows]
                          - fields[r][rank * rows:(rank + 1) * rows]).abs().max())
                   for r in range(size))
    return float((got - fields[ref]).abs().max())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="zfp compression: wire bytes, error, time")
    p.add_argument("--backend", default="mpi")
    p.add_argument("--values", type=parse_size, default=1 << 18,
                   help="float32 values per rank (a square is used; default 256K)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations (5)")
    args = p.parse_args(argv)
    mcrdl.init([args.backend])
    sync = MPI.COMM_WORLD.Dup()
    rank, size = sync.Get_rank(), sync.Get_size()
    side = int(math.isqrt(args.values))

    def timed(fn) -> float:
        times = np.zeros(args.iters)
        fn()
        for i in range(args.iters):
            sync.Barrier()
            start = time.perf_counter()
            fn()
            times[i] = time.perf_counter() - start
        sync.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
        return float(np.median(times))

    if rank == 0:
        print(f"# zfp compression on '{args.backend}', {size} ranks, float32 {side}x{side} "
              f"per rank ({side * side * 4} B); wire/raw summed over ranks; time = median "
              "of the per-iteration max over ranks", flush=True)
        print(f"{'mode':<10} {'param':>8} {'data':<7} {'op':<18} {'raw(B)':>11} "
              f"{'wire(B)':>11} {'wire/raw':>8} {'max err':>10} {'bound':>9} "
              f"{'t_zfp/t_raw':>11}", flush=True)
    for kind in ("random", "smooth"):
        fields = [field(kind, side, r) for r in range(size)]
        x = fields[rank]
        for op in OPS:
            t_raw = timed(lambda op=op, x=x: run_op(op, args.backend, x, rank, size))
            for mode, settings in MODES:
                param = next(v for k, v in settings.items() if k != "mode")
                with mcrdl.extensions(compression=settings):
                    compression_stats(reset=True)
                    got, ref = run_op(op, args.backend, x, rank, size)
                    stats = compression_stats()["total"]
                    t_zfp = timed(lambda op=op, x=x: run_op(op, args.backend, x, rank, size))
                err = max_error(op, got, ref, fields, rank, size)
                counts = np.array([stats["raw_bytes"], stats["wire_bytes"]], dtype=np.int64)
                sync.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
                errs = np.array([err])
                sync.Allreduce(MPI.IN_PLACE, errs, op=MPI.MAX)
                bound = ""
                if mode == "accuracy":
                    bound = f"{param * (size if op == 'all_reduce' else 1):.0e}"
                    if errs[0] > float(bound):
                        print(f"rank {rank}: error {errs[0]} above the bound {bound}",
                              file=sys.stderr)
                if rank == 0:
                    print(f"{mode:<10} {param:>8} {kind:<7} {op:<18} {counts[0]:>11} "
                          f"{counts[1]:>11} {counts[1] / counts[0]:>8.4f} {errs[0]:>10.3g} "
                          f"{bound:>9} {t_zfp / t_raw:>11.2f}", flush=True)
    sync.Free()
    mcrdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
