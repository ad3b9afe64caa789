"""Randomized mixed-backend stress (run on every rank under mpiexec -n 3 or 4).

In each round every rank issues the same list of async ops (random op, backend, group,
dtype and size, from a seed shared by all ranks) in a RANK-DEPENDENT interleaving across
backends (the per-backend order is the list order, the MPI rule), then waits on them in
a rank-dependent order. Every result is compared with a numpy reference computed from
all ranks' (deterministic) inputs. Prints the op count and runtime on rank 0.

Usage: stress.py [ROUNDS] [OPS_PER_ROUND]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

import mcrdl

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
PER_ROUND = int(sys.argv[2]) if len(sys.argv) > 2 else 40
BACKENDS = ("mpi", "gloo")
KINDS = ("all_reduce", "all_gather", "bcast", "reduce_scatter", "all_to_all_single",
         "all_gatherv", "reduce")
DTYPES = {
    "float32": (torch.float32, np.float32),
    "float64": (torch.float64, np.float64),
    "int32": (torch.int32, np.int32),
    "int64": (torch.int64, np.int64),
    "bfloat16": (torch.bfloat16, np.float32),  # small integers: exact in bfloat16
    "uint8": (torch.uint8, np.uint8),
}

mcrdl.init(list(BACKENDS), timeout=120)
rank, size = mcrdl.get_rank(), mcrdl.get_size()
groups = [None, mcrdl.new_group(list(reversed(range(size))))]
if size >= 3:
    groups += [mcrdl.new_group([2, 0]), mcrdl.new_group(list(range(1, size)))]


def members(g):
    return list(range(size)) if g is None else list(g.ranks)


def data(seed: int, r: int, n: int, np_dtype) -> np.ndarray:
    """Rank r's input of an op: small integers, exact in every dtype used."""
    rng = np.random.default_rng([seed, r])
    return rng.integers(0, 8, size=n).astype(np_dtype)


def plan_round(rnd: int):
    rng = np.random.default_rng([12345, rnd])
    specs = []
    for i in range(PER_ROUND):
        g = groups[int(rng.integers(len(groups)))]
        dname = list(DTYPES)[int(rng.integers(len(DTYPES)))]
        specs.append({
            "id": i,
            "seed": rnd * 100000 + i,
            "backend": BACKENDS[int(rng.integers(2))],
            "group": g,
            "kind": KINDS[int(rng.integers(len(KINDS)))],
            "dtype": dname,
            "n": int(rng.choice([0, 1, 3, 17, 256, 1000, 4099])),
            "root": int(rng.integers(len(members(g)))),
            "op": list(NP_REDUCE)[int(rng.integers(3))],
        })
    return specs


NP_REDUCE = {mcrdl.ReduceOp.SUM: np.sum, mcrdl.ReduceOp.MAX: np.max, mcrdl.ReduceOp.MIN: np.min}


def issue(spec):
    """Post one op async; return (work, check) where check() asserts the result."""
    g, kind, n = spec["group"], spec["kind"], spec["n"]
    tdt, ndt = DTYPES[spec["dtype"]]
    mem = members(g)
    gsize, grank = len(mem), mem.index(rank)
    ins = [data(spec["seed"], r, n, ndt) for r in mem]  # indexed by group rank
    mine = torch.from_numpy(ins[grank].copy()).to(tdt)
    b = spec["backend"]
    if kind == "all_reduce":
        op = spec["op"]
        expect = NP_REDUCE[op](np.stack(ins), axis=0)
        w = mcrdl.all_reduce(b, mine, op=op, group=g, async_op=True)
        return w, lambda: (mine, expect)
    if kind == "reduce":
        op, root = spec["op"], spec["root"]
        expect = NP_REDUCE[op](np.stack(ins), axis=0) if grank == root else ins[grank]
        w = mcrdl.reduce(b, mine, dst=root, op=op, group=g, async_op=True)
        return w, lambda: (mine, expect)
    if kind == "all_gather":
        out = torch.empty(n * gsize, dtype=tdt)
        w = mcrdl.all_gather(b, out, mine, group=g, async_op=True)
        return w, lambda: (out, np.concatenate(ins))
    if kind == "bcast":
        root = spec["root"]
        w = mcrdl.bcast(b, mine, src=root, group=g, async_op=True)
        return w, lambda: (mine, ins[root])
    if kind == "reduce_scatter":
        op = spec["op"]
        full = [data(spec["seed"] + 7, r, n * gsize, ndt) for r in mem]
        inp = torch.from_numpy(full[grank].copy()).to(tdt)
        out = torch.empty(n, dtype=tdt)
        red = NP_REDUCE[op](np.stack(full), axis=0)
        w = mcrdl.reduce_scatter(b, out, inp, op=op, group=g, async_op=True)
        return w, lambda: (out, red[grank * n:(grank + 1) * n])
    if kind == "all_to_all_single":
        full = [data(spec["seed"] + 3, r, n * gsize, ndt) for r in mem]
        inp = torch.from_numpy(full[grank].copy()).to(tdt)
        out = torch.empty(n * gsize, dtype=tdt)
        expect = np.concatenate([full[r][grank * n:(grank + 1) * n] for r in range(gsize)])
        w = mcrdl.all_to_all_single(b, out, inp, group=g, async_op=True)
        return w, lambda: (out, expect)
    # all_gatherv: rank i contributes (n + i) % 7 elements
    counts = [(n + i) % 7 for i in range(gsize)]
    parts = [data(spec["seed"] + 5, r, counts[i], ndt) for i, r in enumerate(mem)]
    inp = torch.from_numpy(parts[grank].copy()).to(tdt)
    out = torch.empty(sum(counts), dtype=tdt)
    w = mcrdl.all_gatherv(b, out, inp, counts, group=g, async_op=True)
    return w, lambda: (out, np.concatenate(parts))


def interleave(specs, rng):
    """A rank-dependent merge of the per-backend sequences (each kept in order)."""
    queues = {b: [s for s in specs if s["backend"] == b] for b in BACKENDS}
    order = []
    while any(queues.values()):
        live = [b for b in BACKENDS if queues[b]]
        order.append(queues[live[int(rng.integers(len(live)))]].pop(0))
    return order


start = time.perf_counter()
issued = 0
per_backend = dict.fromkeys(BACKENDS, 0)
for rnd in range(ROUNDS):
    rng = np.random.default_rng([rnd, rank, 99])
    specs = [s for s in plan_round(rnd) if rank in members(s["group"])]
    pending = []
    for s in interleave(specs, rng):
        w, check = issue(s)
        pending.append((s, w, check))
        issued += 1
        per_backend[s["backend"]] += 1
    for k in rng.permutation(len(pending)):
        s, w, check = pending[k]
        assert w.wait(), s
        assert w.is_completed() and w.backend == s["backend"], (s, w.backend)
    for s, _, check in pending:
        got, expect = check()
        got = got.to(torch.float64).numpy() if s["dtype"] == "bfloat16" else got.numpy()
        if not np.array_equal(got.reshape(-1), np.asarray(expect).reshape(-1).astype(got.dtype)):
            raise AssertionError(f"rank {rank}: wrong result for {s}: got {got[:8]} "
                                 f"expected {np.asarray(expect)[:8]}")
elapsed = time.perf_counter() - start
total = torch.tensor([issued])
mcrdl.all_reduce("mpi", total)
mcrdl.finalize()
if rank == 0:
    print(f"stress OK: world {size}, {ROUNDS} rounds, {int(total)} async ops over all ranks "
          f"(rank 0 issued {issued}: {per_backend}), {len(groups)} groups, "
          f"{elapsed:.2f} s")
print(f"rank {rank}: issued {issued} async ops, all correct")
