"""Tensor fusion: many small all_reduces, fused vs unfused, side by side in one run.

Each iteration issues ``--count`` async all_reduces of ``--bytes`` each (float32, the
pattern of data-parallel gradient all-reduce) and waits for all of them; "fused" runs
the same iteration inside ``mcrdl.extensions(fusion=...)``. Results are checked.

Usage::

    mpiexec -n 2 python benchmarks/fusion.py
    mpiexec -n 4 python benchmarks/fusion.py --backend gloo --count 512 --bytes 1K

Method: warm up each contender, then time them in rotating blocks of ``--block-iters``
iterations (unfused, fused, plain; each block starts one later in that order); an
untimed mpi4py barrier on a communicator of its own precedes each iteration; one
``Allreduce(MAX)`` at the end gives the per-iteration maximum over ranks; each figure is
the median of those. ``speedup`` = unfused / fused time. ``issue`` is the part of an
iteration spent issuing the calls (the rest is waiting: for the unfused calls to
complete, or for the fused round - agreement, fused all_reduce, copies - to run);
``us/call`` divides the iteration by ``--count``.

The unfused baseline runs on the fastest path mcrdl offers for the calls: on a backend
with MPI variants (``variant``: "mpi", "cray-mpich") a plain loop of the same async calls
(post ``--count``, wait for all; no fills, checks or barriers inside) is timed with each
variant forced, and the unfused iterations run the fastest (``path``; "chosen": the
backend's own choice, where it has no variants). The plain loop on that path is the third
contender of the timed blocks: ``plain us/call`` is its median per call, measured in the
same run as the unfused iterations, and ``unfused/plain`` the ratio of the two (the
unfused iteration differs only by the fill before it and the check after it, both
untimed).

A second table gives a floor of the fused iteration, from parts measured the same way:
issuing the calls (``issue``: the fused variant's issue time above; each call is
validated and buffered in one C++ call, and returns its Work), one agreement (all_reduce
of 8 bytes), one all_reduce of the whole fused buffer, and the copies into and out of it
(one memcpy per tensor); ``best`` = unfused / floor, the speedup fusion could reach if
the rest of a round (its bookkeeping, the waits) cost nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import sys
import time
from collections.abc import Sequence

import mpi4py
import numpy as np
import torch

import mcrdl
from mcrdl import _C
from mcrdl.extensions import FusionConfig, fusion_stats
from mcrdl.tuning.sizes import parse_size

mpi4py.rc.thread_level = "multiple"
MPI = importlib.import_module("mpi4py.MPI")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="fused vs unfused small all_reduces")
    p.add_argument("--backend", nargs="+", default=["mpi", "gloo"], metavar="NAME")
    p.add_argument("--count", type=int, default=512, help="all_reduces per iteration (512)")
    p.add_argument("--bytes", type=parse_size, default=1024, help="bytes of each (1K)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per variant (20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per variant (3)")
    p.add_argument("--block-iters", type=int, default=5,
                   help="iterations of one variant before the other takes over (5)")
    p.add_argument("--buffer-bytes", type=parse_size, default=FusionConfig().buffer_bytes,
                   help="fusion buffer size B (default 16M)")
    p.add_argument("--wait-us", type=float, default=FusionConfig().wait_us,
                   help="fusion wait time T in microseconds (default 2000)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if min(args.count, args.bytes, args.iters, args.block_iters) < 1 or args.warmup < 0 \
            or args.bytes % 4:
        p.error("--count, --bytes (a multiple of 4), --iters, --block-iters must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mcrdl.init(args.backend)
    sync = MPI.COMM_WORLD.Dup()
    rank, size = sync.Get_rank(), sync.Get_size()
    config = FusionConfig(buffer_bytes=args.buffer_bytes, wait_us=args.wait_us)
    tensors = [torch.zeros(args.bytes // 4) for _ in range(args.count)]

    def emit(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    def iteration(backend: str) -> tuple[float, float]:
        for k, t in enumerate(tensors):
            t.fill_(rank + k)
        sync.Barrier()
        start = time.perf_counter()
        works = [mcrdl.all_reduce(backend, t, async_op=True) for t in tensors]
        issued = time.perf_counter() - start
        for w in works:
            w.wait()
        took = time.perf_counter() - start
        # every element of every tensor, after the timing: sum over ranks of (r + k)
        base = size * (size - 1) / 2
        want = torch.tensor([base + size * k for k in range(len(tensors))])
        got = torch.stack([t for t in tensors])
        if not torch.equal(got, want.unsqueeze(1).expand_as(got)):
            raise SystemExit(f"rank {rank}: wrong all_reduce result on {backend}")
        return took, issued

    def timed(fn, reps: int = 30) -> float:
        """Median over `reps` of the max over ranks of one call of `fn`."""
        out = []
        for _ in range(reps):
            sync.Barrier()
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        arr = np.asarray(out)
        sync.Allreduce(MPI.IN_PLACE, arr, op=MPI.MAX)
        return float(np.median(arr))

    def floor(backend: str, issue: float) -> dict[str, float]:
        flat = torch.zeros(args.count * args.bytes // 4)
        count = torch.zeros(1, dtype=torch.int64)
        min_op = mcrdl.ReduceOp.MIN
        return {
            "issue": issue,
            "agreement": timed(lambda: mcrdl.all_reduce(backend, count, op=min_op)),
            "all_reduce": timed(lambda: mcrdl.all_reduce(backend, flat)),
            "copies": timed(lambda: _C.unpack_flat(_C.pack_flat(tensors), tensors)),
        }

    def burst(backend: str) -> None:
        works = [mcrdl.all_reduce(backend, t, async_op=True) for t in tensors]
        for w in works:
            w.wait()

    def plain(backend: str) -> float:
        """Seconds per call of a plain loop: post every call, then wait for all."""
        return timed(lambda: burst(backend), reps=9) / len(tensors)

    def plain_iteration(backend: str) -> tuple[float, float]:
        """A timed plain loop, as iteration() times its calls (no fill, no check)."""
        sync.Barrier()
        start = time.perf_counter()
        works = [mcrdl.all_reduce(backend, t, async_op=True) for t in tensors]
        issued = time.perf_counter() - start
        for w in works:
            w.wait()
        return time.perf_counter() - start, issued

    def fastest_path(backend: str):
        """(name, context manager factory) of the fastest path for the unfused calls, and
        the plain loop's seconds per call on it."""
        impl = mcrdl.api.current_runtime().backend(backend)
        if not hasattr(impl, "variant"):
            return "chosen", contextlib.nullcontext, plain(backend)
        costs = {}
        for name in ("blocking", "nonblocking"):
            with impl.variant("all_reduce", name):
                plain(backend)  # warm-up
                costs[name] = plain(backend)
        name = min(costs, key=costs.get)
        return name, lambda: impl.variant("all_reduce", name), costs[name]

    paths = {}

    def run(backend: str, kind: str, n: int) -> list[tuple[float, float]]:
        if kind == "plain":
            with paths[backend][1]():
                return [plain_iteration(backend) for _ in range(n)]
        if kind == "unfused":
            with paths[backend][1]():
                return [iteration(backend) for _ in range(n)]
        with mcrdl.extensions(fusion=config):
            return [iteration(backend) for _ in range(n)]

    emit(f"# tensor fusion: {args.count} async all_reduces of {args.bytes} B (float32) per "
         f"iteration, then wait for all; B = {args.buffer_bytes} B, T = {args.wait_us} us")
    emit(f"# ranks {size}, cpu_count {os.cpu_count()}, python {platform.python_version()}, "
         f"torch {torch.__version__}, mpi4py {mpi4py.__version__}, "
         f"{' '.join(MPI.Get_library_version().splitlines()[0].split())}")
    emit("# time: median over iterations of the per-iteration max over ranks; "
         "speedup = unfused / fused")
    emit(f"{'backend':<8} {'path':>11} {'unfused(ms)':>12} {'fused(ms)':>10} {'speedup':>8} "
         f"{'flushes/iter':>13} {'issue unfused/fused(ms)':>24} {'us/call unfused/fused':>22} "
         f"{'plain us/call':>14} {'unfused/plain':>14}")
    results = []
    kinds = ("unfused", "fused", "plain")
    for backend in args.backend:
        paths[backend] = fastest_path(backend)
        for kind in kinds:
            run(backend, kind, args.warmup)
        times = {kind: [] for kind in kinds}
        fusion_stats(reset=True)
        blocks = range(0, args.iters, args.block_iters)
        for b, first in enumerate(blocks):
            n = min(args.block_iters, args.iters - first)
            for k in range(len(kinds)):
                kind = kinds[(b + k) % len(kinds)]
                times[kind].extend(run(backend, kind, n))
        flushes = fusion_stats()["flushes"] / args.iters
        med, issue = {}, {}
        for kind, rows in times.items():
            arr = np.asarray(rows)  # columns: iteration, issuing
            sync.Allreduce(MPI.IN_PLACE, arr, op=MPI.MAX)
            med[kind], issue[kind] = (float(x) for x in np.median(arr, axis=0))
        speedup = med["unfused"] / med["fused"]
        path = paths[backend][0]
        plain_s = med["plain"] / args.count
        results.append({"backend": backend, "ranks": size, "path": path,
                        "unfused_s": med["unfused"], "fused_s": med["fused"],
                        "speedup": speedup, "flushes_per_iter": flushes,
                        "unfused_issue_s": issue["unfused"], "fused_issue_s": issue["fused"],
                        "plain_per_call_s": plain_s,
                        "unfused_over_plain": med["unfused"] / med["plain"]})
        per_call = (f"{med['unfused'] * 1e6 / args.count:.2f}/"
                    f"{med['fused'] * 1e6 / args.count:.2f}")
        issued = f"{issue['unfused'] * 1e3:.3f}/{issue['fused'] * 1e3:.3f}"
        emit(f"{backend:<8} {path:>11} {med['unfused'] * 1e3:>12.3f} "
             f"{med['fused'] * 1e3:>10.3f} {speedup:>7.1f}x {flushes:>13.1f} "
             f"{issued:>24} {per_call:>22} {plain_s * 1e6:>14.2f} "
             f"{med['unfused'] / med['plain']:>13.2f}x")
    emit(f"# floor of the fused iteration (ms): issuing the {args.count} calls + agreement + "
         f"one all_reduce of {args.count * args.bytes} B + copies in and out; best = unfused "
         "/ floor")
    emit(f"{'backend':<8} {'issue':>9} {'agreement':>10} {'all_reduce':>11} {'copies':>7} "
         f"{'floor':>7} {'best':>6}")
    for r in results:
        parts = floor(r["backend"], r["fused_issue_s"])
        total = sum(parts.values())
        r["floor_s"] = dict(parts, total=total)
        emit(f"{r['backend']:<8} {parts['issue'] * 1e3:>9.3f} "
             f"{parts['agreement'] * 1e3:>10.3f} {parts['all_reduce'] * 1e3:>11.3f} "
             f"{parts['copies'] * 1e3:>7.3f} {total * 1e3:>7.3f} "
             f"{r['unfused_s'] / total:>5.1f}x")
    if rank == 0 and args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    sync.Free()
    mcrdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
