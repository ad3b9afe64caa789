"""Backends over torch.distributed (c10d) process groups: Gloo, NCCL, RCCL.

mcrdl creates its own process groups (it never touches torch.distributed's default
group), one per mcrdl group, on the TCP store set up by the bootstrap (under mpiexec
rank 0 opens it on a free port and broadcasts the address over MPI; under torchrun the
env:// variables are used). c10d runs every op asynchronously in issue order, which is
these backends' lane: Gloo on its own threads; NCCL/RCCL async ops on their own CUDA
streams, ordered against the caller's current stream by events, where ``Work.wait()``
makes the caller's current stream wait (no host synchronisation), and blocking calls on
the caller's current stream itself (c10d's ``asyncOp=False``, as torch.distributed's own
blocking calls: the same order, without the events).

Operations a library lacks are built on what it has: the v variants and the list form
of all_to_all on ``alltoall_base`` with packing/unpacking; AVG as SUM then a division
(enqueued after the wait, so on GPUs it runs on the caller's stream); bool reductions
on uint8 0/1. Subclasses say how to build a process group and which devices they take.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import threading

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # not in dist's namespace

from .. import _C
from ..errors import BackendUnavailableError, CommTimeoutError, MCRDLError
from ..groups import Group, bad_group_error
from ..ops import ReduceOp, reduce_plan
from ..work import ChainedWork, ThreadedWait, poll_until, wait_timeout
from .base import Backend, InitContext

_TORCH_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}
# bool reduces as uint8 0/1 (ops.reduce_plan): or and and as MAX and MIN, which every
# library has (NCCL has no bitwise operators).
_BOOL_OP = {ReduceOp.BOR: dist.ReduceOp.MAX, ReduceOp.BAND: dist.ReduceOp.MIN,
            ReduceOp.BXOR: dist.ReduceOp.BXOR}


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a contiguous tensor (shares memory): the tensor itself when it is
    1-D already (a view costs ~0.4 us a call, a third of a small call's Python)."""
    return t if t.dim() == 1 else t.view(-1)


def _root_buffers(buffers, root: int, g, n: int) -> list[list[torch.Tensor]]:
    """c10d's list argument of gather (the outputs) and scatter (the inputs): on the root,
    its one buffer per rank, as `g.size` blocks of `n` elements of one tensor or as the
    tensors of a list (flat, detached views); empty on the other ranks."""
    if root != g.rank:
        return []
    if isinstance(buffers, torch.Tensor):
        flat = _flat(buffers)
        return [[flat.narrow(0, i * n, n) for i in range(g.size)]]
    return [[_flat(b.detach()) for b in buffers]]


class LibraryWait:
    """The step of a ChainedWork that waits for one call's c10d works and turns the
    library's errors into mcrdl's (a timeout marks the backend failed).

    ``wait_only``: the works complete only through a plain ``wait()`` (Gloo's send and
    recv). A timed wait or a poll then hands that wait to a :class:`ThreadedWait`, so
    that the caller's timeout leaves the op pending and the process group usable; every
    later wait goes through it too."""

    __slots__ = ("_works", "_done", "_owner", "op", "group", "seq", "_timeout",
                 "_wait_only", "_waiter")

    def __init__(self, works, op, group, seq, timeout, owner, wait_only=False):
        self._owner = owner
        self._works = works
        self._done = False
        self.op = op
        self.group = group
        self.seq = seq
        self._timeout = timeout
        self._wait_only = wait_only
        self._waiter: ThreadedWait | None = None

    def _raise(self, exc: Exception, timeout: float):
        """The library's error of a posted op as mcrdl's; either way the backend refuses
        new ops after it: the op may have completed on some ranks of the group and not
        on others, and Gloo closes a pair's connection when an op on it fails. So a rank
        whose peer's own timeout fired first sees its op fail with the connection closed
        by that peer (an MCRDLError saying so), not a timeout of its own."""
        text = str(exc)
        what = (f"{self.op} on backend '{self._owner.name}' (group {self.group}, "
                f"sequence number {self.seq})")
        if "imed out" in text or "timeout" in text.lower():
            msg = (f"{what} did not complete within {timeout} s; a rank of the group may never "
                   f"have called it, may be stuck, or may have died. The library said: "
                   f"{text.strip()}")
            self._owner.failed = msg
            raise CommTimeoutError(msg) from None
        msg = f"{what} failed: {text.strip()}"
        if "closed by peer" in text or "reset by peer" in text:
            msg += (" (a peer gave up on this op, e.g. its own timeout fired first, or "
                    "ended)")
        self._owner.failed = msg
        raise MCRDLError(msg) from None

    def _still_pending(self, limit: float) -> CommTimeoutError:
        return CommTimeoutError(
            f"{self.op} on backend '{self._owner.name}' (group {self.group}, sequence number "
            f"{self.seq}) did not complete within {limit:g} s (the wait's timeout; the op's own "
            f"is {self._timeout:g} s): it is still in flight, and a later wait may complete it")

    def _start_waiter(self) -> ThreadedWait:
        with _WAITER_LOCK:
            if self._waiter is None:
                self._waiter = ThreadedWait(self._works, f"mcrdl-{self._owner.name}-{self.op}")
        return self._waiter

    def wait(self, timeout: float | None = None) -> bool:
        timeout = wait_timeout(timeout)
        if self._done:
            return True
        limit = self._timeout if timeout is None else timeout
        try:
            if self._wait_only and (timeout is not None or self._waiter is not None):
                waiter = self._start_waiter()
                # timeout=None: the thread's plain wait ends by the library's own timeout
                if not waiter.done.wait(None if timeout is None else limit):
                    raise self._still_pending(limit)
                if waiter.error is not None:
                    raise waiter.error
            else:
                if timeout is not None and not poll_until(
                        lambda: all(w.is_completed() for w in self._works), limit):
                    raise self._still_pending(limit)
                for w in self._works:
                    w.wait()
        except CommTimeoutError:
            raise
        except RuntimeError as exc:
            self._raise(exc, limit)
        self._done = True
        self._works = ()
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._wait_only:
            done = self._start_waiter().done.is_set()
        else:
            done = all(w.is_completed() for w in self._works)
        if not done:
            return False
        with contextlib.suppress(MCRDLError):  # failed: True, and wait() raises the error
            self.wait()
        return True

    def settled(self) -> bool:
        """Whether it is known complete (completing it then), without starting a waiter
        thread for a wait-only work nobody polled: for pruning the in-flight list."""
        if self._wait_only and self._waiter is None and not self._done:
            return False
        return self.is_completed()


_WAITER_LOCK = threading.Lock()


class _Rule:
    """How a c10d backend reduces one (dtype, op) (ops.reduce_plan): the dtype reduced,
    c10d's op, whether to divide by the group size after, and the options objects of
    the calls that use it."""

    __slots__ = ("dtype", "top", "average", "options")

    def __init__(self, dtype: torch.dtype, top, average: bool):
        self.dtype, self.top, self.average = dtype, top, average
        self.options: dict[tuple, object] = {}


class _PG:
    """One c10d process group plus mcrdl's bookkeeping for a group."""

    __slots__ = ("pg", "rank", "size", "name", "seq")

    def __init__(self, pg, rank: int, size: int, name: str):
        self.pg = pg
        self.rank = rank
        self.size = size
        self.name = name
        self.seq = itertools.count(1)


class C10dBackend(Backend):
    """Base of the backends over c10d process groups; see the module docstring."""

    validates_arguments = True
    #: whether the library has a reduce_scatter for every dtype (else: all_reduce + slice)
    native_reduce_scatter = False
    #: whether the library has ReduceOp.AVG for floating types (else: SUM, then divide)
    native_avg = False
    #: whether send/recv works complete only through a plain wait() (see LibraryWait)
    p2p_wait_only = False

    def __init__(self, ctx: InitContext):
        super().__init__(ctx)
        self._store = ctx.bootstrap.store()
        self._groups: dict[int, _PG] = {}
        #: why the backend is unusable (an op timed out), or None
        self.failed: str | None = None
        self._inflight: list[tuple[ChainedWork, LibraryWait]] = []
        # Per-call constants, made once: the reduction rule of each (dtype, op) and the
        # c10d options objects, which the library reads during the call and never keeps
        # (0.7-0.9 us a call each when built anew).
        self._rules: dict[tuple[torch.dtype, ReduceOp], _Rule] = {}
        self._options: dict[tuple, object] = {}
        self._world = self._make(ctx.world)

    def _new_pg(self, store, rank: int, size: int):
        """A process group of this library for one group (collective over its members)."""
        raise NotImplementedError

    def _check_device(self, op: str, t: torch.Tensor) -> None:
        """Raise BackendUnavailableError for a tensor this backend cannot use."""
        raise NotImplementedError

    def _barrier_options(self, async_op: bool):
        return self._opts(dist.BarrierOptions, async_op)

    def _make(self, group: Group) -> _PG:
        store = dist.PrefixStore(f"{self.name}/{group.id}", self._store)
        g = _PG(self._new_pg(store, group.rank, group.size), group.rank, group.size,
                group.describe())
        self._groups[group.id] = g
        return g

    def add_group(self, group: Group) -> None:
        if group.is_member:
            self._make(group)

    def _group(self, group: Group | None) -> _PG:
        if self.failed is not None:
            raise BackendUnavailableError(
                f"backend '{self.name}' is unusable since an earlier operation timed out (ranks no "
                f"longer issue matching operations); finalize and restart the job. Earlier: "
                f"{self.failed}")
        if group is None:
            return self._world
        try:
            return self._groups[group.id]
        except (KeyError, AttributeError):
            raise bad_group_error(group) from None

    def set_timeout(self, timeout: float) -> None:
        super().set_timeout(timeout)
        for g in self._groups.values():
            g.pg._set_default_timeout(datetime.timedelta(seconds=timeout))

    def mark_failed(self, why: str) -> None:
        self.failed = self.failed or why

    def synchronize(self, timeout: float) -> None:
        pending, self._inflight = self._inflight, []
        for w, _ in pending:
            w.wait(timeout)

    def finalize(self) -> None:
        for g in self._groups.values():
            try:
                g.pg.shutdown()
            except (RuntimeError, AttributeError):
                pass
        self._groups.clear()
        self._inflight.clear()

    # -- helpers -------------------------------------------------------------------
    def _run(self, g: _PG, op: str, works, finish, async_op, wait_only=False):
        seq = next(g.seq)
        if not async_op:
            # A blocking call waits right here, as a LibraryWait step of a ChainedWork
            # would under the default timeout (a plain wait of each work; the library's
            # errors turned into mcrdl's), without making either object: on NCCL their
            # creation and dispatch were 1-3 us of mcrdl's 3-7 us a call over c10d's own.
            # A library may return no work for a blocking call (asyncOp False), having
            # ordered it itself: NCCL's, which ran it on the caller's stream.
            try:
                for work in works:
                    if work is not None:
                        work.wait()
            except RuntimeError as exc:
                LibraryWait([w for w in works if w is not None], op, g.name, seq,
                            self.ctx.timeout, self)._raise(exc, self.ctx.timeout)
            if finish is not None:
                with torch.no_grad():
                    finish()
            return None
        step = LibraryWait(works, op, g.name, seq, self.ctx.timeout, self, wait_only)
        w = ChainedWork([step], finish, self.name)
        if len(self._inflight) >= 64:  # amortized: drop the ones already complete
            self._inflight = [x for x in self._inflight if not x[1].settled()]
        self._inflight.append((w, step))
        return w

    def _reduce_args(self, t: torch.Tensor, op: ReduceOp) -> tuple[torch.Tensor, _Rule]:
        """(buffer to reduce, its _Rule) by the shared rule of ops.reduce_plan (the
        libraries reduce 16-bit floats); the rule is made once per (dtype, op)."""
        rule = self._rules.get((t.dtype, op))
        if rule is None:
            plan = reduce_plan(t.dtype, op, native_avg=self.native_avg, native_half=True)
            rule = self._rules[t.dtype, op] = _Rule(
                plan.dtype, (_BOOL_OP if t.dtype == torch.bool else _TORCH_OP)[plan.op],
                plan.average)
        if rule.dtype == t.dtype:
            return t, rule
        return (t.view(rule.dtype) if t.dtype == torch.bool else t.to(rule.dtype)), rule

    def _opts(self, cls, async_op: bool, rule: _Rule | None = None, root: int | None = None,
              **fields):
        """A c10d options object of class `cls`: the call's ``asyncOp``, ``reduceOp`` of
        `rule`, ``rootRank`` `root` and `fields`; made once per value and kept (in the
        rule for reductions: no hashing of c10d's op enum, 0.15 us), since the library
        copies what it needs during the call. ``asyncOp`` is set as torch.distributed's
        own functions set it: NCCL runs a blocking call (asyncOp False) on the caller's
        current stream, without the event, stream wait and tensor stashing of its side
        stream."""
        cache = self._options if rule is None else rule.options
        key = (cls, async_op, root, *fields.items()) if fields else (cls, async_op, root)
        opts = cache.get(key)
        if opts is None:
            opts = cls()
            if hasattr(opts, "asyncOp"):  # torch versions differ in which classes have it
                opts.asyncOp = async_op
            if rule is not None:
                opts.reduceOp = rule.top
            if root is not None:
                opts.rootRank = root
            for name, value in fields.items():
                setattr(opts, name, value)
            cache[key] = opts
        return opts

    def _alltoall(self, g, out, inp, out_splits, in_splits, async_op):
        return g.pg.alltoall_base(out, inp, out_splits, in_splits,
                                  self._opts(dist.AllToAllOptions, async_op))

    # -- operations ----------------------------------------------------------------
    def all_reduce(self, tensor, op, group, async_op):
        g = self._group(group)
        _C.validate("all_reduce", tensor, op, g.rank, g.size)
        self._check_device("all_reduce", tensor)
        buf, rule = self._reduce_args(tensor, op)
        work = g.pg.allreduce([buf], self._opts(dist.AllreduceOptions, async_op, rule))
        finish = (lambda: tensor.copy_(buf.div_(g.size))) if rule.average else None
        return self._run(g, "all_reduce", [work], finish, async_op)

    def reduce(self, tensor, dst, op, group, async_op):
        g = self._group(group)
        _C.validate("reduce", tensor, dst, op, g.rank, g.size)
        self._check_device("reduce", tensor)
        root = dst == g.rank
        target = tensor if root else tensor.clone()  # others' tensor stays unchanged
        buf, rule = self._reduce_args(target, op)
        work = g.pg.reduce([buf], self._opts(dist.ReduceOptions, async_op, rule, dst))
        finish = (lambda: tensor.copy_(buf.div_(g.size))) if (root and rule.average) else None
        return self._run(g, "reduce", [work], finish, async_op)

    def bcast(self, tensor, src, group, async_op):
        g = self._group(group)
        _C.validate("bcast", tensor, src, g.rank, g.size)
        self._check_device("bcast", tensor)
        work = g.pg.broadcast([tensor], self._opts(dist.BroadcastOptions, async_op, root=src))
        return self._run(g, "bcast", [work], None, async_op)

    def all_gather(self, output, input, group, async_op):
        g = self._group(group)
        _C.validate("all_gather", output, input, g.rank, g.size)
        self._check_device("all_gather", input)
        inp = input.clone() if _overlaps(input, output) else input
        opts = self._opts(AllgatherOptions, async_op)
        if isinstance(output, torch.Tensor):
            work = g.pg._allgather_base(_flat(output), _flat(inp), opts)
        else:
            work = g.pg.allgather([[_flat(o.detach()) for o in output]], [_flat(inp)], opts)
        return self._run(g, "all_gather", [work], None, async_op)

    def gather(self, output, input, dst, group, async_op):
        g = self._group(group)
        _C.validate("gather", output, input, dst, g.rank, g.size)
        self._check_device("gather", input)
        inp = _flat(input)
        if dst == g.rank and _overlaps(input, output):
            inp = inp.clone()
        work = g.pg.gather(_root_buffers(output, dst, g, inp.numel()), [inp],
                           self._opts(dist.GatherOptions, async_op, root=dst))
        return self._run(g, "gather", [work], None, async_op)

    def scatter(self, output, input, src, group, async_op):
        g = self._group(group)
        _C.validate("scatter", output, input, src, g.rank, g.size)
        self._check_device("scatter", output)
        out = _flat(output)
        ins = _root_buffers(input, src, g, out.numel())
        if ins and _overlaps(output, input):
            ins = [[i.clone() for i in ins[0]]]
        work = g.pg.scatter([out], ins, self._opts(dist.ScatterOptions, async_op, root=src))
        return self._run(g, "scatter", [work], None, async_op)

    def reduce_scatter(self, output, input, op, group, async_op):
        g = self._group(group)
        _C.validate("reduce_scatter", output, input, op, g.rank, g.size)
        self._check_device("reduce_scatter", output)
        if self.native_reduce_scatter:
            return self._reduce_scatter_native(g, output, input, op, async_op)
        # Gloo's reduce_scatter lacks several dtypes: reduce the whole input (a copy)
        # with allreduce, then keep this rank's block.
        flat = input.reshape(-1).clone() if isinstance(input, torch.Tensor) else torch.cat(
            [i.reshape(-1) for i in input])
        buf, rule = self._reduce_args(flat, op)
        work = g.pg.allreduce([buf], self._opts(dist.AllreduceOptions, async_op, rule))
        n = output.numel()

        def finish():
            block = buf.narrow(0, g.rank * n, n)
            if rule.average:
                block = block / g.size
            output.view(-1).copy_(block)

        return self._run(g, "reduce_scatter", [work], finish, async_op)

    def _reduce_scatter_native(self, g, output, input, op, async_op):
        send = _flat(input) if isinstance(input, torch.Tensor) else torch.cat(
            [_flat(i) for i in input])
        out, rule = self._reduce_args(_flat(output), op)
        send = send.view(torch.uint8) if send.dtype == torch.bool else send.to(out.dtype)
        opts = self._opts(dist.ReduceScatterOptions, async_op, rule)
        work = g.pg._reduce_scatter_base(out, send, opts)
        finish = (lambda: output.view(-1).copy_(out.div_(g.size))) if rule.average else None
        return self._run(g, "reduce_scatter", [work], finish, async_op)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, group,
                          async_op):
        g = self._group(group)
        out_splits, in_splits = _C.validate("all_to_all_single", output, input,
                                            output_split_sizes, input_split_sizes, g.rank,
                                            g.size)
        self._check_device("all_to_all_single", input)
        inp = input.clone() if _overlaps(input, output) else input
        work = g.pg.alltoall_base(output, inp, out_splits, in_splits,
                                  self._opts(dist.AllToAllOptions, async_op))
        return self._run(g, "all_to_all_single", [work], None, async_op)

    def all_to_all(self, output_list, input_list, group, async_op):
        g = self._group(group)
        _C.validate("all_to_all", output_list, input_list, g.rank, g.size)
        self._check_device("all_to_all", input_list[0])
        send = torch.cat([_flat(t) for t in input_list])
        rsizes = [t.numel() for t in output_list]
        recv = send.new_empty(sum(rsizes))
        work = self._alltoall(g, recv, send, rsizes, [t.numel() for t in input_list], async_op)
        return self._run(g, "all_to_all", [work], lambda: _unpack(recv, output_list),
                         async_op)

    def gatherv(self, output, input, counts, displs, dst, group, async_op):
        g = self._group(group)
        (displs,) = _C.validate("gatherv", output, input, counts, displs, dst, g.rank, g.size)
        self._check_device("gatherv", input)
        send_splits = [0] * g.size
        send_splits[dst] = input.numel()
        root = dst == g.rank
        recv_splits = list(counts) if root else [0] * g.size
        recv = input.new_empty(sum(recv_splits))
        work = self._alltoall(g, recv, _flat(input), recv_splits, send_splits, async_op)
        finish = (lambda: _place(recv, output, counts, displs)) if root else None
        return self._run(g, "gatherv", [work], finish, async_op)

    def scatterv(self, output, input, counts, displs, src, group, async_op):
        g = self._group(group)
        (displs,) = _C.validate("scatterv", output, input, counts, displs, src, g.rank, g.size)
        self._check_device("scatterv", output)
        root = src == g.rank
        send = _take(input, counts, displs) if root else output.new_empty(0).view(-1)
        send_splits = list(counts) if root else [0] * g.size
        recv_splits = [0] * g.size
        recv_splits[src] = output.numel()
        work = self._alltoall(g, _flat(output), send, recv_splits, send_splits, async_op)
        return self._run(g, "scatterv", [work], None, async_op)

    def all_gatherv(self, output, input, counts, displs, group, async_op):
        g = self._group(group)
        (displs,) = _C.validate("all_gatherv", output, input, counts, displs, g.rank, g.size)
        self._check_device("all_gatherv", input)
        send = _flat(input).repeat(g.size)
        recv = input.new_empty(sum(counts))
        work = self._alltoall(g, recv, send, list(counts), [input.numel()] * g.size, async_op)
        return self._run(g, "all_gatherv", [work],
                         lambda: _place(recv, output, counts, displs), async_op)

    def all_to_allv(self, output, input, send_counts, recv_counts, send_displs, recv_displs,
                    group, async_op):
        g = self._group(group)
        sd, rd = _C.validate("all_to_allv", output, input, send_counts, recv_counts,
                             send_displs, recv_displs, g.rank, g.size)
        self._check_device("all_to_allv", input)
        send = _take(input, send_counts, sd)
        recv = input.new_empty(sum(recv_counts))
        work = self._alltoall(g, recv, send, list(recv_counts), list(send_counts), async_op)
        return self._run(g, "all_to_allv", [work],
                         lambda: _place(recv, output, recv_counts, rd), async_op)

    def send(self, tensor, dst, tag, group, async_op):
        g = self._group(group)
        _C.validate("send", tensor, dst, tag, g.rank, g.size)
        self._check_device("send", tensor)
        work = g.pg.send([tensor], dst, tag)
        return self._run(g, "send", [work], None, async_op, self.p2p_wait_only)

    def recv(self, tensor, src, tag, group, async_op):
        g = self._group(group)
        _C.validate("recv", tensor, src, tag, g.rank, g.size)
        self._check_device("recv", tensor)
        work = g.pg.recv([tensor], src, tag)
        return self._run(g, "recv", [work], None, async_op, self.p2p_wait_only)

    def barrier(self, group, async_op):
        g = self._group(group)
        work = g.pg.barrier(self._barrier_options(async_op))
        return self._run(g, "barrier", [work], None, async_op)


def _overlaps(a: torch.Tensor, b) -> bool:
    if not isinstance(b, torch.Tensor):
        return False
    an, bn = a.nbytes, b.nbytes
    if not an or not bn:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + bn and b0 < a0 + an


def _take(t: torch.Tensor, counts, displs) -> torch.Tensor:
    """Pack blocks (counts/displs in elements) of flat tensor `t` into one tensor."""
    flat = _flat(t)
    parts = [flat.narrow(0, d, c) for c, d in zip(counts, displs, strict=True)]
    return torch.cat(parts) if parts else flat.new_empty(0)


def _place(recv: torch.Tensor, out: torch.Tensor, counts, displs) -> None:
    """Unpack consecutive blocks of `recv` to elements displs[i].. of `out`."""
    flat = _flat(out)
    off = 0
    for c, d in zip(counts, displs, strict=True):
        if c:
            flat.narrow(0, d, c).copy_(recv.narrow(0, off, c))
        off += c


def _unpack(recv: torch.Tensor, outs) -> None:
    off = 0
    for t in outs:
        _flat(t).copy_(recv.narrow(0, off, t.numel()))
        off += t.numel()
