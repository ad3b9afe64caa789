"""mcrdl's mpi backend against the C floor: per op and size, the blocking MPI collective
and the nonblocking one (+ MPI_Wait) called from C, and mcrdl's blocking call.

    python benchmarks/c_floor.py [--ranks 2 4] [--sizes 8 4096 65536 1048576 16777216]
                                 [--trials 7] [--variants]

Builds benchmarks/c_floor.c with the MPI library's ``mpicc`` (``$MPICC``, else the one
beside this Python, as setup.py finds it), as a program and as a library, runs the
program and this script's rank part under ``mpiexec -n N`` for each N, and prints one
table per world size. Times are the median over trials of the per-trial maximum over
ranks of the mean time per call (float32, sizes as the tuning table counts them:
all_gather's output, reduce_scatter's input). Calls per trial are calibrated by time
(c_floor.c: a batch of at least 20 ms) and the timed variants alternate trial by trial.

Columns: C blocking, C nonblocking (the standalone program), the same with MPI
initialized with MPI_THREAD_MULTIPLE ("MT": mcrdl's lanes need it, and MPICH's small
collectives are much slower under it), the same C calls made from inside the mcrdl ranks
("in-proc": c_floor.c's library on the very tensors mcrdl's calls use, interleaved with
them trial by trial: the fair reference where the machine's load drifts between
programs), mcrdl (``mcrdl.<op>("mpi", ...)`` with the variant its measurements choose),
mcrdl minus C blocking (MT), mcrdl over the better C MT variant, mcrdl over the better
in-process C variant and minus it; then what any Python caller pays: "py loop" (the timing
loop calling a no-op C builtin), "C per py call" (c_floor.c's call of the variant mcrdl
runs, made once per iteration of that loop through ctypes, which costs ~0.3-0.5 us more
per call than a C extension: a reference at large sizes) and mcrdl over it.
``--variants`` adds mcrdl with each variant forced (the data of
mcrdl/tuning/mpi_blocking.json).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


#: c_floor.c's rules: a trial is a batch of at least this long on the slowest rank, of
#: at most MAX_ITERS calls.
TRIAL_S, MAX_ITERS = 0.02, 4000

def c_ops() -> dict[str, int]:
    """c_floor.c's op numbers (c_floor_time's `op`), read from its enum, so the two files
    cannot disagree: ``enum { ALL_REDUCE, ALL_GATHER, ..., NOPS }`` -> {"all_reduce": 0,
    ...}."""
    with open(os.path.join(HERE, "c_floor.c")) as f:
        body = re.search(r"enum\s*\{([^}]*)\}", f.read()).group(1)
    names = [n.strip().lower() for n in body.split(",") if n.strip() and n.strip() != "NOPS"]
    return {n: i for i, n in enumerate(names)}


C_OPS = c_ops()


def calibrate(batch) -> int:
    """Calls per trial, as c_floor.c's calibrate(): `batch(it)` runs `it` calls and returns
    the time per call on the slowest rank; batches grow until one takes TRIAL_S."""
    it = 1
    while True:
        t = batch(it) * it
        if t >= TRIAL_S or it >= MAX_ITERS:
            return it
        nxt = int(it * 1.25 * TRIAL_S / t) + 1 if t > 0 else it * 8
        it = min(max(nxt, 2 * it), MAX_ITERS)


def _mpiexec() -> str:
    cand = os.path.join(sys.prefix, "bin", "mpiexec")
    return cand if os.path.exists(cand) else shutil.which("mpiexec") or "mpiexec"


def build(out_dir: str) -> tuple[str, str]:
    """c_floor.c as a program and as a library (its in-process reference)."""
    mpicc = os.environ.get("MPICC") or os.path.join(sys.prefix, "bin", "mpicc")
    if not os.path.exists(mpicc):
        mpicc = shutil.which("mpicc") or mpicc
    exe, lib = os.path.join(out_dir, "c_floor"), os.path.join(out_dir, "libc_floor.so")
    src = os.path.join(HERE, "c_floor.c")
    subprocess.run([mpicc, "-O2", "-o", exe, src], check=True)
    subprocess.run([mpicc, "-O2", "-shared", "-fPIC", "-DC_FLOOR_LIB", "-o", lib, src],
                   check=True)
    return exe, lib


def parse(out: str) -> dict:
    from mcrdl.ops import OPS

    rows = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 4 and f[0] in OPS:
            rows[(f[0], int(f[1]))] = [float(x) for x in f[2:]]
    return rows


def fit_steps(ratios: dict[int, float], margin: float = 0.97) -> list:
    """mpi_blocking.json steps from {bytes: blocking variant time / nonblocking}: a size
    is blocking when the ratio is below `margin` (closer is this machine's noise); then
    the one crossover (blocking up to it, nonblocking above) that agrees with the most
    sizes, fewer blocking sizes on a tie, at the geometric middle of the measured sizes
    around it rounded to a power of two."""
    sizes = sorted(ratios)
    wins = [ratios[b] < margin for b in sizes]
    best = max(range(len(sizes) + 1),  # k: the first k sizes blocking
               key=lambda k: (sum(w == (i < k) for i, w in enumerate(wins)), -k))
    if best == 0:
        return [[-1, False]]
    if best == len(sizes):
        return [[-1, True]]
    lo, hi = max(sizes[best - 1], 1), sizes[best]
    return [[1 << round(math.log2((lo * hi) ** 0.5)), True], [-1, False]]


# -- the rank part (under mpiexec) --------------------------------------------------------

def rank_part(ops: list[str], sizes: list[int], trials: int, variants: bool,
              clib: str) -> None:
    """Per (op, size), print mcrdl's time, with --variants each variant forced, then the
    in-process C blocking and nonblocking times: every one calibrated on its own, then
    timed in turns, trial by trial, on the same tensors."""
    import torch

    import mcrdl
    import mcrdl.api

    mcrdl.init(["mpi"])
    rank, n = mcrdl.get_rank(), mcrdl.get_size()
    backend = mcrdl.api.current_runtime().backend("mpi")
    lib = ctypes.CDLL(clib)
    lib.c_floor_time.restype = ctypes.c_double
    lib.c_floor_time.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_long, ctypes.c_long]
    lib.c_floor_call.restype = None
    lib.c_floor_call.argtypes = lib.c_floor_time.argtypes[:-1]
    tmax = torch.zeros(1, dtype=torch.float64)

    def slowest(t: float) -> float:
        tmax[0] = t
        mcrdl.all_reduce("mpi", tmax, op=mcrdl.ReduceOp.MAX)
        return float(tmax[0])

    # The calls as functools.partial objects (no Python frame of the harness per call, as
    # the C loop has none), on views made once (slicing costs ~1 us a call).
    def mcrdl_call(op: str, a, b, per: int):
        call = functools.partial
        if op == "all_reduce":
            return call(mcrdl.all_reduce, "mpi", a)
        if op == "all_gather":
            return call(mcrdl.all_gather, "mpi", b[:per * n], a[:per])
        if op == "bcast":
            return call(mcrdl.bcast, "mpi", a, 0)
        if op == "reduce_scatter":
            return call(mcrdl.reduce_scatter, "mpi", b[:per], a[:per * n])
        return call(mcrdl.barrier, "mpi")

    def loop_batch(fn, variant=contextlib.nullcontext):
        """`fn` called in the loop that times mcrdl's calls (timeit's: no int per call),
        inside `variant()`."""
        def batch(it: int) -> float:
            with variant():
                mcrdl.barrier("mpi")
                t0 = time.perf_counter()
                for _ in itertools.repeat(None, it):
                    fn()
                t = (time.perf_counter() - t0) / it
            return slowest(t)
        return batch

    def mcrdl_batch(fn, op: str, forced: bool | None):
        """mcrdl's calls: as the backend chose (`forced` None), or every blocking call of
        `op` forced to the blocking (True) or nonblocking variant (backend.variant)."""
        if forced is None:
            return loop_batch(fn)
        return loop_batch(fn, lambda: backend.variant(op, forced))

    def c_batch(op: str, blocking: bool, a, b, nbytes: int):
        args = (C_OPS[op], int(blocking), a.data_ptr(), b.data_ptr(), nbytes)
        return lambda it: slowest(lib.c_floor_time(*args, it))

    for op in ops:
        for nbytes in ([0] if op == "barrier" else sizes):
            if op in ("all_gather", "reduce_scatter") and nbytes < 4 * n:
                continue
            count = nbytes // 4
            a, b = torch.zeros(max(count, 1)), torch.zeros(max(count, 1))
            fn = mcrdl_call(op, a, b, count // n)
            batches = [mcrdl_batch(fn, op, None)]
            if variants:
                batches += [mcrdl_batch(fn, op, forced) for forced in (True, False)]
            batches += [c_batch(op, blocking, a, b, nbytes) for blocking in (True, False)]
            # the C call mcrdl makes, once per iteration of the same loop (through ctypes:
            # ~0.3-0.5 us a call more than a C extension, so a reference at large sizes
            # only), and the loop with a no-op C builtin (what any Python caller pays)
            blk = backend.comm(None).uses_blocking(op, nbytes)
            batches += [loop_batch(functools.partial(lib.c_floor_call, C_OPS[op], int(blk),
                                                     a.data_ptr(), b.data_ptr(), nbytes)),
                        loop_batch(functools.partial(id, a))]
            its = [calibrate(bt) for bt in batches]
            ts = [[] for _ in batches]
            for tr in range(trials):  # each batch in turn, starting one later every trial
                for k in range(len(batches)):
                    j = (tr + k) % len(batches)
                    ts[j].append(batches[j](its[j]))
            if rank == 0:
                print(op, nbytes, *(f"{statistics.median(t):.9g}" for t in ts), flush=True)
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
    p.add_argument("--clib", help=argparse.SUPPRESS)  # the rank part's c_floor library
    a = p.parse_args(argv)
    if a.rank_part:
        rank_part(a.ops, a.sizes, a.trials, a.variants, a.clib)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sizes = [str(s) for s in a.sizes]
    with tempfile.TemporaryDirectory() as tmp:
        exe, lib = build(tmp)
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
                 "--ops", *dict.fromkeys(op for op, _ in c), "--clib", lib,
                 *(["--variants"] if a.variants else [])],
                check=True, capture_output=True, text=True, env=env).stdout)
            head = ["op", "bytes", "C blocking us", "C nonblocking us", "C MT blocking us",
                    "C MT nonblocking us", "C in-proc blocking us", "C in-proc nonblocking us",
                    "mcrdl us", "mcrdl - C MT blk us", "mcrdl / best C MT",
                    "mcrdl / best C in-proc", "mcrdl - best C in-proc us", "py loop us",
                    "C per py call us", "mcrdl / C per py call"]
            if a.variants:
                head += ["mcrdl blk us", "mcrdl nonblk us"]
            ratios: dict[str, dict[int, float]] = {}
            print(f"\n{n} ranks (median of {a.trials} trials of the max over ranks)")
            print("| " + " | ".join(head) + " |")
            print("|" + "---|" * len(head))
            for key in c:
                if key not in m or key not in cmt:
                    continue
                cb, cn = c[key]
                tb, tn = cmt[key]
                mt = m[key]
                ib, inb, percall, loop = mt[-4:]
                cells = [key[0], str(key[1]), us(cb), us(cn), us(tb), us(tn), us(ib), us(inb),
                         us(mt[0]), f"{(mt[0] - tb) * 1e6:+.2f}", f"{mt[0] / min(tb, tn):.2f}",
                         f"{mt[0] / min(ib, inb):.2f}", f"{(mt[0] - min(ib, inb)) * 1e6:+.2f}",
                         us(loop), us(percall), f"{mt[0] / percall:.2f}"]
                if a.variants:
                    cells += [us(mt[1]), us(mt[2])]
                    ratios.setdefault(key[0], {})[key[1]] = mt[1] / mt[2]
                print("| " + " | ".join(cells) + " |", flush=True)
            if a.variants:
                print(f"\nsteps for mcrdl/tuning/mpi_blocking.json, group size {n}, from this "
                      "run (fit_steps):")
                for op, r in ratios.items():
                    print(f'    "{op}": {{"{n}": {json.dumps(fit_steps(r))}}}')


if __name__ == "__main__":
    main()
