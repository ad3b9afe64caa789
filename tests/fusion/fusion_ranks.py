"""Tensor fusion on a real multi-rank world (run on every rank under mpiexec -n 3 or 4).

Randomized rounds: every rank builds the same list of calls from a shared seed (op,
backend among mpi/gloo/auto, group, dtype, size, root, reduce op; fusable calls of
mixed sizes with unfusable ones and barriers between them), then issues it twice -
inside ``mcrdl.extensions(fusion=...)`` and without - on identical inputs. Ranks sleep
at random points (so fusion timers fire at different points of the call sequence on
different ranks). Even rounds: each rank interleaves the backends in its own order, all
calls async, waited at the end in a rank-dependent order (blocking calls there would
deadlock the program itself, fused or not). Odd rounds: the same order on every rank,
each rank choosing blocking or async per call on its own and waiting on random earlier
calls in between. Every fused result must be bit-identical to the unfused one, and
both must match a numpy reference.

Inputs are random normals, except for floating SUM/AVG reductions: a backend picks its
reduction algorithm, hence the order of the additions, by buffer size (Gloo and MPICH
both do), so a float sum over a fused buffer may round differently from the same sum
over a small one at 3+ ranks, as any two calls of different sizes may. Those inputs are
random multiples of 1/4 in [-4, 4], whose sums are exact in every order (bfloat16
included): then bit-identity is required like everywhere else.

Then targeted checks: synchronize() copies results back; a lone buffered call is
flushed at T and B bytes of buffered calls at once, with no wait or poll (watched on
the round counter); polling is_completed() alone completes a call; rounds larger than
B are cut into fused calls of at most B bytes; a flush where rank 0 buffered one call
more than the others takes the agreed call alone; wait(timeout) times out while the
last rank holds its call back (until rank 0 tells it to go), then completes; errors
are raised at call time; the hot path is restored after the block. Prints "fusion OK"
lines on rank 0; exits non-zero on failure.

Usage: fusion_ranks.py [ROUNDS] [CALLS_PER_ROUND]
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import numpy as np
import torch

import mcrdl
from mcrdl import api
from mcrdl.extensions import FusionConfig, current, fusion_stats

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dist"))
from _ref import avg_rtol  # noqa: E402


def _abort_on_error(exc_type, exc, tb):
    """An uncaught error ends the whole job at once (the other ranks would wait)."""
    sys.__excepthook__(exc_type, exc, tb)
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(1)


sys.excepthook = _abort_on_error

SEED = int(os.environ.get("MCRDL_FUSION_SEED", "777"))
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 6
PER_ROUND = int(sys.argv[2]) if len(sys.argv) > 2 else 40
SUM, MIN, MAX, AVG = mcrdl.ReduceOp.SUM, mcrdl.ReduceOp.MIN, mcrdl.ReduceOp.MAX, mcrdl.ReduceOp.AVG

mcrdl.init(["mpi", "gloo"], timeout=60)
rank, size = mcrdl.get_rank(), mcrdl.get_size()
groups = [None, mcrdl.new_group(list(reversed(range(size))))]
if size >= 3:
    groups += [mcrdl.new_group([2, 0]), mcrdl.new_group(list(range(1, size)))]

DTYPES = {"float32": np.float32, "float64": np.float64, "bfloat16": np.float32,
          "int32": np.int32, "int64": np.int64, "uint8": np.uint8}
FUSABLE = ("all_reduce", "all_gather", "bcast", "reduce_scatter")
OTHERS = ("all_to_all_single", "reduce", "barrier")
failures: list[str] = []


def members(g) -> list[int]:
    return list(range(size)) if g is None else list(g.ranks)


def data(seed: int, r: int, n: int, dname: str, exact_sum: bool = False) -> torch.Tensor:
    """Rank r's input of a call: random floats (rounded to the dtype), random ints; with
    `exact_sum`, floats whose sums are exact in any order (see the module docstring)."""
    rng = np.random.default_rng([seed, r])
    if dname in ("float32", "float64", "bfloat16") and exact_sum:
        vals = torch.from_numpy(rng.integers(-16, 17, size=n) / 4.0)
    elif dname in ("float32", "float64", "bfloat16"):
        vals = torch.from_numpy(rng.standard_normal(n).astype(np.float64))
    else:
        vals = torch.from_numpy(rng.integers(0, 100, size=n).astype(np.int64))
    return vals.to(getattr(torch, dname))


def ref_reduce(arrays: list[np.ndarray], op, dname: str) -> np.ndarray:
    st = np.stack([a.astype(np.float64) if dname in ("float32", "float64", "bfloat16") else a
                   for a in arrays])
    if op == SUM:
        return st.sum(axis=0, dtype=st.dtype)
    if op == AVG:
        return st.mean(axis=0)
    return st.min(axis=0) if op == MIN else st.max(axis=0)


def plan(rnd: int) -> tuple[list[dict], FusionConfig]:
    rng = np.random.default_rng([SEED, rnd])
    specs = []
    for i in range(PER_ROUND):
        if specs and rng.random() < 0.5:  # a burst: same fusion key, another size
            specs.append(dict(specs[-1], id=i, seed=rnd * 100_000 + i,
                              n=int(rng.choice([0, 1, 3, 17, 100, 256, 1000]))))
            continue
        g = groups[int(rng.integers(len(groups)))]
        kind = (FUSABLE[int(rng.integers(4))] if rng.random() < 0.85
                else OTHERS[int(rng.integers(3))])
        dname = list(DTYPES)[int(rng.integers(len(DTYPES)))]
        ops = (SUM, MIN, MAX, AVG) if dname in ("float32", "float64") else (SUM, MIN, MAX)
        specs.append({
            "id": i, "seed": rnd * 100_000 + i, "group": g, "kind": kind, "dtype": dname,
            "backend": ("mpi", "gloo", "auto")[int(rng.integers(3))],
            "n": int(rng.choice([0, 1, 3, 17, 100, 256, 1000, 4099])),
            "root": int(rng.integers(len(members(g)))),
            "op": ops[int(rng.integers(len(ops)))],
        })
    config = FusionConfig(buffer_bytes=int(rng.choice([2048, 16384, 1 << 20])),
                          wait_us=float(rng.choice([100, 500, 3000])))
    return specs, config


def issue(spec: dict, async_op: bool):
    """Post one call; returns (work or None, [result tensors], expected arrays)."""
    g, kind, n, dname = spec["group"], spec["kind"], spec["n"], spec["dtype"]
    mem = members(g)
    gsize, grank = len(mem), mem.index(rank)
    b = spec["backend"]
    exact = kind in ("all_reduce", "reduce_scatter", "reduce") and spec["op"] in (SUM, AVG)
    ins = [data(spec["seed"], r, n, dname, exact) for r in mem]  # by group rank
    mine = ins[grank].clone()
    npins = [t.to(torch.float64).numpy() if dname == "bfloat16" else t.numpy() for t in ins]
    if kind == "all_reduce":
        w = mcrdl.all_reduce(b, mine, op=spec["op"], group=g, async_op=async_op)
        return w, [mine], [ref_reduce(npins, spec["op"], dname)]
    if kind == "bcast":
        w = mcrdl.bcast(b, mine, src=spec["root"], group=g, async_op=async_op)
        return w, [mine], [npins[spec["root"]]]
    if kind == "all_gather":
        if spec["seed"] % 2:
            out = torch.empty(n * gsize, dtype=mine.dtype)
            outs = [out]
        else:
            out = [torch.empty(n, dtype=mine.dtype) for _ in range(gsize)]
            outs = out
        w = mcrdl.all_gather(b, out, mine, group=g, async_op=async_op)
        expect = [np.concatenate(npins)] if len(outs) == 1 else npins
        return w, outs, expect
    if kind == "reduce_scatter":
        full = [data(spec["seed"] + 7, r, n * gsize, dname, exact) for r in mem]
        npfull = [t.to(torch.float64).numpy() if dname == "bfloat16" else t.numpy()
                  for t in full]
        inp = full[grank].clone()
        if spec["seed"] % 3 == 0:
            inp = list(inp.split(n)) if n else [torch.empty(0, dtype=inp.dtype)] * gsize
        out = torch.empty(n, dtype=full[0].dtype)
        red = ref_reduce(npfull, spec["op"], dname)
        w = mcrdl.reduce_scatter(b, out, inp, op=spec["op"], group=g, async_op=async_op)
        return w, [out], [red[grank * n:(grank + 1) * n]]
    if kind == "all_to_all_single":
        full = [data(spec["seed"] + 3, r, n * gsize, dname) for r in mem]
        inp = full[grank].clone()
        out = torch.empty(n * gsize, dtype=inp.dtype)
        npfull = [t.to(torch.float64).numpy() if dname == "bfloat16" else t.numpy()
                  for t in full]
        expect = np.concatenate([npfull[r][grank * n:(grank + 1) * n] for r in range(gsize)])
        w = mcrdl.all_to_all_single(b, out, inp, group=g, async_op=async_op)
        return w, [out], [expect]
    if kind == "reduce":
        root, op = spec["root"], spec["op"]
        expect = ref_reduce(npins, op, dname) if grank == root else npins[grank]
        w = mcrdl.reduce(b, mine, dst=root, op=op, group=g, async_op=async_op)
        return w, [mine], [expect]
    w = mcrdl.barrier(b, group=g, async_op=async_op)
    return w, [], []


def lane(spec: dict) -> str:
    return "gloo" if spec["backend"] == "gloo" else "mpi"  # "auto" routes to mpi here


def run(specs: list[dict], rnd: int, config: FusionConfig | None) -> dict:
    """Issue the calls (this rank's interleaving, async choices, sleeps, wait order)."""
    rng = np.random.default_rng([4242, rnd, rank])  # rank-dependent on purpose
    mine = [s for s in specs if rank in members(s["group"])]
    interleaved = rnd % 2 == 0
    if interleaved:  # per backend lane the list order (the MPI rule), lanes mixed at random
        queues = {ln: [s for s in mine if lane(s) == ln] for ln in ("mpi", "gloo")}
        order = []
        while any(queues.values()):
            ready = [k for k, q in queues.items() if q]
            order.append(queues[ready[int(rng.integers(len(ready)))]].pop(0))
    else:
        order = mine
    results, pending, backends = {}, [], {}
    ctx = mcrdl.extensions(fusion=config) if config else contextlib.nullcontext()
    with ctx:
        for spec in order:
            if rng.random() < 0.1:
                time.sleep(float(rng.random()) * 1e-3)
            async_op = interleaved or bool(rng.random() < 0.8)
            w, outs, expect = issue(spec, async_op=async_op)
            results[spec["id"]] = (outs, expect, spec)
            if w is not None:
                pending.append(w)
                backends[spec["id"]] = (w.backend, spec["backend"])
            if not interleaved and pending and rng.random() < 0.1:
                pending.pop(int(rng.integers(len(pending)))).wait()
        for i in rng.permutation(len(pending)):
            pending[int(i)].wait()
    for sid, (got, asked) in backends.items():
        want = "mpi" if asked == "auto" else asked
        if got != want:
            failures.append(f"round {rnd} call {sid}: Work.backend {got!r}, expected {want!r}")
    return results


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else t


def compare(rnd: int, fused: dict, plain: dict) -> None:
    for sid, (outs, expect, spec) in plain.items():
        fouts = fused[sid][0]
        what = f"round {rnd} call {sid} {spec['kind']} {spec['backend']} {spec['dtype']} " \
               f"n={spec['n']} group={members(spec['group'])}"
        for k, (a, b, e) in enumerate(zip(fouts, outs, expect, strict=True)):
            if not torch.equal(bits(a), bits(b)):
                failures.append(f"{what} output {k}: fused differs from unfused")
            got = a.to(torch.float64).numpy() if spec["dtype"] == "bfloat16" else a.numpy()
            # exact but for AVG: data() makes sums exact, MIN/MAX and data movement pick
            # inputs; AVG (float32/float64 only) rounds its division (tests/dist/_ref.py)
            avg = spec["kind"] in ("all_reduce", "reduce_scatter", "reduce") \
                and spec["op"] == AVG
            ok = (np.allclose(got, e, rtol=avg_rtol(spec["dtype"]), atol=0) if avg
                  else np.array_equal(got, np.asarray(e).astype(got.dtype)))
            if not ok:
                failures.append(f"{what} output {k}: wrong result {got[:4]} vs {e[:4]}")


fusion_stats(reset=True)
checked = 0
for rnd in range(ROUNDS):
    specs, config = plan(rnd)
    fused = run(specs, rnd, config)
    plain = run(specs, rnd, None)
    compare(rnd, fused, plain)
    checked += len(plain)

stats = fusion_stats()
views = mcrdl.all_gather_object(stats)
if rank == 0:
    total = {k: sum(v[k] for v in views) for k in stats}
    print(f"fusion OK randomized: world {size}, {ROUNDS} rounds, {checked} calls on rank 0 "
          f"checked bit-identical; all ranks: {total['calls']} calls fused in "
          f"{total['flushes']} flushes, {total['short_flushes']} flushes where ranks had "
          "buffered different calls", flush=True)
    if total["flushes"] == 0 or total["calls"] <= total["flushes"]:
        failures.append(f"fusion never combined calls: {total}")

# -- targeted checks ---------------------------------------------------------------------
ts = [torch.full((k + 1,), float(rank + k)) for k in range(20)]
with mcrdl.extensions(fusion={"wait_us": 1e6}):  # only synchronize may flush
    ws = [mcrdl.all_reduce("gloo", t, async_op=True) for t in ts]
    if not repr(ws[0]).startswith("<mcrdl fused all_reduce #"):
        failures.append(f"a buffered call's repr does not name its op: {ws[0]!r}")
    mcrdl.synchronize(["gloo"])
    expect = [float(sum(range(size)) + size * k) for k in range(20)]
    if [t[0].item() for t in ts] != expect or not all(w.is_completed() for w in ws):
        failures.append("synchronize() did not flush fused calls and copy results back")



def flushed_after(before: int, limit: float = 30.0) -> float | None:
    """Seconds until this rank's fusion rounds exceed `before` (None: not within
    `limit`), watching the counters only: no wait or poll that would flush itself."""
    start = time.monotonic()
    while fusion_stats()["flushes"] == before:
        if time.monotonic() - start > limit:
            return None
        time.sleep(1e-3)
    return time.monotonic() - start


T_US = 50_000
with mcrdl.extensions(fusion={"wait_us": T_US}):  # T alone flushes a lone call
    t = torch.full((5,), float(rank))
    before = fusion_stats()["flushes"]
    w = mcrdl.all_reduce("mpi", t, async_op=True)
    took = flushed_after(before)
    if took is None or took < 0.9 * T_US * 1e-6:
        failures.append(f"a call buffered alone was flushed after {took} s, T = {T_US} us")
    w.wait()
    if t[0].item() != sum(range(size)):
        failures.append("fused call flushed by the timer has a wrong result")

with mcrdl.extensions(fusion={"buffer_bytes": 4096, "wait_us": 1e8}):  # B alone flushes
    ts = [torch.full((256,), float(rank + k)) for k in range(4)]  # 4 x 1 KiB = B
    before = fusion_stats()["flushes"]
    ws = [mcrdl.all_reduce("gloo", t, async_op=True) for t in ts]
    if flushed_after(before) is None:
        failures.append("B bytes of buffered calls were not flushed (T = 100 s)")
    for w in ws:
        w.wait()
    if [t[0].item() for t in ts] != [float(sum(range(size)) + size * k) for k in range(4)]:
        failures.append("fused calls flushed at B bytes have wrong results")

with mcrdl.extensions(fusion={"wait_us": 1e8}):  # polling alone flushes and completes
    t = torch.full((7,), float(rank))
    w = mcrdl.all_reduce("mpi", t, async_op=True)
    deadline = time.monotonic() + 30
    while not w.is_completed():
        if time.monotonic() > deadline:
            failures.append("a fused call polled with is_completed() never completed")
            break
        time.sleep(1e-3)
    if t[0].item() != sum(range(size)):  # completed means the slice is back in t
        failures.append("fused call completed by polling has a wrong result")

with mcrdl.extensions(fusion={"buffer_bytes": 4096, "wait_us": 1e8}):  # rounds cut at B
    ts = [torch.full((100 + k,), float(rank + k)) for k in range(30)]  # 12.7 KiB in all
    ws = [mcrdl.all_reduce("mpi", t, async_op=True) for t in ts]
    for w in ws:
        w.wait()
    if any(t.ne(float(sum(range(size)) + size * k)).any() for k, t in enumerate(ts)):
        failures.append("fused calls cut into runs of at most B bytes have wrong results")

with mcrdl.extensions(fusion={"wait_us": 1e8}):  # a flush where ranks buffered different calls
    a, b = torch.full((4,), float(rank)), torch.full((4,), float(rank + 1))
    before = fusion_stats()["short_flushes"]
    wa = mcrdl.all_reduce("mpi", a, async_op=True)
    if rank == 0:  # b buffered beside a here only: the agreement flushes a alone
        wb = mcrdl.all_reduce("mpi", b, async_op=True)
        wa.wait()
    else:
        wa.wait()
        wb = mcrdl.all_reduce("mpi", b, async_op=True)
    wb.wait()
    short = fusion_stats()["short_flushes"] - before
    if short != (1 if rank == 0 else 0):
        failures.append(f"{short} short flushes where rank 0 had buffered one call more")
    if a[0].item() != sum(range(size)) or b[0].item() != sum(range(1, size + 1)):
        failures.append("calls flushed by a short agreement have wrong results")

with mcrdl.extensions(fusion={"wait_us": 1e6}):  # wait(timeout) honours a short timeout
    t = torch.full((3,), float(rank))
    go = torch.zeros(1)
    if rank == size - 1:  # issues its call only once rank 0's timed wait is over
        mcrdl.recv("gloo", go, src=0)
    w = mcrdl.all_reduce("mpi", t, async_op=True)
    if rank == 0:
        start = time.monotonic()
        try:
            w.wait(timeout=0.2)
            failures.append("wait(timeout=0.2) returned before the last rank issued the call")
        except mcrdl.CommTimeoutError:
            if time.monotonic() - start > 10 * 0.2:  # a hang guard, not a speed check
                failures.append(f"wait(timeout=0.2) took {time.monotonic() - start:.2f} s")
        mcrdl.send("gloo", go, dst=size - 1)
    w.wait()  # a later wait still completes it
    if t[0].item() != sum(range(size)):
        failures.append("fused call waited after a timeout has a wrong result")

with mcrdl.extensions(fusion=True):
    for bad, why in ((lambda: mcrdl.all_reduce("mpi", torch.ones(4, 4).t(), async_op=True),
                      "non-contiguous"),
                     (lambda: mcrdl.all_gather("gloo", torch.empty(3), torch.ones(2),
                                               async_op=True), "output size")):
        try:
            bad()
            failures.append(f"fused call with bad argument ({why}) was accepted")
        except mcrdl.InvalidArgumentError:
            pass
    if size >= 3 and rank == 1:  # groups[2] is [2, 0]: rank 1 is not a member
        try:
            mcrdl.all_reduce("mpi", torch.ones(2), group=groups[2], async_op=True)
            failures.append("fused call on a group without this rank was accepted")
        except mcrdl.InvalidArgumentError:
            pass

if api._dispatch["mpi"] is not api._runtime.bases["mpi"] or current().enabled:
    failures.append("after the extensions() blocks the hot path still goes through a chain")

all_failures = mcrdl.all_gather_object(failures)
if rank == 0:
    bad = [f"rank {r}: {f}" for r, fs in enumerate(all_failures) for f in fs]
    if bad:
        print(f"fusion FAILED ({len(bad)}):\n" + "\n".join(bad[:40]), flush=True)
    else:
        print("fusion OK targeted: synchronize, flush at T, at B, by polling, runs of B "
              "bytes, a short flush, wait(timeout), call-time errors, hot path restored",
              flush=True)
ok = not any(all_failures)
mcrdl.finalize()
sys.exit(0 if ok else 1)
