"""Tensor fusion: small calls of one (backend, group) combined into one buffer.

Calls of all_reduce, all_gather, bcast and reduce_scatter on CPU tensors smaller than
B bytes are buffered per (backend, group) in issue order; a *flush* posts the buffered
calls as few backend calls as it can: one per fusion key (operation, dtype, reduce op
or root) and B bytes; each caller's Work completes when its slice was copied back into
its own tensors.

Identical issue order on every rank
-----------------------------------
A flush is triggered by B bytes buffered, by a call older than T, by a wait on a
buffered call, by a call on the same (backend, group) that cannot be fused, by a
blocking call, or by synchronize/finalize. Only the first two and the unfusable call
are functions of the call sequence; a timer fires, and a rank waits, at different
points of the sequence on different ranks, so two ranks could flush different sets of
calls and post collectives that do not match. Every flush is therefore one *round*
whose first step is an agreement: each rank proposes how many of its oldest buffered
calls to flush (those before the next unfusable call) and an all_reduce(MIN) of that
count, on the same backend and group, decides. Rounds are posted in issue order on the
(backend, group) like every other call, a rank only starts one when it has buffered
calls, and the ranks' buffers hold the same calls in the same order (the MPI ordering
rule), so round k flushes the same calls on every rank; they are cut into fused calls
of at most B bytes by their sizes alone, so the fused collectives match too. A rank
that proposed more keeps the rest for the next round; a rank that is ahead waits in the
agreement until the others reach it (their timers guarantee they do). Unfusable calls
are posted only after every earlier buffered call was flushed. Rounds run on the
stream's worker thread, or on the caller's thread when it is about to block anyway, so
an async call never blocks on other ranks.

Inputs are read when the round posts (as a backend reads them when it runs the op): do
not change a tensor before its Work completes, and do not pass one tensor to two
outstanding fused calls. The data reaches your tensors when the Work is waited or
polled, or at synchronize.
"""

from __future__ import annotations

import threading
import time

import torch

from .. import _C
from ..errors import DesyncError
from ..ops import ReduceOp
from ..work import Work
from .config import FusionConfig
from .stream import ExtContext, OrderedStream, StreamedBackend, Task

_totals_lock = threading.Lock()
_totals = {"flushes": 0, "short_flushes": 0, "calls": 0}


def _tally(agreed: int, proposal: int) -> None:
    with _totals_lock:
        _totals["flushes"] += 1
        _totals["short_flushes"] += agreed < proposal
        _totals["calls"] += agreed


def fusion_stats(reset: bool = False) -> dict[str, int]:
    """Since the start (or the last reset) in this process: ``flushes`` (fusion rounds),
    ``calls`` (buffered calls they flushed) and ``short_flushes`` (rounds where another
    rank had buffered fewer calls, so the agreement took fewer than this rank had)."""
    with _totals_lock:
        out = dict(_totals)
        if reset:
            _totals.update(flushes=0, short_flushes=0, calls=0)
    return out


_validate = _C.validate
_monotonic = time.monotonic


class FusedCall(Work):
    """One buffered call, and the caller's Work for it."""

    __slots__ = ("_stream", "seq", "key", "nbytes", "args", "t", "posted", "batch", "error")

    def __init__(self, stream: FusionStream, seq: int, key: tuple, nbytes: int, args: tuple,
                 t: float):
        self._stream, self.seq, self.key, self.nbytes, self.args, self.t = \
            stream, seq, key, nbytes, args, t
        self.posted = False
        self.batch: Batch | None = None
        self.error: BaseException | None = None

    @property
    def backend(self) -> str:
        return self._stream.backend

    def wait(self, timeout: float | None = None) -> bool:
        batch = self.batch
        if batch is not None and batch.done:
            return True
        stream = self._stream
        deadline = stream.deadline(timeout)
        if not self.posted:
            stream.wait_posted(self, deadline, inline=timeout is None)
        elif self.error is not None:
            raise self.error
        self.batch.complete(None if timeout is None else deadline)
        return True

    def is_completed(self) -> bool:
        if not self.posted:
            self._stream.request(self.seq)
            return False
        if self.error is not None:
            raise self.error
        return self.batch.poll()

    def __repr__(self) -> str:
        state = "done" if self.batch is not None and self.batch.done else (
            "posted" if self.posted else "buffered")
        return f"<mcrdl fused {self.key[0]} #{self.seq} on '{self.backend}' {state}>"


class Batch:
    """One fused backend call (its Work, or None when it was posted blocking) and the
    copy-back of its results into the callers' tensors."""

    __slots__ = ("work", "copy_back", "lock", "done", "error")

    def __init__(self, work, copy_back):
        self.work, self.copy_back = work, copy_back
        self.lock = threading.Lock()
        self.done = False
        self.error: BaseException | None = None

    def complete(self, deadline: float | None) -> None:
        """Wait for the fused call (until `deadline`, else under the backend's own
        timeout) and copy the results back, once."""
        if self.done:
            return
        with self.lock:
            if self.error is not None:
                raise self.error
            if self.done:
                return
            try:
                if self.work is not None:
                    self.work.wait(None if deadline is None
                                   else max(deadline - time.monotonic(), 0.0))
                if self.copy_back is not None:
                    self.copy_back()
            except BaseException as exc:
                if deadline is None:  # not just a caller's own short timeout
                    self.error = exc
                raise
            self.work = self.copy_back = None
            self.done = True

    def poll(self) -> bool:
        if self.done:
            return True
        if self.error is not None:
            raise self.error
        if self.work is None or self.work.is_completed():
            self.complete(None)
            return True
        return False


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.view(-1)


def _unpack(buf: torch.Tensor, dsts: list[torch.Tensor]):
    """The copy-back of a flat fused buffer into the callers' tensors (one C++ call)."""
    return lambda: _C.unpack_flat(buf, dsts)


# Post one fused call: (backend Work or None when posted blocking, copy-back or None).
# A lone call is posted as it is (nothing to copy). Arguments: inner backend, calls (one
# fusion key), group, group size, this rank's group rank, async_op.

def _post_all_reduce(inner, calls, group, gsize, grank, async_op):
    op = calls[0].key[2]
    if len(calls) == 1:
        return inner.all_reduce(calls[0].args[0], op, group, async_op), None
    dsts = [c.args[0] for c in calls]
    buf = _C.pack_flat(dsts)
    work = inner.all_reduce(buf, op, group, async_op)
    return work, _unpack(buf, dsts)


def _post_bcast(inner, calls, group, gsize, grank, async_op):
    root = calls[0].key[2]
    if len(calls) == 1:
        return inner.bcast(calls[0].args[0], root, group, async_op), None
    dsts = [c.args[0] for c in calls]
    if grank == root:
        return inner.bcast(_C.pack_flat(dsts), root, group, async_op), None
    buf = torch.empty(sum(d.numel() for d in dsts), dtype=dsts[0].dtype)
    work = inner.bcast(buf, root, group, async_op)
    return work, _unpack(buf, dsts)


def _post_all_gather(inner, calls, group, gsize, grank, async_op):
    if len(calls) == 1:
        out, inp = calls[0].args
        return inner.all_gather(out, inp, group, async_op), None
    ins = [c.args[1] for c in calls]
    sizes = [t.numel() for t in ins]
    total = sum(sizes)
    fused_out = torch.empty(gsize * total, dtype=ins[0].dtype)
    work = inner.all_gather(fused_out, _C.pack_flat(ins), group, async_op)

    @torch.no_grad()  # the outputs may be tensors that require grad
    def copy_back():
        blocks = fused_out.view(gsize, total)
        dsts, srcs, off = [], [], 0
        for c, n in zip(calls, sizes, strict=True):
            out = c.args[0]
            if isinstance(out, torch.Tensor):
                dsts.append(out.view(gsize, n))
                srcs.append(blocks[:, off:off + n])
            else:
                dsts.extend(_flat(o) for o in out)
                srcs.extend(blocks[r, off:off + n] for r in range(gsize))
            off += n
        torch._foreach_copy_(dsts, srcs)

    return work, copy_back


def _post_reduce_scatter(inner, calls, group, gsize, grank, async_op):
    op = calls[0].key[2]
    if len(calls) == 1:
        out, inp = calls[0].args
        return inner.reduce_scatter(out, inp, op, group, async_op), None
    rows = []
    for c in calls:
        inp = c.args[1]
        if isinstance(inp, torch.Tensor):
            rows.append(inp.detach().view(gsize, -1))
        else:
            rows.append(torch.stack([_flat(t.detach()) for t in inp]))
    fused_in = torch.cat(rows, dim=1)
    dsts = [c.args[0] for c in calls]
    fused_out = torch.empty(sum(d.numel() for d in dsts), dtype=fused_in.dtype)
    work = inner.reduce_scatter(fused_out, fused_in.view(-1), op, group, async_op)
    return work, _unpack(fused_out, dsts)


_POST = {"all_reduce": _post_all_reduce, "bcast": _post_bcast, "all_gather": _post_all_gather,
         "reduce_scatter": _post_reduce_scatter}


def _by_key(calls: list[FusedCall]) -> list[list[FusedCall]]:
    """The calls of each fusion key, in order of each key's first call."""
    key = calls[0].key
    for c in calls:
        if c.key != key:
            break
    else:
        return [calls]
    groups: dict[tuple, list[FusedCall]] = {}
    for c in calls:
        group = groups.get(c.key)
        if group is None:
            groups[c.key] = [c]
        else:
            group.append(c)
    return list(groups.values())


def _chunks(calls: list[FusedCall], limit: int) -> list[list[FusedCall]]:
    """`calls` (one key) cut into runs of at most `limit` bytes (a function of the calls'
    sizes alone, which are the same on every rank)."""
    out, start, total = [], 0, 0
    for i, c in enumerate(calls):
        if total + c.nbytes > limit and i > start:
            out.append(calls[start:i])
            start, total = i, 0
        total += c.nbytes
    out.append(calls[start:])
    return out


class FusionStream(OrderedStream):
    """The fusion buffer of one (backend, group): an ordered stream whose items are
    buffered calls and deferred unfusable calls; see the module docstring."""

    def __init__(self, name: str, ext: ExtContext, inner, group, gsize: int, backend: str,
                 config: FusionConfig):
        super().__init__(name, ext.timeout_of)
        self.inner, self.group, self.gsize = inner, group, gsize
        self.grank = ext.rank if group is None else group.rank
        self.backend = backend
        self.limit = config.buffer_bytes
        self.wait_s = config.wait_us * 1e-6
        self.buffered = 0  # bytes of buffered calls
        self.batches: list[Batch] = []  # posted async, not known complete (synchronize)
        self._count = torch.empty(1, dtype=torch.int64)  # the agreement's buffer
        self._count_np = self._count.numpy()  # the same memory, cheaper to set and read
        self._last_task = 0  # seq of the latest deferred unfusable call
        self.rounds = 0  # flushes so far

    def add(self, key: tuple, nbytes: int, args: tuple, wake: bool) -> FusedCall:
        """Buffer a call; flush soon when B bytes are buffered. ``wake=False``: the caller
        flushes it itself right away (a blocking call), the worker's timer need not
        start."""
        with self._lock:
            if self.failed is not None:
                self._check()
            self._seq = seq = self._seq + 1
            items = self._items
            call = FusedCall(self, seq, key, nbytes, args, _monotonic())
            first = not items
            items.append(call)
            self.buffered = buffered = self.buffered + nbytes
            if buffered >= self.limit:
                self._want = seq
                self._ensure_worker()
                self._cv.notify()
            elif first and wake:  # the worker's timer starts from the oldest buffered call
                self._ensure_worker()
                self._cv.notify()
        return call

    def _append(self, item) -> None:
        super()._append(item)  # only deferred unfusable calls (Tasks) come this way
        self._last_task = item.seq

    def _due_at(self) -> float | None:
        head = self._items[0] if self._items else None
        return head.t + self.wait_s if head.__class__ is FusedCall else None

    def _on_due(self) -> None:
        self._want = self._seq

    def _advance_head(self, waiting: bool) -> None:
        with self._lock:
            items = self._items
            head = items[0]
            if head.__class__ is not Task:
                if self._last_task < head.seq:  # no unfusable call queued: all of them
                    proposal = len(items)
                else:
                    proposal = 0
                    for item in items:
                        if item.__class__ is Task:
                            break
                        proposal += 1
        if head.__class__ is Task:
            super()._advance_head(waiting)
            return
        agreed = proposal if self.gsize == 1 else self._agree(proposal)
        if not 1 <= agreed <= proposal:
            raise DesyncError(
                f"{self.name}: tensor fusion round {self.rounds + 1}: this rank proposed "
                f"{proposal} buffered call(s), the group agreed on {agreed}; the ranks did not "
                "issue the same calls in the same order on this (backend, group)")
        with self._lock:
            items = self._items
            if agreed == len(items):
                calls = list(items)
                items.clear()
                total, self.buffered = self.buffered, 0
            else:
                calls = [items.popleft() for _ in range(agreed)]
                total = sum(c.nbytes for c in calls)
                self.buffered -= total
        self.rounds += 1
        _tally(agreed, proposal)
        try:
            self._post(calls, total, blocking=waiting)
        except BaseException as exc:
            for c in calls:
                c.error = c.error or exc
                c.posted = True
            raise
        self._notify_posted()

    def _agree(self, proposal: int) -> int:
        """all_reduce(MIN) of the proposals on this (backend, group) - blocking."""
        self._count_np[0] = proposal
        self.inner.all_reduce(self._count, ReduceOp.MIN, self.group, False)
        return int(self._count_np[0])

    def _post(self, calls: list[FusedCall], total: int, blocking: bool) -> None:
        """Fused calls of at most B bytes per fusion key, in order of each key's first
        call; blocking ones (completed here) when the posting thread is about to wait
        anyway, which spares the hand-off to the backend's lane."""
        by_key = _by_key(calls)
        if len(self.batches) >= 64:
            self.batches = [b for b in self.batches if not b.done]
        for key_calls in by_key:
            runs = ([key_calls] if len(by_key) == 1 and total <= self.limit
                    else _chunks(key_calls, self.limit))
            for run in runs:
                work, copy_back = _POST[run[0].key[0]](self.inner, run, self.group, self.gsize,
                                                       self.grank, not blocking)
                batch = Batch(work, copy_back)
                if blocking:
                    batch.complete(None)
                else:
                    self.batches.append(batch)
                for c in run:
                    c.batch = batch
                    c.posted = True

    def complete_all(self, timeout: float) -> None:
        """Wait for every posted batch and deferred call and copy the results back
        (synchronize)."""
        deadline = time.monotonic() + timeout
        batches, self.batches = self.batches, []
        for b in batches:
            b.complete(deadline)
        super().complete_all(max(deadline - time.monotonic(), 0.0))


class Fused(StreamedBackend):
    """Wrapper backend doing tensor fusion; see the module docstring."""

    def __init__(self, inner, ext: ExtContext, config: FusionConfig):
        super().__init__(inner, ext)
        self._config = config
        self._limit = config.buffer_bytes
        self._world_size = ext.world_size
        self._size_rank = ext.size_rank
        for op in ("all_reduce", "bcast", "all_gather", "reduce_scatter"):
            if op not in config.ops:  # pass through, in order
                self.__dict__[op] = self.__getattr__(op)

    def _make_stream(self, group, name: str) -> FusionStream:
        gsize = self._ext.world_size if group is None else group.size
        return FusionStream(name, self._ext, self._inner, group, gsize, self.name, self._config)

    def _group_size(self, group) -> int:
        """The group's size; raises for non-members and non-groups."""
        return self._world_size if group is None else self._size_rank(group)[0]

    def _buffer(self, key: tuple, nbytes: int, args: tuple, group, async_op: bool):
        """Buffer a validated call on the stream of `group` (a member's group)."""
        stream = self._streams.get(0 if group is None else group.id)
        if stream is None:
            stream = self._stream(group, "fusion ")
        call = stream.add(key, nbytes, args, async_op)
        if async_op:
            return call
        call.wait()
        return None

    def all_reduce(self, tensor, op, group, async_op):
        _validate("all_reduce", tensor, op)
        nbytes = tensor.nbytes
        if nbytes >= self._limit or not tensor.is_cpu:
            return self._ordered("all_reduce", self._inner.all_reduce,
                                 (tensor, op, group, async_op))
        if group is None:  # the hot path of _buffer, inlined
            stream = self._streams.get(0) or self._stream(None, "fusion ")
        else:
            self._size_rank(group)
            stream = self._streams.get(group.id) or self._stream(group, "fusion ")
        call = stream.add(("all_reduce", tensor.dtype, op), nbytes, (tensor,), async_op)
        if async_op:
            return call
        call.wait()
        return None

    def bcast(self, tensor, src, group, async_op):
        _validate("bcast", tensor, src, self._group_size(group))
        nbytes = tensor.nbytes
        if nbytes >= self._limit or not tensor.is_cpu:
            return self._ordered("bcast", self._inner.bcast, (tensor, src, group, async_op))
        return self._buffer(("bcast", tensor.dtype, src), nbytes, (tensor,), group, async_op)

    def all_gather(self, output, input, group, async_op):
        size = self._group_size(group)
        _validate("all_gather", output, input, size)
        nbytes = input.nbytes * size
        if nbytes >= self._limit or not input.is_cpu:
            return self._ordered("all_gather", self._inner.all_gather,
                                 (output, input, group, async_op))
        return self._buffer(("all_gather", input.dtype, None), nbytes, (output, input), group,
                            async_op)

    def reduce_scatter(self, output, input, op, group, async_op):
        size = self._group_size(group)
        _validate("reduce_scatter", output, input, op, size)
        nbytes = output.nbytes * size
        if nbytes >= self._limit or not output.is_cpu:
            return self._ordered("reduce_scatter", self._inner.reduce_scatter,
                                 (output, input, op, group, async_op))
        return self._buffer(("reduce_scatter", output.dtype, op), nbytes, (output, input),
                            group, async_op)
