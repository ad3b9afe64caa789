"""Communication logging on a real multi-rank world (run on every rank under mpiexec).

Every rank issues a known mix of calls (blocking and async, mpi, gloo and auto, world
and a sub-group, collectives, barrier, send/recv) and checks that its own summary has
exactly those counts and bytes, and nothing else. The last rank arrives late at some
collectives: the gathered summary must name it as the straggler. With fusion on, the
"wire" level shows the agreement and the one fused call. JSON/CSV exports and a
gathered Chrome trace are written to the directory given as argv[1] (the pytest wrapper
checks the trace's schema). Exits non-zero on a failure.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import time

import torch

import mcrdl


def _abort_on_error(exc_type, exc, tb):
    """An uncaught error ends the whole job at once (the other ranks would wait)."""
    sys.__excepthook__(exc_type, exc, tb)
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(1)


sys.excepthook = _abort_on_error

outdir = sys.argv[1]
mcrdl.configure(logging=True)
mcrdl.init(["mpi", "gloo"], timeout=60)
rank, size = mcrdl.get_rank(), mcrdl.get_size()
sub = mcrdl.new_group(list(range(1, size)))
failures: list[str] = []
expect: dict[tuple, list[int]] = {}  # (op, backend, bucket, group size) -> [count, bytes]


def issued(op: str, backend: str, nbytes: int, gsize: int = size) -> None:
    bucket = 0 if nbytes == 0 else 1 << (nbytes.bit_length() - 1)
    e = expect.setdefault((op, backend, bucket, gsize), [0, 0])
    e[0] += 1
    e[1] += nbytes


mcrdl.reset_log()
t = torch.ones(256)  # 1 KiB
for _ in range(5):
    mcrdl.all_reduce("mpi", t)
    issued("all_reduce", "mpi", 1024)
works = []
for _ in range(3):
    out = torch.empty(100 * size, dtype=torch.float64)
    works.append(mcrdl.all_gather("gloo", out, torch.ones(100, dtype=torch.float64),
                                  async_op=True))
    issued("all_gather", "gloo", 800 * size)
for _ in range(2):
    w = mcrdl.bcast("auto", torch.zeros(10, dtype=torch.int32), src=0, async_op=True)
    works.append(w)
    issued("bcast", "mpi", 40)  # "auto" resolves to mpi here
    if w.backend != "mpi":
        failures.append(f"Work.backend of an 'auto' call is {w.backend!r}, expected 'mpi'")
if rank != 0:
    mcrdl.all_reduce("gloo", torch.ones(3, dtype=torch.int64), group=sub)
    issued("all_reduce", "gloo", 24, size - 1)
mcrdl.barrier("mpi")
issued("barrier", "mpi", 0)
a2a_in = torch.arange(12 * size, dtype=torch.float32)
works.append(mcrdl.all_to_all_single("gloo", torch.empty_like(a2a_in), a2a_in, async_op=True))
issued("all_to_all_single", "gloo", a2a_in.nbytes)
nxt, prv = (rank + 1) % size, (rank - 1) % size
ws = mcrdl.send("mpi", torch.ones(64), dst=nxt, tag=1, async_op=True)
mcrdl.recv("mpi", torch.empty(64), src=prv, tag=1)
ws.wait()
issued("send", "mpi", 256)
issued("recv", "mpi", 256)
for w in works:
    w.wait()
# the straggler: the last rank arrives 30 ms late at three 4 KiB all_reduces
big = torch.ones(1024)
for _ in range(3):
    if rank == size - 1:
        time.sleep(0.03)
    mcrdl.all_reduce("mpi", big)
    issued("all_reduce", "mpi", 4096)

rows = mcrdl.log_summary(quiet=True)
got = {(r["op"], r["backend"], r["bucket_bytes"], r["group_size"]): [r["count"], r["bytes"]]
       for r in rows}
if got != expect:
    failures.append(f"summary counts/bytes {got} differ from what was issued {expect}")
if any(r["completed"] != r["count"] or r["lat_min_us"] <= 0 for r in rows):
    failures.append(f"some calls have no latency: {rows}")
for r in rows:
    if r["op"] == "all_reduce" and r["bucket_bytes"] == 1024:
        want = r["bytes"] / r["count"] / (r["lat_median_us"] * 1e-6) / 1e9
        if abs(r["algbw_GBps"] - want) > 1e-9 * want or \
                abs(r["busbw_GBps"] - want * 2 * (size - 1) / size) > 1e-9 * want:
            failures.append(f"algbw/busbw do not follow the nccl-tests formulas: {r}")

gathered = mcrdl.log_summary(gather=True, file=sys.stdout)
everyone: dict[tuple, list[int]] = {}  # what all ranks issued: [count, bytes, ranks]
for view in mcrdl.all_gather_object(expect):
    for key, (count, nbytes) in view.items():
        e = everyone.setdefault(key, [0, 0, 0])
        e[0], e[1], e[2] = e[0] + count, e[1] + nbytes, e[2] + 1
got = {(r["op"], r["backend"], r["bucket_bytes"], r["group_size"]):
       [r["count"], r["bytes"], r["ranks"]] for r in gathered}
if got != everyone:
    failures.append(f"gathered summary {got} differs from what all ranks issued {everyone}")
late = next(r for r in gathered if r["op"] == "all_reduce" and r["bucket_bytes"] == 4096)
if late.get("last_arrival_rank") != size - 1 or late["arrival_skew_median_us"] < 20_000:
    failures.append(f"the late rank is not named the straggler: {late}")
if late["fastest_rank"] != size - 1 or late["lat_median_spread_us"] < 15_000:
    failures.append(f"the latency spread does not show the late rank: {late}")

json_path = mcrdl.export_log(os.path.join(outdir, "log.json"), gather=True, level="call")
csv_path = mcrdl.export_log(os.path.join(outdir, "log.csv"), gather=True, level="call")
if rank == 0:
    with open(json_path, encoding="utf-8") as f:
        doc = json.load(f)
    if doc["rows"] != json.loads(json.dumps(gathered)):
        failures.append("the JSON export differs from the gathered summary")
    with open(csv_path, encoding="utf-8", newline="") as f:
        table = list(csv.DictReader(f))
    if [(r["op"], int(r["count"]), int(r["bytes"])) for r in table] != \
            [(r["op"], r["count"], r["bytes"]) for r in gathered]:
        failures.append("the CSV export differs from the gathered summary")
elif json_path is not None or csv_path is not None:
    failures.append("export_log(gather=True) wrote a file on a rank other than 0")

# wire level: with fusion on, 8 async all_reduces become one agreement + one fused call
mcrdl.reset_log()
with mcrdl.extensions(fusion={"wait_us": 1e6}):
    ts = [torch.ones(256) for _ in range(8)]
    for w in [mcrdl.all_reduce("gloo", x, async_op=True) for x in ts]:
        w.wait()
wire = {(r["op"], r["bucket_bytes"]): r["count"] for r in mcrdl.log_summary(level="wire",
                                                                          quiet=True)}
call = {(r["op"], r["bucket_bytes"]): r["count"] for r in mcrdl.log_summary(quiet=True)}
if call != {("all_reduce", 1024): 8} or wire != {("all_reduce", 8): 1, ("all_reduce", 8192): 1}:
    failures.append(f"fusion logs: calls {call}, wire {wire}")
if any(t[0].item() != size for t in ts):
    failures.append("fused all_reduce under logging: wrong result")

trace = mcrdl.export_trace(os.path.join(outdir, "trace.json"), gather=True)
if (rank == 0) != (trace is not None):
    failures.append(f"export_trace(gather=True) returned {trace!r} on rank {rank}")

views = mcrdl.all_gather_object(failures)
if rank == 0:
    bad = [f"rank {r}: {f}" for r, fs in enumerate(views) for f in fs]
    print("logger FAILED:\n" + "\n".join(bad) if bad else
          f"logger OK: counts and bytes exact on {size} ranks, straggler found, exports, "
          "wire level")
ok = not any(views)
mcrdl.finalize()
sys.exit(0 if ok else 1)
