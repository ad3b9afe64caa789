"""mcrdl's mpi backend against the C floor: per op and size, the blocking MPI collective
and the nonblocking one (+ MPI_Wait) called from C, and mcrdl's blocking call.

    python benchmarks/c_floor.py [--ranks 2 4] [--sizes 8 4096 65536 1048576 16777216]
                                 [--trials 7] [--runs 1] [--variants]

Builds benchmarks/c_floor.c with the MPI library's ``mpicc`` (``$MPICC``, else the one
beside this Python, as setup.py finds it), as a program and as a Python module, runs the
program and this script's rank part under ``mpiexec -n N`` for each N, and prints one
table per world size. Times are the median over trials of the per-trial maximum over
ranks of the mean time per call (float32, sizes as the tuning table counts them:
all_gather's output, reduce_scatter's input). Calls per trial are calibrated by time
(c_floor.c: a batch of at least 20 ms and 8 calls) and the timed variants alternate
trial by trial (the rank part: in an order drawn anew each trial, the same on every
rank).

Columns: C blocking, C nonblocking (the standalone program), the same with MPI
initialized with MPI_THREAD_MULTIPLE ("MT": mcrdl's lanes need it, and MPICH's small
collectives are much slower under it), the same C calls made from inside the mcrdl ranks
("in-proc": c_floor.c's library on the very tensors mcrdl's calls use, interleaved with
them trial by trial: the fair reference where the machine's load drifts between
programs), mcrdl (``mcrdl.<op>("mpi", ...)`` with the variant its measurements choose),
mcrdl minus C blocking (MT), mcrdl over the better C MT variant, mcrdl over the better
in-process C variant and minus it; then what any Python caller pays: "py loop" (the timing
loop calling a no-op C builtin), "C per py call" (c_floor.c's call of the variant mcrdl
runs, made once per iteration of that loop through the smallest C extension function
there is: c_floor.c is also the CPython module `c_floor`), mcrdl over it, and it over
the best in-process C variant (the Python caller's floor under mcrdl's ratio).
``--variants`` adds mcrdl with each variant forced (the data of
mcrdl/tuning/mpi_blocking.json). ``--runs R`` repeats everything R times and ends with
each ratio's range over the runs: this machine's timings swing between runs by more
than a per-run median shows.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import itertools
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "c_floor.c")) as _f:
    #: c_floor.c's source, which the constants below are read from so the two files
    #: cannot disagree.
    C_SOURCE = _f.read()


def c_define(name: str) -> float:
    """A trial rule that c_floor.c defines (``#define TRIAL_S 0.02``)."""
    return float(re.search(rf"^#define {name} (\S+)$", C_SOURCE, re.M).group(1))


#: c_floor.c's rules: a trial is a batch of at least TRIAL_S seconds on the slowest
#: rank, of at least MIN_ITERS and at most MAX_ITERS calls.
TRIAL_S = c_define("TRIAL_S")
MIN_ITERS, MAX_ITERS = int(c_define("MIN_ITERS")), int(c_define("MAX_ITERS"))
#: A step's value in mpi_blocking.json (mcrdl.tuning.schema.STEP_VALUES, which this
#: script does not import: its driver runs without mcrdl's extension built).
STEP_VALUES = {"blocking": True, "nonblocking": False, "allreduce": "allreduce"}
#: The variants --variants forces, in its columns' order; c_floor.c's mode of each.
VARIANTS = ("blocking", "nonblocking", "allreduce")
C_MODES = {"blocking": 1, "nonblocking": 0, "allreduce": 2}

def c_ops() -> dict[str, int]:
    """c_floor.c's op numbers (the `op` of its module's time() and call()), read from its
    enum, so the two files cannot disagree: ``enum { ALL_REDUCE, ALL_GATHER, ..., NOPS }``
    -> {"all_reduce": 0, ...}."""
    body = re.search(r"enum\s*\{([^}]*)\}", C_SOURCE).group(1)
    names = [n.strip().lower() for n in body.split(",") if n.strip() and n.strip() != "NOPS"]
    return {n: i for i, n in enumerate(names)}


C_OPS = c_ops()


def calibrate(batch) -> int:
    """Calls per trial, as c_floor.c's calibrate(): `batch(it)` runs `it` calls and returns
    the time per call on the slowest rank; batches grow until one takes TRIAL_S, and a
    trial makes at least MIN_ITERS calls."""
    it = 1
    while True:
        t = batch(it) * it
        if t >= TRIAL_S or it >= MAX_ITERS:
            return max(it, MIN_ITERS)
        nxt = int(it * 1.25 * TRIAL_S / t) + 1 if t > 0 else it * 8
        it = min(max(nxt, 2 * it), MAX_ITERS)


def _mpiexec() -> str:
    cand = os.path.join(sys.prefix, "bin", "mpiexec")
    return cand if os.path.exists(cand) else shutil.which("mpiexec") or "mpiexec"


def mpicc() -> str:
    """The MPI library's compiler: ``$MPICC``, else the one beside this Python (as
    setup.py finds it), else the first on PATH."""
    cc = os.environ.get("MPICC") or os.path.join(sys.prefix, "bin", "mpicc")
    if not os.path.exists(cc):
        cc = shutil.which("mpicc") or cc
    return cc


def build(out_dir: str) -> tuple[str, str]:
    """c_floor.c as a program and as the CPython module `c_floor` (the in-process
    references)."""
    cc = mpicc()
    exe = os.path.join(out_dir, "c_floor")
    lib = os.path.join(out_dir, "c_floor" + sysconfig.get_config_var("EXT_SUFFIX"))
    src = os.path.join(HERE, "c_floor.c")
    subprocess.run([cc, "-O2", "-o", exe, src], check=True)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-DC_FLOOR_LIB",
                    "-I" + sysconfig.get_paths()["include"], "-o", lib, src], check=True)
    return exe, lib


def load_module(path: str):
    """The CPython module `c_floor` that build() wrote at `path`."""
    spec = importlib.util.spec_from_file_location("c_floor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mcrdl_call(mcrdl, op: str, a, b, per: int, n: int):
    """mcrdl's call of `op` on the float32 tensors `a` and `b` (bytes as c_floor.c counts
    them, `per` elements a rank, `n` ranks), as a functools.partial: no Python frame of
    the harness per call, as the C loop has none, on views made once (slicing costs ~1 us
    a call)."""
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


def cases(ops: list[str], sizes: list[int], n: int):
    """What a rank part times, as (op, bytes, a, b): each op at every size (barrier once,
    as 0 bytes; all_gather and reduce_scatter from 4 bytes a rank), on zeroed float32
    tensors `a` and `b` of that many bytes."""
    import torch

    for op in ops:
        for nbytes in ([0] if op == "barrier" else sizes):
            if op in ("all_gather", "reduce_scatter") and nbytes < 4 * n:
                continue
            count = max(nbytes // 4, 1)
            yield op, nbytes, torch.zeros(count), torch.zeros(count)


def parse(out: str) -> dict:
    from mcrdl.ops import OPS

    rows = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 4 and f[0] in OPS:
            rows[(f[0], int(f[1]))] = [float(x) for x in f[2:]]
    return rows


def fit_steps(times: dict[int, dict[str, float]], margin: float = 0.99) -> list:
    """mpi_blocking.json steps from {bytes: {variant: mcrdl's time}}: at each size the
    blocking variant wins when under `margin` times the nonblocking one, the allreduce
    variant (all_gather, reduce_scatter) when under `margin` times that winner (closer is
    noise between the paired medians of one run here; a 3% margin kept all_reduce at 2
    ranks nonblocking at 1 MiB, where its blocking variant was the faster one in every
    run, and so mcrdl about 2% over C's best); then the split of the sizes into
    allreduce, blocking and nonblocking runs, in that order of size, that agrees with
    the most sizes (on a tie the one whose variants lose least to the fastest, summed
    over sizes as log(time / fastest time), then fewer allreduce, then fewer blocking
    sizes), each run ending at the geometric middle of the measured sizes around its
    end, rounded to a power of two (kept below the next measured size)."""
    sizes = sorted(times)

    def winner(t: dict[str, float]) -> str:
        w = "blocking" if t["blocking"] < margin * t["nonblocking"] else "nonblocking"
        ar = t.get("allreduce", math.nan)
        return "allreduce" if ar < margin * t[w] else w

    wins = [winner(times[b]) for b in sizes]
    runs = ("allreduce", "blocking", "nonblocking")
    m = len(sizes)

    def agree(k: tuple[int, int]) -> int:  # the first k[0] sizes allreduce, up to k[1] blocking
        return sum(w == runs[(i >= k[0]) + (i >= k[1])] for i, w in enumerate(wins))

    best = [min((v for v in times[b].values() if 0 < v < math.inf), default=math.nan)
            for b in sizes]

    def loss(k: tuple[int, int]) -> float:  # a variant not measured at a size: infinite
        lost = 0.0
        for i, b in enumerate(sizes):
            chosen = times[b].get(runs[(i >= k[0]) + (i >= k[1])], math.nan)
            if math.isnan(chosen):
                lost = math.inf
            elif 0 < chosen < math.inf and not math.isnan(best[i]):
                lost += math.log(chosen / best[i])
        return lost

    k1, k2 = max(((a, b) for a in range(m + 1) for b in range(a, m + 1)),
                 key=lambda k: (agree(k), -loss(k), -k[0], -k[1]))
    steps, start = [], 0
    for end, v in ((k1, "allreduce"), (k2, "blocking")):
        if end > start:
            lo, hi = max(sizes[end - 1], 1), sizes[end] if end < m else None
            # kept in [lo, hi): the measured sizes on either side keep their winner
            mid = None if hi is None else 1 << round(math.log2((lo * hi) ** 0.5))
            steps.append([-1 if hi is None else min(max(mid, lo), hi - 1), STEP_VALUES[v]])
        start = max(start, end)
    if not steps or steps[-1][0] != -1:
        steps.append([-1, False])
    return steps


# -- the rank part (under mpiexec) --------------------------------------------------------

def trial_order(n: int, run: int, op: str, nbytes: int, trial: int) -> list[int]:
    """The order of a trial's `n` batches: shuffled, and the same in every rank's process.
    The seed is a str, which random.Random hashes with sha512; a tuple or another object
    would be seeded by hash(), which differs between processes (PYTHONHASHSEED) and would
    set the ranks' collectives against each other."""
    order = list(range(n))
    random.Random(f"{run} {op} {nbytes} {trial}").shuffle(order)
    return order


def rank_part(ops: list[str], sizes: list[int], trials: int, variants: bool,
              clib: str, run: int = 0) -> None:
    """Per (op, size), print mcrdl's time, with --variants each variant forced, then the
    in-process C blocking and nonblocking times: every one calibrated on its own, then
    timed in turns, trial by trial, on the same tensors.

    Each trial runs the batches in a new order (seeded by `run`, op, size and trial, so
    the same on every rank and different in each run of --runs). A batch can slow the
    next one down (why is not known): after the allreduce variant's 16 MiB
    reduce_scatter batch, the next batch's calls ran about 30% slower, even with the
    short no-op batch between. A fixed rotation always put the same batch after it: the
    C call made from the Python loop, which came out 1.16-1.32 over the C loop at 16 MiB
    and 1.05 at 1 MiB."""
    import torch

    import mcrdl
    import mcrdl.api
    from mcrdl.backends.mpi import BLOCKING_OPS
    from mcrdl.tuning.schema import op_variants

    mcrdl.init(["mpi"])
    rank, n = mcrdl.get_rank(), mcrdl.get_size()
    backend = mcrdl.api.current_runtime().backend("mpi")
    cmod = load_module(clib)
    tmax = torch.zeros(1, dtype=torch.float64)

    def slowest(t: float) -> float:
        tmax[0] = t
        mcrdl.all_reduce("mpi", tmax, op=mcrdl.ReduceOp.MAX)
        return float(tmax[0])

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

    def mcrdl_batch(fn, op: str, forced: str | None):
        """mcrdl's calls: as the backend chose (`forced` None), or every blocking call of
        `op` forced to that variant (backend.variant)."""
        if forced is None:
            return loop_batch(fn)
        return loop_batch(fn, lambda: backend.variant(op, forced))

    def c_batch(op: str, variant: str, a, b, nbytes: int):
        args = (C_OPS[op], C_MODES[variant], a.data_ptr(), b.data_ptr(), nbytes)
        return lambda it: slowest(cmod.time(*args, it))

    def skipped(it: int) -> float:  # a variant the op lacks
        return math.nan

    for op, nbytes, a, b in cases(ops, sizes, n):
        fn = mcrdl_call(mcrdl, op, a, b, nbytes // 4 // n, n)
        has = op_variants(op) if op in BLOCKING_OPS else ()
        batches = [mcrdl_batch(fn, op, None)]
        if variants:
            batches += [mcrdl_batch(fn, op, v) if v in has else skipped for v in VARIANTS]
        batches += [c_batch(op, v, a, b, nbytes) if v in has else skipped
                    for v in VARIANTS]
        # the C call mcrdl makes, once per iteration of the same loop (through the
        # c_floor module's METH_FASTCALL function), and the loop with a no-op C
        # builtin (what any Python caller pays)
        mode = backend.comm(None).variant(op, nbytes) if has else 1
        batches += [loop_batch(functools.partial(cmod.call, C_OPS[op], mode,
                                                 a.data_ptr(), b.data_ptr(), nbytes)),
                    loop_batch(functools.partial(id, a))]
        its = [1 if bt is skipped else calibrate(bt) for bt in batches]
        ts = [[] for _ in batches]
        for tr in range(trials):
            for j in trial_order(len(batches), run, op, nbytes, tr):
                ts[j].append(batches[j](its[j]))
        if rank == 0:
            print(op, nbytes, *(f"{statistics.median(t):.9g}" for t in ts), flush=True)
    mcrdl.finalize()


# -- the driver ---------------------------------------------------------------------------

def us(t: float) -> str:
    if math.isnan(t):
        return "-"
    return f"{t * 1e6:.2f}" if t < 1e-3 else f"{t * 1e6:.0f}"


def spread_table(per_run: dict[tuple[int, str, int], list[tuple[float, ...]]],
                 runs: int) -> list[str]:
    """The summary of several runs, as markdown lines: per (ranks, op, bytes) the range
    over runs of mcrdl minus the best in-process C variant (us), mcrdl over it, mcrdl
    over the C call made once per Python loop iteration, and that call over the best
    in-process C variant (what any Python caller pays: the floor under mcrdl's ratio).
    From 3 runs on, each range also gives its median: one noisy run moves the range
    but not the median, which is what the targets are read against.
    `per_run` holds one (minus us, over, over per py call, py floor) tuple per run."""
    lines = [f"\nspread over {runs} runs (min to max; the median too from 3 runs)",
             "| ranks | op | bytes | values | mcrdl - best C in-proc us "
             "| mcrdl / best C in-proc | mcrdl / C per py call | C per py call / best C in-proc |",
             "|---|---|---|---|---|---|---|---|"]

    def rng(vals, fmt):
        vals = [v for v in vals if not math.isnan(v)]
        if not vals:
            return "-"
        lo, hi = min(vals), max(vals)
        if format(lo, fmt) == format(hi, fmt):
            return format(lo, fmt)
        mid = f" (median {format(statistics.median(vals), fmt)})" if len(vals) > 2 else ""
        return f"{format(lo, fmt)} to {format(hi, fmt)}{mid}"

    for (n, op, nbytes), rows in sorted(per_run.items()):
        cols = list(zip(*rows, strict=True))
        lines.append(f"| {n} | {op} | {nbytes} | {len(rows)} | {rng(cols[0], '+.2f')} | "
                     f"{rng(cols[1], '.2f')} | {rng(cols[2], '.2f')} | {rng(cols[3], '.3f')} |")
    return lines


def pooled_fit(runs: list[dict[int, dict[str, float]]]) -> list:
    """fit_steps of several runs' variant times of one op and group size, as the shipped
    steps are made: per size the median over runs of blocking / nonblocking and of
    allreduce / blocking (a size some run lacks uses the runs that have it)."""
    pooled = {}
    for b in sorted({b for r in runs for b in r}):
        at = [r[b] for r in runs if b in r]
        bn = statistics.median(t["blocking"] / t["nonblocking"] for t in at)
        t = {"nonblocking": 1.0, "blocking": bn}
        ar = [x["allreduce"] / x["blocking"] for x in at if "allreduce" in x]
        if ar:
            t["allreduce"] = statistics.median(ar) * bn
        pooled[b] = t
    return fit_steps(pooled)


def world_run(n: int, a, exe: str, lib: str, env: dict, sizes: list[str],
              run: int = 0) -> tuple:
    """One run at `n` ranks: the C program (single-threaded and MPI_THREAD_MULTIPLE
    init) and the rank part; prints its table (and --variants' fits) and returns, per
    (op, bytes), (mcrdl - best C in-proc, mcrdl / best C in-proc, mcrdl / C per py
    call, C per py call / best C in-proc), and with --variants each op's {bytes:
    {variant: time}}."""
    c = parse(subprocess.run([_mpiexec(), "-n", str(n), exe, str(a.trials), *sizes],
                             check=True, capture_output=True, text=True, env=env).stdout)
    cmt = parse(subprocess.run([_mpiexec(), "-n", str(n), exe, str(a.trials), *sizes],
                               check=True, capture_output=True, text=True,
                               env=dict(env, C_FLOOR_THREAD_MULTIPLE="1")).stdout)
    m = parse(subprocess.run(
        [_mpiexec(), "-n", str(n), sys.executable, os.path.abspath(__file__),
         "--rank-part", "--run", str(run), "--trials", str(a.trials), "--sizes", *sizes,
         "--ops", *dict.fromkeys(op for op, _ in c), "--clib", lib,
         *(["--variants"] if a.variants else [])],
        check=True, capture_output=True, text=True, env=env).stdout)
    head = ["op", "bytes", "C blocking us", "C nonblocking us", "C MT blocking us",
            "C MT nonblocking us", "C in-proc blocking us", "C in-proc nonblocking us",
            "C in-proc allreduce us", "mcrdl us", "mcrdl - C MT blk us",
            "mcrdl - C in-proc blk us", "mcrdl / best C MT", "mcrdl / best C in-proc",
            "mcrdl - best C in-proc us", "py loop us", "C per py call us",
            "mcrdl / C per py call", "C per py call / best C in-proc"]
    if a.variants:
        head += ["mcrdl blk us", "mcrdl nonblk us", "mcrdl allreduce us"]
    fits: dict[str, dict[int, dict[str, float]]] = {}
    summary = {}
    print(f"\n{n} ranks (median of {a.trials} trials of the max over ranks)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for key in c:
        if key not in m or key not in cmt:
            continue
        cb, cn = c[key]
        tb, tn = cmt[key]
        mt = m[key]
        ib, inb, iar, percall, loop = mt[-5:]
        best = min(t for t in (ib, inb, iar) if not math.isnan(t))
        cells = [key[0], str(key[1]), us(cb), us(cn), us(tb), us(tn), us(ib), us(inb),
                 us(iar), us(mt[0]), f"{(mt[0] - tb) * 1e6:+.2f}",
                 f"{(mt[0] - ib) * 1e6:+.2f}", f"{mt[0] / min(tb, tn):.2f}",
                 f"{mt[0] / best:.2f}", f"{(mt[0] - best) * 1e6:+.2f}",
                 us(loop), us(percall), f"{mt[0] / percall:.2f}", f"{percall / best:.3f}"]
        summary[key] = ((mt[0] - best) * 1e6, mt[0] / best, mt[0] / percall, percall / best)
        if a.variants:
            cells += [us(t) for t in mt[1:4]]
            fits.setdefault(key[0], {})[key[1]] = {
                v: t for v, t in zip(VARIANTS, mt[1:4], strict=True) if not math.isnan(t)}
        print("| " + " | ".join(cells) + " |", flush=True)
    if a.variants:
        print(f"\nsteps for mcrdl/tuning/mpi_blocking.json, group size {n}, from this "
              "run (fit_steps):")
        for op, t in fits.items():
            print(f'    "{op}": {{"{n}": {json.dumps(fit_steps(t))}}}')
    return summary, fits


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 4096, 65536, 1 << 20, 16 << 20])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--runs", type=int, default=1,
                   help="repeat the whole measurement; with 2+ a table of each ratio's "
                        "range over runs follows (this machine's spread)")
    p.add_argument("--variants", action="store_true")
    p.add_argument("--rank-part", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ops", nargs="+", help=argparse.SUPPRESS)  # the rank part's, from C
    p.add_argument("--clib", help=argparse.SUPPRESS)  # the rank part's c_floor module
    p.add_argument("--run", type=int, default=0, help=argparse.SUPPRESS)  # its order seed
    a = p.parse_args(argv)
    if a.rank_part:
        rank_part(a.ops, a.sizes, a.trials, a.variants, a.clib, a.run)
        return
    if a.runs < 1:
        p.error(f"--runs must be at least 1, got {a.runs}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sizes = [str(s) for s in a.sizes]
    per_run: dict[tuple[int, str, int], list[tuple[float, float, float, float]]] = {}
    variant_runs: dict[tuple[int, str], list[dict[int, dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe, lib = build(tmp)
        for r in range(a.runs):
            for n in a.ranks:
                if a.runs > 1:
                    print(f"\nrun {r + 1} of {a.runs}")
                summary, fits = world_run(n, a, exe, lib, env, sizes, r)
                for key, vals in summary.items():
                    per_run.setdefault((n, *key), []).append(vals)
                for op, times in fits.items():
                    variant_runs.setdefault((n, op), []).append(times)
    if a.runs > 1:
        print("\n".join(spread_table(per_run, a.runs)), flush=True)
        if variant_runs:
            print(f"\nsteps from the {a.runs} runs' median ratios (pooled_fit):")
            for (n, op), runs in sorted(variant_runs.items()):
                print(f'    "{op}": {{"{n}": {json.dumps(pooled_fit(runs))}}}')


if __name__ == "__main__":
    main()
