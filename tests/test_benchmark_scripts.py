"""Every benchmark script starts and parses its options (`--help` exits 0): a renamed
module or option they import shows here, not when someone next measures. One process
runs them all (each would pay ~2 s to import torch)."""

import json
import math
import os
import pathlib
import runpy
import subprocess
import sys

from ._launch import mpiexec_or_skip, run_launcher

BENCHMARKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))

_RUN_ALL = """
import contextlib, io, runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        failed.append(f"{path}: --help did not exit")
    except SystemExit as exc:
        if exc.code not in (0, None) or "usage" not in out.getvalue().lower():
            failed.append(f"{path}: exit {exc.code}")
    except Exception as exc:
        failed.append(f"{path}: {type(exc).__name__}: {exc}")
print("\\n".join(failed) or "all ok")
sys.exit(1 if failed else 0)
"""


def test_every_benchmark_parses_its_options(tmp_path):
    assert BENCHMARKS
    out = subprocess.run([sys.executable, "-c", _RUN_ALL, *map(str, BENCHMARKS)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert not list(tmp_path.iterdir()), f"--help wrote files: {list(tmp_path.iterdir())}"
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_c_floor_fit_steps_orders_allreduce_blocking_nonblocking():
    """c_floor.fit_steps (the shipped mpi_blocking.json steps): the split into allreduce,
    blocking and nonblocking runs agreeing with the most sizes, ends at the geometric
    middle of the sizes around them; values as mcrdl.tuning.schema writes steps."""

    from mcrdl.tuning.schema import STEP_VALUES, check_steps

    c_floor = runpy.run_path(str(BENCHMARKS[0].parent / "c_floor.py"))
    assert c_floor["STEP_VALUES"] == STEP_VALUES
    fit = c_floor["fit_steps"]

    def t(b, nb, ar=None):
        return {"blocking": b, "nonblocking": nb, **({} if ar is None else {"allreduce": ar})}

    two = {8: t(1, 2), 4096: t(1, 2), 65536: t(3, 2), 1 << 20: t(3, 2)}
    assert fit(two) == [[16384, True], [-1, False]]
    assert fit({8: t(2, 2), 4096: t(2, 2)}) == [[-1, False]]  # within the margin: nonblocking
    assert fit({8: t(1, 2)}) == [[-1, True]]
    three = {8: t(2, 3, 1), 512: t(2, 3, 1), 4096: t(2, 3, 4), 65536: t(9, 3, 30)}
    steps = fit(three)
    assert steps == [[1024, "allreduce"], [16384, True], [-1, False]]
    check_steps(steps, "fit", "$", "all_gather")
    # an isolated win (noise) does not start a run of its own
    noisy = {**three, 1 << 20: t(9, 8, 1), 1 << 24: t(9, 8, 30)}
    assert fit(noisy) == [[1024, "allreduce"], [16384, True], [-1, False]]
    assert fit({8: t(2, 3, 1), 64: t(2, 3, 1)}) == [[-1, "allreduce"]]
    # two splits agree with 4 of 5 sizes (reduce_scatter at 3 ranks): the one losing least
    # to the fastest variant, blocking through 1 MiB (10% lost at 64 KiB, not 5x at 1 MiB)
    tie = {512: t(6, 6, 2), 4096: t(7, 8, 7), 65536: t(53, 48, 70), 1 << 20: t(242, 1175, 870),
           1 << 24: t(3665, 3739, 26656)}
    # (with a 3% margin, under which 16 MiB's 2% is a tie: nonblocking)
    assert fit(tie, 0.97) == [[1024, "allreduce"], [4194304, True], [-1, False]]
    flipped = {**tie, 65536: t(53, 10, 70)}  # now 5x lost at 64 KiB: nonblocking from there
    assert fit(flipped, 0.97) == [[1024, "allreduce"], [16384, True], [-1, False]]
    # the default margin is 1%: blocking 2% faster at 16 MiB wins there
    assert fit(tie) == [[1024, "allreduce"], [-1, True]]
    assert fit({8: t(0.985, 1)}) == [[-1, True]] and fit({8: t(0.995, 1)}) == [[-1, False]]
    # a bound never reaches the next measured size (round(log2(sqrt(128 * 256))) = 8)
    tight = fit({128: t(2, 3, 1), 256: t(1, 3, 2), 512: t(3, 1, 3)})
    assert tight == [[255, "allreduce"], [256, True], [-1, False]]
    check_steps(tight, "fit", "$", "reduce_scatter")


def test_c_floor_spread_table_reports_each_ratios_range():
    """c_floor --runs: per (ranks, op, bytes) the min-to-max of each ratio over runs, a
    single value where every run printed the same."""

    table = runpy.run_path(str(BENCHMARKS[0].parent / "c_floor.py"))["spread_table"]
    lines = table({(2, "all_reduce", 8): [(0.11, 1.20, 1.10, 1.09), (0.17, 1.31, 1.10, 1.19)],
                   (2, "all_reduce", 1 << 20): [(5.0, 1.031, 1.0, 1.031),
                                                (9.0, 1.048, 1.01, 1.0376)],
                   (2, "bcast", 8): [(0.05, 1.1, 0.97, 1.134)]}, 2)
    assert lines[0].strip().startswith("spread over 2 runs (min to max")
    assert lines[1].endswith("| C per py call / best C in-proc |")
    rows = lines[3:]
    assert rows == [
        "| 2 | all_reduce | 8 | 2 | +0.11 to +0.17 | 1.20 to 1.31 | 1.10 | 1.090 to 1.190 |",
        "| 2 | all_reduce | 1048576 | 2 | +5.00 to +9.00 | 1.03 to 1.05 | 1.00 to 1.01 "
        "| 1.031 to 1.038 |",
        "| 2 | bcast | 8 | 1 | +0.05 | 1.10 | 0.97 | 1.134 |"]  # a size one run lacked
    # from 3 runs the median follows each range (one outlier moves the range, not it)
    three = table({(2, "all_gather", 16 << 20): [(9.0, 1.02, 1.0, 1.02), (-3.0, 0.99, 1.0, 1.0),
                                                  (40.0, 1.10, 1.0, 1.08)]}, 3)
    assert three[3] == ("| 2 | all_gather | 16777216 | 3 | -3.00 to +40.00 (median +9.00) "
                        "| 0.99 to 1.10 (median 1.02) | 1.00 | 1.000 to 1.080 (median 1.020) |")


def test_c_floor_pooled_fit_fits_the_median_ratios_of_runs():
    """c_floor --variants --runs: the steps of several runs are fit_steps of the median
    over runs of each size's ratios (as mpi_blocking.json's steps are made)."""

    c_floor = runpy.run_path(str(BENCHMARKS[0].parent / "c_floor.py"))
    fit, pooled = c_floor["fit_steps"], c_floor["pooled_fit"]

    def t(b, nb, ar=None):
        return {"blocking": b, "nonblocking": nb, **({} if ar is None else {"allreduce": ar})}

    one = {8: t(1, 2, 0.5), 4096: t(10, 20, 30), 1 << 20: t(300, 200, 900)}
    assert pooled([one, one]) == fit(one) == [[256, "allreduce"], [65536, True], [-1, False]]
    # 1 MiB: blocking / nonblocking 0.98, 1.00, 0.985 over three runs -> median 0.985 wins
    runs = [{**one, 1 << 20: t(98 * k, 100 * k)} for k in (1, 2, 3)]
    runs[1][1 << 20] = t(100, 100)
    runs[2][1 << 20] = t(98.5, 100)
    assert pooled(runs) == [[256, "allreduce"], [-1, True]]
    assert fit(runs[1]) == [[256, "allreduce"], [65536, True], [-1, False]]


def test_call_lines_reads_a_callgrind_dump(tmp_path):
    """call_lines.totals: the dump's client-request name and its event totals (a count
    callgrind leaves out at the end of the line is absent, not misplaced)."""
    dump = tmp_path / "cg.out.2"
    dump.write_text("# callgrind format\nversion: 1\ncreator: callgrind-3.19.0\n"
                    "desc: I1 cache: 65536 B, 64 B, 16-way associative\n"
                    "desc: Trigger: Client Request: all_reduce\n"
                    "events: Ir Dr Dw I1mr D1mr D1mw\nfl=(1) x.c\nfn=(1) f\n3 9 1\n"
                    "totals: 4000 900 500 440 260 100\n")
    totals = runpy.run_path(str(BENCHMARKS[0].parent / "call_lines.py"))["totals"]
    assert totals(str(dump)) == ("all_reduce", {"Ir": 4000, "Dr": 900, "Dw": 500,
                                                "I1mr": 440, "D1mr": 260, "D1mw": 100})
    short = tmp_path / "cg.out.3"
    short.write_text("desc: Trigger: Program termination\nevents: Ir Dr I1mr\ntotals: 7\n")
    assert totals(str(short)) == ("Program termination", {"Ir": 7})


def test_c_floor_trial_order_is_the_same_in_every_process():
    """The rank part's batch order must not depend on the process (its ranks would time
    different collectives against each other): the same under any PYTHONHASHSEED, a
    permutation, and not one fixed rotation."""

    path = str(BENCHMARKS[0].parent / "c_floor.py")
    code = (f"import runpy, json; f = runpy.run_path({path!r})['trial_order']; "
            "print(json.dumps([f(7, r, 'bcast', 4096, t) for r in range(2) for t in range(4)]))")
    outs = {subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2", "3")}
    assert len(outs) == 1
    orders = json.loads(outs.pop())
    assert all(sorted(o) == list(range(7)) for o in orders)
    assert len({tuple(o) for o in orders}) > 4  # runs and trials get other orders


def test_call_gap_sees_each_mcrdl_call_as_one_mpi_collective():
    """call_gap.py's PMPI library sees every call: one MPI collective per mcrdl call, on the
    blocking and on the nonblocking path (MCRDL_MPI_BLOCKING=never: posted, completed by
    MPI_Testall). Times are only checked to be there: CI's machine is shared, and a rank
    descheduled for milliseconds moves any share of them."""
    mpiexec_or_skip()
    path = str(BENCHMARKS[0].parent / "call_gap.py")
    runs = [({}, ["--ops", "all_reduce", "all_gather", "bcast", "reduce_scatter", "barrier",
                  "--sizes", "8", "65536"]),
            ({"MCRDL_MPI_BLOCKING": "never"}, ["--ops", "all_reduce", "--sizes", "65536"])]
    for env, args in runs:
        out = run_launcher([sys.executable, path, "--ranks", "2", "--trials", "3", *args],
                           env={**os.environ, **env}, timeout=300)
        rows = [[c.strip() for c in line.strip("|").split("|")]
                for line in out.splitlines()
                if line.startswith("| ") and not line.startswith("| op ")]
        want = 9 if not env else 1  # 5 ops x 2 sizes, barrier once
        assert len(rows) == want, out
        for op, nbytes, *cells in rows:
            total = dict(zip(("C loop", "C per py call", "mcrdl"), map(float, cells[0:3]),
                             strict=True))
            outside = [float(x) for x in cells[3:6]]
            inside = [float(x) for x in cells[7:10]]
            assert cells[10] == "1.00", (env, op, nbytes, cells)
            for (arm, t), i, o in zip(total.items(), inside, outside, strict=True):
                assert 0 <= o and 0 < i <= t, (arm, op, nbytes, cells)
            assert all(math.isfinite(float(x)) for x in cells[11:13]), (env, op, nbytes, cells)
