"""Every c10d collective of the "mcrdl" torch.distributed backend against numpy; run by
every rank of ``mpiexec -n N`` or ``torchrun --nproc-per-node N`` (N = 1..5).

``init_process_group("mcrdl")`` with no other argument (mpiexec: mcrdl's own
rendezvous). For every dtype torch's Gloo supports (all of mcrdl.ops.DTYPES: Gloo has
no other), on the world and on a sub-group (blocking on one and async on the other,
alternating per dtype, so that every dtype and every group runs both ways; the async
calls of a pass are all issued, then waited in reverse order), each torch.distributed
collective is compared with a numpy reference built from every rank's deterministic
input: all_reduce (every reduce op of the dtype), broadcast, reduce, all_gather,
all_gather_into_tensor (concatenated and stacked), reduce_scatter,
reduce_scatter_tensor, all_to_all_single (uneven splits), all_to_all, gather, scatter,
the coalesced forms (_coalescing_manager), send/recv, isend/irecv, batch_isend_irecv,
barrier; once per group the object collectives and the functional collectives; once
new_subgroups.

Then, in one process: per-operation routing (set_torch_routes and a group's own
TorchBackendOptions, checked in mcrdl's communication log), bad input (raised on the
rank that passed it, before anything is sent: the others' next collective completes),
a non-member's call, and, where "mpi" exists, the mixing stress (torch.distributed ops
routed to mpi interleaved with direct mcrdl.all_gather("gloo", ...), waited in a
rank-dependent order).

Prints "rank R: torch backend collectives OK (...)" on success, naming the backends
mcrdl started and the blocks that ran (tests/test_torch_backend.py checks them).
"""

from __future__ import annotations

import datetime
import os
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import mcrdl
from mcrdl.ops import DTYPES

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecations
warnings.filterwarnings("ignore", message=".*does not belong to the given group")

dist.init_process_group("mcrdl", timeout=datetime.timedelta(
    seconds=float(os.environ.get("MCRDL_TIMEOUT", "60"))))
RANK, SIZE = dist.get_rank(), dist.get_world_size()
mcrdl.configure(logging=True)
ReduceOp = dist.ReduceOp
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
checked: dict[str, int] = {}


def values(seed: int, r: int, shape, dtype: torch.dtype, low: int = 0, high: int = 4) -> np.ndarray:
    """Rank r's input: small integers, exact in every dtype (bool: 0/1)."""
    if dtype == torch.bool:
        low, high = 0, 2
    return np.random.default_rng([seed, r]).integers(low, high, size=shape)


def tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(a)).to(dtype)  # a copy: ops write in place


def same(name: str, got: torch.Tensor, expect, dtype: torch.dtype, rtol: float = 0.0) -> None:
    want = tensor(np.asarray(expect), dtype) if not isinstance(expect, torch.Tensor) else expect
    want = want.reshape(got.shape)
    ok = (torch.allclose(got.double(), want.double(), rtol=rtol, atol=0) if rtol
          else torch.equal(got, want))
    if not ok:
        raise AssertionError(f"rank {RANK}: {name} {dtype}: got {got.reshape(-1)[:8]}, "
                             f"expected {want.reshape(-1)[:8]}")
    checked[name] = checked.get(name, 0) + 1


_NP_REDUCE = {
    "SUM": lambda a: a.sum(0), "PRODUCT": lambda a: a.prod(0), "MIN": lambda a: a.min(0),
    "MAX": lambda a: a.max(0), "AVG": lambda a: a.mean(0),
    "BAND": np.bitwise_and.reduce, "BOR": np.bitwise_or.reduce,
    "BXOR": np.bitwise_xor.reduce,
}


class CoalescedWork:
    """The Work-like view of an async _coalescing_manager (its works, waited together)."""

    def __init__(self, manager):
        self.manager = manager

    def wait(self) -> bool:
        self.manager.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.manager.works)


class FutureWork:
    """The Work-like view of the Future that async all_gather_coalesced returns."""

    def __init__(self, future: torch.futures.Future):
        self.future = future

    def wait(self) -> bool:
        self.future.wait()  # raises what the op failed with
        return True

    def is_completed(self) -> bool:
        return self.future.done()


def reduce_ops(dtype: torch.dtype) -> list[str]:
    if dtype in FLOATS:
        return ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
    return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def reduced(name: str, arrays: list[np.ndarray], dtype: torch.dtype) -> np.ndarray:
    stacked = np.stack(arrays)
    if dtype == torch.bool:  # logical: or for SUM/MAX/BOR, and for PRODUCT/MIN/BAND
        name = {"SUM": "BOR", "MAX": "BOR", "PRODUCT": "BAND", "MIN": "BAND"}.get(name, name)
        stacked = stacked.astype(bool)
    return _NP_REDUCE[name](stacked)


class Checks:
    """The collectives of one (group, dtype, sync/async) pass; `pending` holds the async
    works and their checks until :meth:`finish`."""

    def __init__(self, group, members: list[int], dtype: torch.dtype, async_op: bool, seed: int):
        self.group, self.members, self.dtype, self.async_op = group, members, dtype, async_op
        self.n, self.me = len(members), members.index(RANK)
        self.seed = seed
        self.pending: list = []
        self.tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6

    def each(self, shape, salt: int, **kw) -> list[np.ndarray]:
        """Every member's input (by group rank) for this check."""
        return [values(self.seed + salt, r, shape, self.dtype, **kw) for r in self.members]

    def post(self, name: str, work, got=None, expect=None, tol: float = 0.0) -> None:
        """Check `got` (a tensor or a list) against `expect` once `work` is complete."""
        if self.async_op:
            assert work is not None, f"{name}: async call returned no Work"
            self.pending.append((name, work, got, expect, tol))
        else:
            assert work is None, f"{name}: blocking call returned {work!r}"
            self.check(name, got, expect, tol)

    def check(self, name: str, got, expect, tol: float) -> None:
        if got is None:
            return
        if isinstance(got, torch.Tensor):
            got, expect = [got], [expect]
        for g, e in zip(got, expect, strict=True):
            same(name, g, e, self.dtype, tol)

    def finish(self) -> None:
        for name, work, got, expect, tol in reversed(self.pending):
            assert work.wait(), name
            assert work.is_completed(), name
            self.check(name, got, expect, tol)
        self.pending = []

    def run(self) -> None:
        g, n, me, dt, a = self.group, self.n, self.me, self.dtype, self.async_op
        root = n - 1
        for i, opname in enumerate(reduce_ops(dt)):
            ins = self.each((5,), 10 + i, **({"low": 1, "high": 3} if opname == "PRODUCT" else {}))
            t = tensor(ins[me], dt)
            w = dist.all_reduce(t, op=getattr(ReduceOp, opname), group=g, async_op=a)
            self.post(f"all_reduce {opname}", w, t, reduced(opname, ins, dt),
                      self.tol if opname == "AVG" else 0.0)

        ins = self.each((3, 2), 20)
        t = tensor(ins[me], dt)
        self.post("broadcast", dist.broadcast(t, group_src=root, group=g, async_op=a), t,
                  ins[root])

        ins = self.each((4,), 21)
        t = tensor(ins[me], dt)
        self.post("reduce", dist.reduce(t, group_dst=root, group=g, async_op=a), t,
                  reduced("SUM", ins, dt) if me == root else ins[me])

        ins = self.each((4,), 38)  # another op and root: group rank 0
        t = tensor(ins[me], dt)
        self.post("reduce MAX", dist.reduce(t, group_dst=0, op=ReduceOp.MAX, group=g,
                                            async_op=a),
                  t, reduced("MAX", ins, dt) if me == 0 else ins[me])

        ins = self.each((2, 3), 22)
        outs = [torch.empty(2, 3, dtype=dt) for _ in range(n)]
        self.post("all_gather", dist.all_gather(outs, tensor(ins[me], dt), group=g, async_op=a),
                  outs, ins)

        ins = self.each((3,), 23)
        cat, stacked = torch.empty(3 * n, dtype=dt), torch.empty(n, 3, dtype=dt)
        self.post("all_gather_into_tensor", dist.all_gather_into_tensor(
            cat, tensor(ins[me], dt), group=g, async_op=a), cat, np.concatenate(ins))
        self.post("all_gather_into_tensor", dist.all_gather_into_tensor(
            stacked, tensor(ins[me], dt), group=g, async_op=a), stacked, np.stack(ins))

        full = self.each((n, 3), 24)
        out = torch.empty(3, dtype=dt)
        self.post("reduce_scatter", dist.reduce_scatter(
            out, [tensor(full[me][j], dt) for j in range(n)], group=g, async_op=a),
            out, reduced("SUM", full, dt)[me])

        for opname in ("SUM", "MAX"):
            full = self.each((n * 2,), 25)
            out = torch.empty(2, dtype=dt)
            self.post("reduce_scatter_tensor", dist.reduce_scatter_tensor(
                out, tensor(full[me], dt), op=getattr(ReduceOp, opname), group=g, async_op=a),
                out, reduced(opname, full, dt)[2 * me:2 * me + 2])

        def rows(i, j):  # rows group rank i sends to group rank j
            return (i + 2 * j) % 3
        send = [values(self.seed + 26, r, (sum(rows(i, j) for j in range(n)), 2), dt)
                for i, r in enumerate(self.members)]
        offsets = [np.cumsum([0] + [rows(i, j) for j in range(n)]) for i in range(n)]
        out = torch.empty(sum(rows(j, me) for j in range(n)), 2, dtype=dt)
        w = dist.all_to_all_single(out, tensor(send[me], dt),
                                   output_split_sizes=[rows(j, me) for j in range(n)],
                                   input_split_sizes=[rows(me, j) for j in range(n)],
                                   group=g, async_op=a)
        self.post("all_to_all_single", w, out, np.concatenate(
            [send[j][offsets[j][me]:offsets[j][me + 1]] for j in range(n)]))

        ins = [[values(self.seed + 27, r * 10 + j, (j + 1,), dt) for j in range(n)]
               for r in self.members]
        outs = [torch.empty(me + 1, dtype=dt) for _ in range(n)]
        self.post("all_to_all", dist.all_to_all(outs, [tensor(x, dt) for x in ins[me]], group=g,
                                                async_op=a),
                  outs, [ins[j][me] for j in range(n)])

        ins = self.each((3,), 28)
        outs = [torch.empty(3, dtype=dt) for _ in range(n)] if me == root else None
        self.post("gather", dist.gather(tensor(ins[me], dt), outs, group_dst=root, group=g,
                                        async_op=a), outs, ins)

        ins = self.each((2,), 39)
        outs = [torch.empty(2, dtype=dt) for _ in range(n)] if me == 0 else None
        self.post("gather to group rank 0", dist.gather(
            tensor(ins[me], dt), outs, group_dst=0, group=g, async_op=a), outs, ins)

        src = values(self.seed + 29, self.members[root], (n, 3), dt)
        out = torch.empty(3, dtype=dt)
        self.post("scatter", dist.scatter(
            out, [tensor(src[j], dt) for j in range(n)] if me == root else None,
            group_src=root, group=g, async_op=a), out, src[me])

        # all_gather_coalesced: a list of outputs per rank, one output per input
        ins = [self.each((k + 1,), 40 + k) for k in range(2)]
        outs = [[torch.empty(k + 1, dtype=dt) for k in range(2)] for _ in range(n)]
        w = dist.all_gather_coalesced(outs, [tensor(x[me], dt) for x in ins], group=g,
                                      async_op=a)
        self.post("all_gather_coalesced", FutureWork(w) if a else w,
                  [o for per in outs for o in per], [x[r] for r in range(n) for x in ins])

        # coalesced forms: what torch's _coalescing_manager sends as one call
        ins = [self.each((k + 1,), 30 + k) for k in range(3)]
        ts = [tensor(x[me], dt) for x in ins]
        with dist._coalescing_manager(group=g, async_ops=a) as cm:
            for t in ts:
                dist.all_reduce(t, group=g)
        self.post("allreduce_coalesced", CoalescedWork(cm) if a else None, ts,
                  [reduced("SUM", x, dt) for x in ins])
        outs = [torch.empty(n * (k + 1), dtype=dt) for k in range(3)]
        with dist._coalescing_manager(group=g, async_ops=a) as cm:
            for o, x in zip(outs, ins, strict=True):
                dist.all_gather_into_tensor(o, tensor(x[me], dt), group=g)
        self.post("all_gather_single_coalesced", CoalescedWork(cm) if a else None, outs,
                  [np.concatenate(x) for x in ins])
        fulls = [self.each((n * (k + 1),), 33 + k) for k in range(3)]
        outs = [torch.empty(k + 1, dtype=dt) for k in range(3)]
        with dist._coalescing_manager(group=g, async_ops=a) as cm:
            for o, f in zip(outs, fulls, strict=True):
                dist.reduce_scatter_tensor(o, tensor(f[me], dt), group=g)
        self.post("reduce_scatter_single_coalesced", CoalescedWork(cm) if a else None, outs,
                  [reduced("SUM", f, dt)[me * (k + 1):(me + 1) * (k + 1)]
                   for k, f in enumerate(fulls)])

        if n > 1:
            nxt, prv = (me + 1) % n, (me - 1) % n
            ins = self.each((4,), 36)
            got = torch.empty(4, dtype=dt)
            if a:
                wr = dist.irecv(got, group_src=prv, group=g, tag=5)
                ws = dist.isend(tensor(ins[me], dt), group_dst=nxt, group=g, tag=5)
                self.post("isend", ws)
                self.post("irecv", wr, got, ins[prv])
                ins2 = self.each((3,), 37)
                got2 = torch.empty(3, dtype=dt)
                works = dist.batch_isend_irecv([
                    dist.P2POp(dist.irecv, got2, group=g, group_peer=prv),
                    dist.P2POp(dist.isend, tensor(ins2[me], dt), group=g, group_peer=nxt)])
                self.post("batch_isend_irecv", works[1])
                self.post("batch_isend_irecv", works[0], got2, ins2[prv])
            else:
                if me % 2 == 0:
                    dist.send(tensor(ins[me], dt), group_dst=nxt, group=g)
                    dist.recv(got, group_src=prv, group=g)
                else:
                    dist.recv(got, group_src=prv, group=g)
                    dist.send(tensor(ins[me], dt), group_dst=nxt, group=g)
                same("send/recv", got, ins[prv], dt)
        self.post("barrier", dist.barrier(group=g, async_op=a))
        self.finish()


def object_and_functional(group, members: list[int]) -> None:
    """Object collectives (as DCP uses them) and functional collectives (as DTensor)."""
    n, me = len(members), members.index(RANK)
    g = group if group is not None else dist.group.WORLD
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": RANK, "pad": "x" * RANK}, group=g)
    assert objs == [{"rank": r, "pad": "x" * r} for r in members], objs
    box = [("from", RANK) if me == n - 1 else None]
    dist.broadcast_object_list(box, group_src=n - 1, group=g)
    assert box == [("from", members[-1])], box
    got = [None] * n if me == 0 else None
    dist.gather_object(RANK * 3, got, group_dst=0, group=g)
    assert me != 0 or got == [r * 3 for r in members], got
    out = [None]
    dist.scatter_object_list(out, [f"to {r}" for r in members] if me == 0 else None,
                             group_src=0, group=g)
    assert out == [f"to {RANK}"], out
    if n > 1:
        nxt, prv = (me + 1) % n, (me - 1) % n
        msg = [None]
        if me % 2 == 0:
            dist.send_object_list([f"hi from {RANK}"], group_dst=nxt, group=g)
            dist.recv_object_list(msg, group_src=prv, group=g)
        else:
            dist.recv_object_list(msg, group_src=prv, group=g)
            dist.send_object_list([f"hi from {RANK}"], group_dst=nxt, group=g)
        assert msg == [f"hi from {members[prv]}"], msg
    checked["object collectives"] = checked.get("object collectives", 0) + 1

    x = torch.arange(4, dtype=torch.float32) + RANK
    same("funcol.all_reduce", funcol.all_reduce(x, "sum", g).wait(),
         sum(np.arange(4) + r for r in members), torch.float32)
    same("funcol.all_gather_tensor", funcol.all_gather_tensor(x, 0, g).wait(),
         np.concatenate([np.arange(4) + r for r in members]), torch.float32)
    full = torch.arange(2 * n, dtype=torch.float32) * (RANK + 1)
    same("funcol.reduce_scatter_tensor", funcol.reduce_scatter_tensor(full, "sum", 0, g).wait(),
         (np.arange(2 * n) * sum(r + 1 for r in members))[2 * me:2 * me + 2], torch.float32)
    rows = torch.full((n, 2), float(RANK))
    same("funcol.all_to_all_single", funcol.all_to_all_single(rows, None, None, g).wait(),
         np.repeat(np.array(members, dtype=float)[:, None], 2, 1), torch.float32)
    same("funcol.broadcast", funcol.broadcast(x, n - 1, g).wait(),  # src: a group rank
         np.arange(4) + members[-1], torch.float32)


def check_groups(dtypes, seed: int) -> None:
    """Each dtype blocking on one group and async on the other (alternating), so that
    every dtype and every group runs both ways."""
    for k, dt in enumerate(dtypes):
        for i, (g, members) in enumerate(GROUPS):
            if RANK in members:
                Checks(g, members, dt, (i + k) % 2 == 1, seed + 1000 * k).run()


def logged_backends() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for row in mcrdl.log_summary(quiet=True):
        out.setdefault(row["op"], set()).add(row["backend"])
    return out


def mixed_dtypes_coalesced() -> None:
    """A coalesced all-reduce of several dtypes: one packed all_reduce per dtype (torch's
    public all_reduce_coalesced refuses mixed dtypes; _coalescing_manager passes them)."""
    ts = [torch.full((3,), float(RANK + 1)), torch.full((2,), RANK + 1, dtype=torch.int64),
          torch.full((1,), 2.0 * RANK), torch.full((2,), RANK % 2 == 1)]
    with dist._coalescing_manager():
        for t in ts:
            dist.all_reduce(t)
    total = SIZE * (SIZE + 1) // 2
    for got, want, dt in ((ts[0], np.full(3, total), torch.float32),
                          (ts[1], np.full(2, total), torch.int64),
                          (ts[2], np.full(1, SIZE * (SIZE - 1)), torch.float32),
                          (ts[3], np.full(2, SIZE > 1), torch.bool)):
        same("allreduce_coalesced mixed dtypes", got, want, dt)


# -- the collectives, world and sub-group, "auto" routes --------------------------------
SUB = list(range(1, SIZE)) if SIZE > 2 else [SIZE - 1]
GROUPS = [(None, list(range(SIZE))), (dist.new_group(SUB), SUB)]
check_groups(DTYPES, 1)
mixed_dtypes_coalesced()
for g, members in GROUPS:
    if RANK in members:
        object_and_functional(g, members)
initialized = mcrdl.get_backends()
assert all(b <= set(initialized) for b in logged_backends().values()), logged_backends()
pair = 2 if SIZE % 2 == 0 else 1  # new_subgroups: consecutive ranks, a group each
mine, _ = dist.new_subgroups(group_size=pair)
t = torch.full((3,), float(RANK))
dist.all_reduce(t, group=mine)
same("new_subgroups", t, np.full(3, sum(range(RANK - RANK % pair, RANK - RANK % pair + pair))),
     torch.float32)

# -- per-operation routing: process-wide, and a group's own ------------------------------
mcrdl.reset_log()
other = "gloo" if "mpi" in initialized else initialized[0]
mcrdl.set_torch_routes(f"*={other}")
check_groups((torch.float32, torch.int64), 2)
assert all(b == {other} for b in logged_backends().values()), logged_backends()
mcrdl.set_torch_routes(None)
pinned = dist.new_group(list(range(SIZE)), pg_options=mcrdl.TorchBackendOptions(
    routes=f"allreduce={other},alltoall={other}"))
assert pinned.routes["allreduce"] == other and pinned.routes["broadcast"] == "auto"
mcrdl.reset_log()
t = torch.ones(3)
dist.all_reduce(t, group=pinned)
out = torch.empty(SIZE)
dist.all_to_all_single(out, torch.ones(SIZE), group=pinned)
assert logged_backends() == {"all_reduce": {other}, "all_to_all_single": {other}}, \
    logged_backends()
# the hook as torch after 2.13 calls it, with new_group's backend: mcrdl's `other` then
# carries every op of the group
named = dist.distributed_c10d._get_default_group().new_group(
    SUB, group_name="9000", group_desc="backend kwarg", backend=other)
assert (named is None) == (RANK not in SUB), named
if named is not None:
    assert set(named.routes.values()) == {other}, named.routes
    mcrdl.reset_log()
    t = torch.full((2,), float(RANK))
    named.allreduce([t]).wait()
    same("backend kwarg group", t, np.full(2, float(sum(SUB))), torch.float32)
    assert logged_backends() == {"all_reduce": {other}}, logged_backends()
try:  # a backend mcrdl cannot pin: every rank raises, before the (collective) group
    dist.distributed_c10d._get_default_group().new_group(SUB, group_name="9001",
                                                         backend="ucc")
    raise AssertionError("new_group(backend='ucc') was not refused")
except mcrdl.InvalidArgumentError as exc:
    assert "backend='ucc'" in str(exc) and "pass one of" in str(exc), exc
# torch before 2.13 has no hook and calls the creator on the members only: refused, with
# the torch version to use, before anything is sent
if SIZE > 1:
    opts = dist.distributed_c10d._DistributedBackendOptions()
    opts.global_ranks_in_group, opts.group_rank, opts.group_size = SUB, 0, len(SUB)
    try:
        mcrdl.torch_backend.create(mcrdl.api, opts, None)
        raise AssertionError("a sub-group through the creator was not refused")
    except mcrdl.InvalidArgumentError as exc:
        assert "need torch >= 2.13" in str(exc) and torch.__version__ in str(exc), exc

# -- bad input: raised by the rank that passed it, before anything is sent ---------------
bad = SIZE - 1
if RANK == bad:
    refused = [
        ("wrong output size", lambda: dist.all_gather_into_tensor(
            torch.empty(SIZE * 3 + 1), torch.ones(3)), ValueError),
        ("dtype no mcrdl backend moves", lambda: dist.all_reduce(
            torch.ones(3, dtype=torch.int16)), ValueError),
        ("reduce op the dtype has not", lambda: dist.all_reduce(
            torch.ones(3, dtype=torch.int32), op=ReduceOp.AVG), ValueError),
        ("non-contiguous tensor", lambda: dist.broadcast(
            torch.ones(4, 4).t(), 0), ValueError),
        ("receive from any source", lambda: dist.recv(torch.ones(2)), RuntimeError),
        # a sparse all_reduce sums (as Gloo's), with SUM only
        ("sparse tensor, MAX", lambda: dist.all_reduce(torch.sparse_coo_tensor(
            [[0]], [1.0], (3,)), op=ReduceOp.MAX), ValueError, "ReduceOp.SUM only"),
        ("sparse tensor, broadcast", lambda: dist.broadcast(torch.sparse_coo_tensor(
            [[0]], [1.0], (3,)), 0), ValueError, "non-strided (e.g. sparse) layout"),
        # each tensor checked before the pack, which would take either
        ("sparse tensor, coalesced", lambda: dist.all_reduce_coalesced(
            [torch.ones(2), torch.sparse_coo_tensor([[0]], [1.0], (3,))]), ValueError),
        ("non-contiguous tensor, coalesced", lambda: dist.all_reduce_coalesced(
            [torch.ones(2), torch.ones(4, 4).t()]), ValueError),
        ("group of the members only", lambda: dist.new_group(
            [RANK], use_local_synchronization=True), ValueError,
         "use_local_synchronization=True"),
    ]
    if SIZE > 1:  # (to itself, the send would be refused for that first)
        refused.append(("tag above MPI's guaranteed bound", lambda: dist.isend(
            torch.ones(2), dst=(RANK + 1) % SIZE, tag=40000), ValueError, "[0, 32767]"))
    for what, call, kind, *says in refused:
        try:
            call()
        except kind as exc:
            assert isinstance(exc, RuntimeError) and "mcrdl" in str(exc), (what, exc)
            assert all(s in str(exc) for s in says), (what, exc)
            checked["bad input"] = checked.get("bad input", 0) + 1
        else:
            raise AssertionError(f"rank {RANK}: {what}: nothing raised")
    if "pccl" in initialized:
        mcrdl.set_torch_routes("alltoall=pccl")
        try:
            dist.all_to_all_single(torch.empty(SIZE), torch.ones(SIZE))
        except mcrdl.UnsupportedOperationError as exc:
            assert "pccl" in str(exc) and "mpi" in str(exc) and "gloo" in str(exc), exc
            checked["unsupported op"] = 1
        else:
            raise AssertionError(f"rank {RANK}: all_to_all_single routed to pccl (which has "
                                 "no all_to_all) raised no UnsupportedOperationError")
        mcrdl.set_torch_routes(None)
# nothing was sent by the bad calls: the next collective matches on every rank
t = torch.full((2,), float(RANK))
dist.all_reduce(t)
same("after bad input", t, np.full(2, sum(range(SIZE))), torch.float32)
if RANK not in SUB:  # a non-member's call: torch warns and returns, nothing is sent
    assert dist.all_reduce(torch.ones(1), group=GROUPS[1][0]) is None
    checked["non-member call"] = 1

# -- mixing: torch.distributed ops on mpi, mcrdl.all_gather on gloo, in flight together --
if {"mpi", "gloo"} <= set(initialized) and SIZE > 1:
    mcrdl.set_torch_routes("*=mpi")
    mine_rng = np.random.default_rng([7, RANK])  # rank-dependent interleaving and waits
    for rnd in range(20):
        # the same calls on every rank, in the same order per backend (the MPI rule) ...
        shared = np.random.default_rng([rnd])
        queues: dict[str, list] = {"dist": [], "mcrdl": []}
        for i in range(12):
            queues["dist" if shared.integers(2) else "mcrdl"].append(
                (i, int(shared.integers(1, 300))))
        posted = []
        while queues["dist"] or queues["mcrdl"]:  # ... merged in a rank-dependent order
            live = [k for k in queues if queues[k]]
            kind = live[int(mine_rng.integers(len(live)))]
            i, n = queues[kind].pop(0)
            if kind == "dist":
                t = torch.full((n,), float(RANK + i))
                posted.append((kind, dist.all_reduce(t, async_op=True), t,
                               np.full(n, sum(r + i for r in range(SIZE)))))
            else:
                out, mine = torch.empty(n * SIZE), torch.full((n,), float(RANK * i))
                posted.append((kind, mcrdl.all_gather("gloo", out, mine, async_op=True), out,
                               np.repeat([float(r * i) for r in range(SIZE)], n)))
        for k in mine_rng.permutation(len(posted)):
            assert posted[k][1].wait()
        for kind, _, got, expect in posted:
            same(f"mixing {kind}", got, expect, torch.float32)
        checked["mixing"] = checked.get("mixing", 0) + 1
    mcrdl.set_torch_routes(None)

dist.barrier()
dist.destroy_process_group()
# the blocks that ran, for the launcher to check: some run only where a backend exists
print(f"rank {RANK}: torch backend collectives OK ({SIZE} ranks, backends "
      f"{','.join(initialized)}, {sum(checked.values())} checks, blocks "
      f"{','.join(sorted(checked))})", flush=True)
