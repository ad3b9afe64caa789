"""Where a blocking call's time goes, inside MPI and outside it: mcrdl's mpi backend
against the C loop and the minimal C entry called from Python, on the real multi-rank run.

    python benchmarks/call_gap.py [--ranks 2] [--sizes 8 4096 1048576 16777216]
                                  [--trials 9] [--ops all_reduce ...]

Why: at 1 MiB a call's total over the C loop swings between runs by more than mcrdl's
own share of it (docs/performance.md, "The rest of a call: cache lines and time outside
MPI"), so totals cannot say whether a change to mcrdl's call path helped. Here a PMPI
library (benchmarks/call_gap.c, preloaded into the ranks) timestamps every collective:
the time inside MPI per call, and the time outside it, from one call's return to the
next call's entry. Outside is what the caller runs between calls (the C loop's few
instructions; the Python loop and the C entry; mcrdl's path before and after MPI), cache
misses after a large call included.

Three arms per (op, size), timed in a shuffled order each trial, on the same tensors:
"C loop" (c_floor.c's in-process loop), "C per py call" (c_floor.c's C entry, once per
iteration of a Python loop) and "mcrdl" (``mcrdl.<op>("mpi", ...)``); both C arms run
the variant mcrdl runs (blocking, nonblocking or allreduce). Printed: the median over
trials of the total per call (the max over ranks), of the inside and outside times per
call (the mean over ranks), mcrdl's outside time minus the C entry's, and the MPI
collectives each mcrdl call began (1 for every op: the check that the library saw the
calls), and for the two Python loops the share of a rank's total that was neither inside
nor outside MPI (the largest over ranks: the loop's start and end; a larger share would be
time spent in MPI calls the library does not wrap). On the nonblocking variant, inside
runs from the post to the test that completes it, so the caller's polling (mcrdl's
backoff, MPI_Wait's in the C arms) counts as inside. Needs the MPI library's ``mpicc``
(as c_floor.py) and an MPI that resolves MPI_* calls through the dynamic linker (MPICH,
Open MPI).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import c_floor  # noqa: E402  (its build of c_floor.c, its calls and its rules)

ARMS = ("C loop", "C per py call", "mcrdl")
OPS = tuple(c_floor.C_OPS)


def build(out_dir: str) -> tuple[str, str]:
    """c_floor's CPython module and the PMPI library (call_gap.c)."""
    _, lib = c_floor.build(out_dir)
    gap = os.path.join(out_dir, "libcall_gap.so")
    subprocess.run([c_floor.mpicc(), "-O2", "-shared", "-fPIC", "-o", gap,
                    os.path.join(c_floor.HERE, "call_gap.c")], check=True)
    return lib, gap


def rank_part(ops: list[str], sizes: list[int], trials: int, clib: str) -> None:
    """Per (op, size) and arm, rank 0 prints: op bytes arm total inside outside calls,
    the medians over trials of the seconds per call and of the collectives per call."""
    import torch

    import mcrdl
    import mcrdl.api
    from mcrdl.backends.mpi import BLOCKING_OPS

    pmpi = ctypes.CDLL(None)
    if not hasattr(pmpi, "cg_start"):
        sys.exit("call_gap.py: the rank part needs libcall_gap.so preloaded (LD_PRELOAD); "
                 "run the script without --rank-part")
    pmpi.cg_start.argtypes = [ctypes.c_int]
    pmpi.cg_read.restype = ctypes.c_long
    pmpi.cg_read.argtypes = [ctypes.POINTER(ctypes.c_double)] * 2
    mcrdl.init(["mpi"])
    rank, n = mcrdl.get_rank(), mcrdl.get_size()
    comm = mcrdl.api.current_runtime().backend("mpi").comm(None)
    cmod = c_floor.load_module(clib)
    mine, every = torch.zeros(5, dtype=torch.float64), torch.zeros(5 * n, dtype=torch.float64)

    def python_loop(fn):
        def run(it: int) -> None:
            for _ in itertools.repeat(None, it):
                fn()
        return run

    def timed(run, it: int, barrier: bool) -> tuple[float, ...]:
        """(total, inside, outside, collectives) per call on this rank, and the share of
        the total the library saw neither inside nor outside MPI."""
        mcrdl.barrier("mpi")
        pmpi.cg_start(int(barrier))
        t0 = time.perf_counter()
        run(it)
        t = time.perf_counter() - t0
        pmpi.cg_stop()
        inside, outside = ctypes.c_double(), ctypes.c_double()
        k = pmpi.cg_read(ctypes.byref(inside), ctypes.byref(outside))
        return (t / it, inside.value / max(k, 1), outside.value / max(k - 1, 1), k / it,
                (t - inside.value - outside.value) / t)

    def over_ranks(v) -> tuple[float, ...]:
        """Total: the slowest rank's; inside, outside: the mean; collectives: the fewest;
        the share not seen: the largest."""
        mine.copy_(torch.tensor(v, dtype=torch.float64))
        mcrdl.all_gather("mpi", every, mine)
        r = every.view(n, 5)
        return (float(r[:, 0].max()), float(r[:, 1].mean()), float(r[:, 2].mean()),
                float(r[:, 3].min()), float(r[:, 4].max()))

    for op, nbytes, a, b in c_floor.cases(ops, sizes, n):
        mode = comm.variant(op, nbytes) if op in BLOCKING_OPS else 1
        args = (c_floor.C_OPS[op], mode, a.data_ptr(), b.data_ptr(), nbytes)
        runs = [lambda it, args=args: cmod.time(*args, it),
                python_loop(functools.partial(cmod.call, *args)),
                python_loop(c_floor.mcrdl_call(mcrdl, op, a, b, nbytes // 4 // n, n))]
        barrier = op == "barrier"  # c_floor's time() begins with a barrier: counted then
        its = [c_floor.calibrate(lambda it, r=r, bar=barrier: over_ranks(timed(r, it, bar))[0])
               for r in runs]
        got: list[list[tuple[float, ...]]] = [[] for _ in runs]
        for tr in range(trials):
            for j in c_floor.trial_order(len(runs), 0, op, nbytes, tr):
                got[j].append(over_ranks(timed(runs[j], its[j], barrier)))
        if rank == 0:
            for arm, g in zip(ARMS, got, strict=True):
                med = [statistics.median(x[i] for x in g) for i in range(5)]
                print(op, nbytes, arm.replace(" ", "_"), *(f"{v:.9g}" for v in med),
                      flush=True)
    mcrdl.finalize()


def parse(out: str) -> dict[tuple[str, int], dict[str, tuple[float, ...]]]:
    rows: dict[tuple[str, int], dict[str, tuple[float, ...]]] = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) == 8 and f[0] in OPS:
            rows.setdefault((f[0], int(f[1])), {})[f[2].replace("_", " ")] = tuple(
                float(x) for x in f[3:])
    return rows


def table(rows: dict[tuple[str, int], dict[str, tuple[float, ...]]], n: int,
          trials: int) -> list[str]:
    head = ["op", "bytes", "C loop us", "C per py call us", "mcrdl us",
            "outside: C loop us", "outside: C per py call us", "outside: mcrdl us",
            "mcrdl - C per py call, outside us", "inside: C loop us",
            "inside: C per py call us", "inside: mcrdl us", "MPI calls per mcrdl call",
            "not seen: C per py call %", "not seen: mcrdl %"]
    lines = [f"\n{n} ranks (medians of {trials} trials; totals: the slowest rank; inside "
             "and outside MPI: the mean over ranks)",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (op, nbytes), arms in rows.items():
        if set(arms) != set(ARMS):
            continue
        c, p, m = (arms[a] for a in ARMS)
        cells = [op, str(nbytes), *(c_floor.us(x[0]) for x in (c, p, m)),
                 *(f"{x[2] * 1e6:.3f}" for x in (c, p, m)), f"{(m[2] - p[2]) * 1e6:+.3f}",
                 *(c_floor.us(x[1]) for x in (c, p, m)), f"{m[3]:.2f}",
                 f"{p[4] * 100:.1f}", f"{m[4] * 100:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 4096, 1 << 20, 16 << 20])
    p.add_argument("--trials", type=int, default=9)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--rank-part", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--clib", help=argparse.SUPPRESS)  # the rank part's c_floor module
    a = p.parse_args(argv)
    if a.rank_part:
        rank_part(a.ops, a.sizes, a.trials, a.clib)
        return
    if a.trials < 1:
        p.error(f"--trials must be at least 1, got {a.trials}")
    with tempfile.TemporaryDirectory() as tmp:
        lib, gap = build(tmp)
        env = dict(os.environ, OMP_NUM_THREADS="1", LD_PRELOAD=":".join(
            x for x in (gap, os.environ.get("LD_PRELOAD")) if x))
        for n in a.ranks:
            out = subprocess.run(
                [c_floor._mpiexec(), "-n", str(n), sys.executable, os.path.abspath(__file__),
                 "--rank-part", "--trials", str(a.trials), "--sizes", *map(str, a.sizes),
                 "--ops", *a.ops, "--clib", lib],
                capture_output=True, text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"call_gap.py: the {n}-rank run failed ({out.returncode}):\n"
                         f"{out.stdout[-2000:]}{out.stderr[-3000:]}")
            print("\n".join(table(parse(out.stdout), n, a.trials)), flush=True)


if __name__ == "__main__":
    main()
