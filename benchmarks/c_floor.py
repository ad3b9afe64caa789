"""mcrdl's mpi backend against the C floor: per op and size, the blocking MPI collective
and the nonblocking one (+ MPI_Wait) called from C, and mcrdl's blocking call.

    python benchmarks/c_floor.py [--ranks 2 4] [--sizes 8 4096 65536 1048576 16777216]
                                 [--trials 7] [--variants]

Builds benchmarks/c_floor.c with the MPI library's ``mpicc`` (``$MPICC``, else the one
beside this Python, as setup.py finds it), runs it and this script's rank part under
``mpiexec -n N`` for each N, and prints one table per world size. Times are the median
over trials of the per-trial maximum over ranks of the mean time per call (float32,
sizes as the tuning table counts them: all_gather's output, reduce_scatter's input).
Columns: C blocking, C nonblocking, the same with MPI initialized with
MPI_THREAD_MULTIPLE ("MT": mcrdl's lanes need it, and MPICH's small collectives are
much slower under it), mcrdl (``mcrdl.<op>("mpi", ...)`` with the variant its
measurements choose), mcrdl minus C blocking (MT), mcrdl over the better C variant (MT).
``--variants`` adds mcrdl with each variant forced (the data of
mcrdl/tuning/mpi_blocking.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def iters_for(nbytes: int) -> int:
    """Calls per trial, as c_floor.c: about 20 ms of work, at least 3."""
    return min(max(20_000_000 // (nbytes + 2000), 3), 4000)


def _mpiexec() -> str:
    cand = os.path.join(sys.prefix, "bin", "mpiexec")
    return cand if os.path.exists(cand) else shutil.which("mpiexec") or "mpiexec"


def build(out_dir: str) -> str:
    mpicc = os.environ.get("MPICC") or os.path.join(sys.prefix, "bin", "mpicc")
    if not os.path.exists(mpicc):
        mpicc = shutil.which("mpicc") or mpicc
    exe = os.path.join(out_dir, "c_floor")
    subprocess.run([mpicc, "-O2", "-o", exe, os.path.join(HERE, "c_floor.c")], check=True)
    return exe


def parse(out: str) -> dict:
    from mcrdl.ops import OPS

    rows = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 4 and f[0] in OPS:
            rows[(f[0], int(f[1]))] = [float(x) for x in f[2:]]
    return rows


# -- the rank part (under mpiexec) --------------------------------------------------------

def rank_part(ops: list[str], sizes: list[int], trials: int, variants: bool) -> None:
    import torch

    import mcrdl
    import mcrdl.api

    mcrdl.init(["mpi"])
    rank, n = mcrdl.get_rank(), mcrdl.get_size()
    comm = mcrdl.api.current_runtime().backend("mpi")._world
    tmax = torch.zeros(1, dtype=torch.float64)

    def measure(op: str, nbytes: int) -> float:
        count = nbytes // 4
        a, b = torch.zeros(max(count, 1)), torch.zeros(max(count, 1))
        per = count // n
        if op == "all_reduce":
            def fn():
                mcrdl.all_reduce("mpi", a)
        elif op == "all_gather":
            def fn():
                mcrdl.all_gather("mpi", b[:per * n], a[:per])
        elif op == "bcast":
            def fn():
                mcrdl.bcast("mpi", a, src=0)
        elif op == "reduce_scatter":
            def fn():
                mcrdl.reduce_scatter("mpi", b[:per], a[:per * n])
        else:
            def fn():
                mcrdl.barrier("mpi")
        it = iters_for(nbytes)
        for _ in range(it // 10 + 1):
            fn()
        ts = []
        for _ in range(trials):
            mcrdl.barrier("mpi")
            t0 = time.perf_counter()
            for _ in range(it):
                fn()
            tmax[0] = (time.perf_counter() - t0) / it
            mcrdl.all_reduce("mpi", tmax, op=mcrdl.ReduceOp.MAX)
            ts.append(float(tmax[0]))
        return statistics.median(ts)

    from mcrdl.backends import mpi as mpi_backend
    for op in ops:
        for nbytes in ([0] if op == "barrier" else sizes):
            if op in ("all_gather", "reduce_scatter") and nbytes < 4 * n:
                continue
            row = [measure(op, nbytes)]
            if variants:
                steps = mpi_backend.blocking_steps(op, n, mpi_backend.blocking_mode())
                for forced in (True, False):
                    comm.set_blocking(op, [(-1, forced)])
                    row.append(measure(op, nbytes))
                comm.set_blocking(op, steps)
            if rank == 0:
                print(op, nbytes, *(f"{t:.9g}" for t in row), flush=True)
    mcrdl.finalize()


# -- the driver ---------------------------------------------------------------------------

def us(t: float) -> str:
    return f"{t * 1e6:.2f}" if t < 1e-3 else f"{t * 1e6:.0f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 4096, 65536, 1 << 20, 16 << 20])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--variants", action="store_true")
    p.add_argument("--rank-part", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ops", nargs="+", help=argparse.SUPPRESS)  # the rank part's, from C
    a = p.parse_args(argv)
    if a.rank_part:
        rank_part(a.ops, a.sizes, a.trials, a.variants)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sizes = [str(s) for s in a.sizes]
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp)
        for n in a.ranks:
            c = parse(subprocess.run([_mpiexec(), "-n", str(n), exe, str(a.trials), *sizes],
                                     check=True, capture_output=True, text=True,
                                     env=env).stdout)
            cmt = parse(subprocess.run([_mpiexec(), "-n", str(n), exe, str(a.trials), *sizes],
                                       check=True, capture_output=True, text=True,
                                       env=dict(env, C_FLOOR_THREAD_MULTIPLE="1")).stdout)
            m = parse(subprocess.run(
                [_mpiexec(), "-n", str(n), sys.executable, os.path.abspath(__file__),
                 "--rank-part", "--trials", str(a.trials), "--sizes", *sizes,
                 "--ops", *dict.fromkeys(op for op, _ in c),
                 *(["--variants"] if a.variants else [])],
                check=True, capture_output=True, text=True, env=env).stdout)
            head = ["op", "bytes", "C blocking us", "C nonblocking us", "C MT blocking us",
                    "C MT nonblocking us", "mcrdl us", "mcrdl - C MT blk us",
                    "mcrdl / best C MT"]
            if a.variants:
                head += ["mcrdl blk us", "mcrdl nonblk us"]
            print(f"\n{n} ranks (median of {a.trials} trials of the max over ranks)")
            print("| " + " | ".join(head) + " |")
            print("|" + "---|" * len(head))
            for key in c:
                if key not in m or key not in cmt:
                    continue
                cb, cn = c[key]
                tb, tn = cmt[key]
                mt = m[key]
                cells = [key[0], str(key[1]), us(cb), us(cn), us(tb), us(tn), us(mt[0]),
                         f"{(mt[0] - tb) * 1e6:+.2f}", f"{mt[0] / min(tb, tn):.2f}"]
                if a.variants:
                    cells += [us(mt[1]), us(mt[2])]
                print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
