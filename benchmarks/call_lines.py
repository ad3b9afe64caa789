"""Cache lines one cold call touches: mcrdl's blocking mpi calls, each against the same
MPI call made from the minimal C entry from Python (c_floor.c's ``call``), counted by
valgrind's callgrind.

    python benchmarks/call_lines.py [--calls 40] [--keep DIR] [--ops all_reduce bcast all_gather
                                     reduce_scatter barrier]

Why: between two large collectives the MPI copy evicts the caches, so the code and data
a call runs through before and after MPI come from memory again on every call. At 1 MiB
that, not the instructions, is most of what mcrdl costs over C (docs/performance.md,
"The rest of a call: cache lines and time outside MPI"), and timings on a shared 2-core
machine cannot resolve it: this count is exact and repeatable. One rank (an MPI
singleton, world of 1: the path up to MPI and back is the same as at any size; MPI's own
lines are counted in both columns). mcrdl runs every op as the blocking MPI collective
(MCRDL_MPI_BLOCKING=always, unless the caller set it), as the C entry does: each row's
"minus C" is then mcrdl's own part.

Each call is made after 4 MiB of writes (data caches) and a 370 KB function (the
instruction cache), with simulated 64 KiB 16-way first-level caches: a miss is then a
line the call touches. Only the calls themselves are counted (callgrind
--toggle-collect on the front's C function and on c_floor's ``call``), a dump per op.
Prints per op, for the C call and for mcrdl's: instructions, code lines, data lines,
all lines per call, and mcrdl minus C in instructions and lines. ``--keep DIR`` keeps the
dumps, to name the functions with ``callgrind_annotate``. Needs valgrind and the MPI
library's ``mpicc``; takes 1-2 minutes per op.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import c_floor  # noqa: E402  (its build of c_floor.c)

OPS = tuple(c_floor.C_OPS)  # the ops c_floor.c measures

# The flusher: evict() writes 4 MiB; flush_i() runs ~370 KB of straight-line code (more
# than the simulated instruction cache); dump() ends one op's counts.
FLUSH_C = r"""
#include <stdlib.h>
#include <string.h>
#include <valgrind/callgrind.h>
static char* buf;
void evict(void) { if (!buf) buf = malloc(4 << 20); memset(buf, rand() & 255, 4 << 20); }
void dump(const char* name) { CALLGRIND_DUMP_STATS_AT(name); }
volatile unsigned long sink;
__attribute__((noinline)) void flush_i(void) {
  unsigned long x = sink;
%s
  sink = x;
}
"""

# The one rank: for each arm, a few warm calls, a dump (dropped), then the cold calls and a
# dump named after the arm.
RANK = r"""
import ctypes, functools, importlib.util, sys
import torch, mcrdl
lib_path, flush_path, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
spec = importlib.util.spec_from_file_location("c_floor", lib_path)
cm = importlib.util.module_from_spec(spec); spec.loader.exec_module(cm)
fl = ctypes.CDLL(flush_path); fl.dump.argtypes = [ctypes.c_char_p]
mcrdl.init(["mpi"])
codes = {name: int(code) for name, code in (kv.split("=") for kv in sys.argv[4].split(","))}
ops = sys.argv[5:]
a, b = torch.zeros(2), torch.zeros(2)
# b = op(a) in both columns (c_floor.c's call: `a` is the input, `b` the output)
arms = {"all_reduce": functools.partial(mcrdl.all_reduce, "mpi", a),
        "bcast": functools.partial(mcrdl.bcast, "mpi", a, 0),
        "all_gather": functools.partial(mcrdl.all_gather, "mpi", b, a),
        "reduce_scatter": functools.partial(mcrdl.reduce_scatter, "mpi", b, a),
        "barrier": functools.partial(mcrdl.barrier, "mpi")}
for op in ops:
    nbytes = 0 if op == "barrier" else 8
    arms["C " + op] = functools.partial(cm.call, codes[op], 1, a.data_ptr(), b.data_ptr(), nbytes)
for name in [n for op in ops for n in ("C " + op, op)]:
    fn = arms[name]
    for _ in range(3):
        fn()
    fl.dump(b"warm")
    for _ in range(calls):
        fl.evict(); fl.flush_i(); fn()
    fl.dump(name.encode())
mcrdl.finalize()
"""


def build_flusher(out_dir: str) -> str:
    src = os.path.join(out_dir, "flush.c")
    body = "\n".join(f"  x = x * {2 * i + 3}u + {i};" for i in range(40000))
    with open(src, "w") as f:
        f.write(FLUSH_C % body)
    lib = os.path.join(out_dir, "libflush.so")
    cc = shutil.which("cc") or shutil.which("gcc") or "cc"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
    return lib


def totals(path: str) -> tuple[str, dict[str, int]]:
    """The trigger name and the event totals of one callgrind dump."""
    name, events, total = "", [], None
    with open(path) as f:
        for line in f:
            if line.startswith("desc: Trigger:"):
                m = re.search(r"Client Request: (.*)", line)
                name = m.group(1).strip() if m else line.split(":", 2)[2].strip()
            elif line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("totals:"):
                total = [int(x) for x in line.split()[1:]]
    # callgrind may leave trailing zero counts out of a line
    return name, dict(zip(events, total or [], strict=False))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--keep", metavar="DIR",
                    help="copy the callgrind dumps (one per op) into DIR, for "
                         "callgrind_annotate --inclusive=yes DIR/<op>.out")
    args = ap.parse_args(argv)
    valgrind = shutil.which("valgrind")
    if not valgrind:
        sys.exit("call_lines.py needs valgrind (apt install valgrind)")
    python = os.path.realpath(sys.executable)  # not a shim script: valgrind runs the binary
    with tempfile.TemporaryDirectory() as tmp:
        _, lib = c_floor.build(tmp)
        flush = build_flusher(tmp)
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(RANK)
        out = os.path.join(tmp, "cg.out")
        cmd = [valgrind, "--tool=callgrind", "--cache-sim=yes", "--I1=65536,16,64",
               "--D1=65536,16,64", "--LL=4194304,16,64", "--collect-jumps=no",
               "--toggle-collect=*front_vectorcall*", "--toggle-collect=py_call",
               f"--callgrind-out-file={out}", python, script, lib, flush,
               str(args.calls), ",".join(f"{op}={c_floor.C_OPS[op]}" for op in args.ops),
               *args.ops]
        env = dict(os.environ, MCRDL_TIMEOUT="600", PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
             os.environ.get("PYTHONPATH", "")]))
        env.setdefault("MCRDL_MPI_BLOCKING", "always")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"valgrind failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = {}
        for path in sorted(glob.glob(out + "*")):
            name, t = totals(path)
            if name and name != "warm" and t:
                rows[name] = t
                if args.keep:
                    os.makedirs(args.keep, exist_ok=True)
                    shutil.copy(path, os.path.join(args.keep,
                                                   name.replace(" ", "_") + ".out"))
    n = args.calls
    print(f"per cold call, {n} calls each, world of 1, MCRDL_MPI_BLOCKING="
          f"{env['MCRDL_MPI_BLOCKING']} (python {sysconfig.get_python_version()}):")
    print("| call | instructions | code lines | data lines | lines | minus C: instructions "
          "| minus C: lines |")
    print("|---|---|---|---|---|---|---|")
    for op in args.ops:
        per = {}
        for name in ("C " + op, op):
            t = rows.get(name)
            if t is None:
                print(f"| {name} | (no dump) | | | | | |")
                continue
            code, data = t.get("I1mr", 0) / n, (t.get("D1mr", 0) + t.get("D1mw", 0)) / n
            per[name] = (t.get("Ir", 0) / n, code + data)
            extra = ["", ""]
            if name == op and "C " + op in per:
                extra = [f"{per[op][0] - per['C ' + op][0]:+.0f}",
                         f"{per[op][1] - per['C ' + op][1]:+.0f}"]
            print(f"| {name} | {per[name][0]:.0f} | {code:.0f} | {data:.0f} | "
                  f"{per[name][1]:.0f} | {extra[0]} | {extra[1]} |")


if __name__ == "__main__":
    main()
