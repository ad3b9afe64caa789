"""Tensor fusion: small calls of one (backend, group) combined into one buffer.

Calls of all_reduce, all_gather, bcast and reduce_scatter on CPU tensors smaller than
B bytes are buffered per (backend, group) in issue order; a *flush* posts the buffered
calls as one backend call per fusion key (operation, dtype, reduce op or root), and
each caller's Work completes when its slice was copied back into its own tensors.

Identical issue order on every rank
-----------------------------------
A flush is triggered by B bytes buffered, by a call older than T, by a wait on a
buffered call, by a call on the same (backend, group) that cannot be fused, by a
blocking call, or by synchronize/finalize. Only the first two and the unfusable call
are functions of the call sequence; a timer fires, and a rank waits, at different
points of the sequence on different ranks, so two ranks could flush different sets of
calls and post collectives that do not match. Every flush is therefore one *round*
whose first step is an agreement: each rank proposes how many of its oldest buffered
calls to flush (those before the next unfusable call, at most B bytes) and an
all_reduce(MIN) of that count, on the same backend and group, decides. Rounds are
posted in issue order on the (backend, group) like every other call, a rank only
starts one when it has buffered calls, and the ranks' buffers hold the same calls in
the same order (the MPI ordering rule), so round k flushes the same calls on every
rank: the fused collectives match. A rank that proposed more keeps the rest for the
next round; a rank that is ahead waits in the agreement until the others reach it
(their timers guarantee they do). Unfusable calls are posted only after every earlier
buffered call was flushed. Rounds run on the stream's worker thread, or on the caller's
thread when it is about to block anyway, so an async call never blocks on other ranks.

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


class FusedCall(Work):
    """One buffered call, and the caller's Work for it."""

    __slots__ = ("seq", "posted", "error", "key", "nbytes", "args", "t", "batch", "_stream",
                 "backend")

    def __init__(self, key: tuple, nbytes: int, args: tuple, stream: FusionStream):
        self.seq = 0
        self.posted = False
        self.error: BaseException | None = None
        self.key, self.nbytes, self.args = key, nbytes, args
        self.t = 0.0
        self.batch: Batch | None = None
        self._stream = stream
        self.backend = stream.backend

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
    """The fused backend call of one fusion key in one round, and the copy-back."""

    __slots__ = ("works", "copy_back", "lock", "done", "error", "what")

    def __init__(self, works: list, copy_back, what: str):
        self.works, self.copy_back, self.what = works, copy_back, what
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
                for w in self.works:
                    w.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
                if self.copy_back is not None:
                    with torch.no_grad():
                        self.copy_back()
            except BaseException as exc:
                if deadline is None:  # not just a caller's own short timeout
                    self.error = exc
                raise
            self.works, self.copy_back = (), None
            self.done = True

    def poll(self) -> bool:
        if self.done:
            return True
        if self.error is not None:
            raise self.error
        if all(w.is_completed() for w in self.works):
            self.complete(None)
            return True
        return False


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.view(-1)


def _scatter(buf: torch.Tensor, sizes: list[int], dsts: list[torch.Tensor]):
    """The copy-back of a flat fused buffer into 1-D tensors (one C++ call)."""
    return lambda: torch.split_with_sizes_copy(buf, sizes, out=dsts)


# Post one fusion key's calls of a round: (backend Work or None when posted blocking,
# copy-back or None). A lone call is posted as it is (nothing to copy). Arguments: inner
# backend, calls, group, group size, this rank's group rank, async_op.

def _post_all_reduce(inner, calls, group, gsize, grank, async_op):
    op = calls[0].key[2]
    if len(calls) == 1:
        return inner.all_reduce(calls[0].args[0], op, group, async_op), None
    dsts = [_flat(c.args[0]) for c in calls]
    buf = torch.cat(dsts)
    work = inner.all_reduce(buf, op, group, async_op)
    return work, _scatter(buf, [d.numel() for d in dsts], dsts)


def _post_bcast(inner, calls, group, gsize, grank, async_op):
    root = calls[0].key[2]
    if len(calls) == 1:
        return inner.bcast(calls[0].args[0], root, group, async_op), None
    dsts = [_flat(c.args[0]) for c in calls]
    sizes = [d.numel() for d in dsts]
    if grank == root:
        return inner.bcast(torch.cat(dsts), root, group, async_op), None
    buf = torch.empty(sum(sizes), dtype=dsts[0].dtype)
    work = inner.bcast(buf, root, group, async_op)
    return work, _scatter(buf, sizes, dsts)


def _post_all_gather(inner, calls, group, gsize, grank, async_op):
    if len(calls) == 1:
        out, inp = calls[0].args
        return inner.all_gather(out, inp, group, async_op), None
    ins = [_flat(c.args[1]) for c in calls]
    sizes = [t.numel() for t in ins]
    total = sum(sizes)
    fused_out = torch.empty(gsize * total, dtype=ins[0].dtype)
    work = inner.all_gather(fused_out, torch.cat(ins), group, async_op)

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
            rows.append(inp.view(gsize, -1))
        else:
            rows.append(torch.stack([_flat(t) for t in inp]))
    fused_in = torch.cat(rows, dim=1)
    dsts = [_flat(c.args[0]) for c in calls]
    sizes = [d.numel() for d in dsts]
    fused_out = torch.empty(sum(sizes), dtype=fused_in.dtype)
    work = inner.reduce_scatter(fused_out, fused_in.view(-1), op, group, async_op)
    return work, _scatter(fused_out, sizes, dsts)


_POST = {"all_reduce": _post_all_reduce, "bcast": _post_bcast, "all_gather": _post_all_gather,
         "reduce_scatter": _post_reduce_scatter}


class FusionStream(OrderedStream):
    """The fusion buffer of one (backend, group): an ordered stream whose items are
    buffered calls and deferred unfusable calls; see the module docstring."""

    def __init__(self, name: str, ext: ExtContext, inner, group, gsize: int, backend: str,
                 config: FusionConfig):
        super().__init__(name, ext.timeout_of)
        self.ext, self.inner, self.group, self.gsize = ext, inner, group, gsize
        self.grank = ext.rank if group is None else group.rank
        self.backend = backend
        self.limit = config.buffer_bytes
        self.wait_s = config.wait_us * 1e-6
        self.buffered = 0  # bytes of buffered calls
        self.batches: list[Batch] = []  # posted, not known complete (for synchronize)
        self._count = torch.empty(1, dtype=torch.int64)  # the agreement's buffer
        self.rounds = 0  # flushes so far
        self.short_rounds = 0  # flushes that took fewer calls than this rank proposed

    def add(self, call: FusedCall, wake: bool = True) -> FusedCall:
        """Buffer `call`; flush soon when B bytes are buffered. ``wake=False``: the
        caller flushes it itself right away (a blocking call), the worker's timer need
        not start."""
        with self._cv:
            if self.failed is not None:
                self._check()
            first = not self._items
            self._seq += 1
            call.seq = self._seq
            self._items.append(call)
            call.t = time.monotonic()
            self.buffered += call.nbytes
            if self.buffered >= self.limit:
                self._want = call.seq
                self._ensure_worker()
                self._cv.notify()
            elif first and wake:  # the worker's timer starts from the oldest buffered call
                self._ensure_worker()
                self._cv.notify()
        return call

    def _due_at(self) -> float | None:
        head = self._items[0] if self._items else None
        return head.t + self.wait_s if head.__class__ is FusedCall else None

    def _on_due(self) -> None:
        self._want = self._seq

    def _advance_head(self, waiting: bool) -> None:
        with self._cv:
            head = self._items[0]
            if head.__class__ is Task:
                pass
            else:
                proposal, total = 0, 0
                for item in self._items:
                    if item.__class__ is not FusedCall or (
                            proposal and total + item.nbytes > self.limit):
                        break
                    total += item.nbytes
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
        with self._cv:
            calls = [self._items.popleft() for _ in range(agreed)]
            self.buffered -= sum(c.nbytes for c in calls)
        self.rounds += 1
        self.short_rounds += agreed < proposal
        _tally(agreed, proposal)
        try:
            with torch.no_grad():  # grad mode is per thread; rounds may run on the worker
                self._post(calls, blocking=waiting)
        except BaseException as exc:
            for c in calls:
                c.error = c.error or exc
                c.posted = True
            raise
        self._notify_posted()

    def _agree(self, proposal: int) -> int:
        """all_reduce(MIN) of the proposals on this (backend, group) - blocking."""
        count = self._count.fill_(proposal)
        self.inner.all_reduce(count, ReduceOp.MIN, self.group, False)
        return count.item()

    def _post(self, calls: list[FusedCall], blocking: bool) -> None:
        """One backend call per fusion key, in order of each key's first call; blocking
        calls (completed here) when the posting thread is about to wait anyway, which
        spares the hand-off to the backend's lane."""
        by_key: dict[tuple, list[FusedCall]] = {}
        for c in calls:
            by_key.setdefault(c.key, []).append(c)
        if len(self.batches) >= 64:
            self.batches = [b for b in self.batches if not b.done]
        for key, group_calls in by_key.items():
            work, copy_back = _POST[key[0]](self.inner, group_calls, self.group, self.gsize,
                                            self.grank, not blocking)
            batch = Batch([] if work is None else [work], copy_back,
                          f"fused {key[0]} of {len(group_calls)} call(s)")
            if blocking:
                batch.complete(None)
            self.batches.append(batch)
            for c in group_calls:
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
        for op in ("all_reduce", "bcast", "all_gather", "reduce_scatter"):
            if op not in config.ops:  # pass through, in order
                self.__dict__[op] = self.__getattr__(op)

    def _make_stream(self, group, name: str) -> FusionStream:
        gsize = self._ext.world_size if group is None else group.size
        return FusionStream(name, self._ext, self._inner, group, gsize, self.name, self._config)

    def _buffer(self, op: str, key: tuple, nbytes: int, args: tuple, group, async_op: bool):
        stream = self._streams.get(0 if group is None else group.id)
        if stream is None:
            stream = self._stream(group, "fusion ")
        call = stream.add(FusedCall(key, nbytes, args, stream), async_op)
        if async_op:
            return call
        call.wait()
        return None

    def all_reduce(self, tensor, op, group, async_op):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_cpu \
                or tensor.nbytes >= self._limit:
            return self._ordered("all_reduce", self._inner.all_reduce,
                                 (tensor, op, group, async_op))
        self._ext.size_rank(group)
        _C.validate("all_reduce", tensor, op)
        return self._buffer("all_reduce", ("all_reduce", tensor.dtype, op), tensor.nbytes,
                            (tensor,), group, async_op)

    def bcast(self, tensor, src, group, async_op):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_cpu \
                or tensor.nbytes >= self._limit:
            return self._ordered("bcast", self._inner.bcast, (tensor, src, group, async_op))
        size, _ = self._ext.size_rank(group)
        _C.validate("bcast", tensor, src, size)
        return self._buffer("bcast", ("bcast", tensor.dtype, src), tensor.nbytes, (tensor,),
                            group, async_op)

    def all_gather(self, output, input, group, async_op):
        if not isinstance(input, torch.Tensor) or not input.is_cpu:
            return self._ordered("all_gather", self._inner.all_gather,
                                 (output, input, group, async_op))
        size, _ = self._ext.size_rank(group)
        nbytes = input.nbytes * size
        if nbytes >= self._limit:
            return self._ordered("all_gather", self._inner.all_gather,
                                 (output, input, group, async_op))
        _C.validate("all_gather", output, input, size)
        return self._buffer("all_gather", ("all_gather", input.dtype, None), nbytes,
                            (output, input), group, async_op)

    def reduce_scatter(self, output, input, op, group, async_op):
        if not isinstance(output, torch.Tensor) or not output.is_cpu:
            return self._ordered("reduce_scatter", self._inner.reduce_scatter,
                                 (output, input, op, group, async_op))
        size, _ = self._ext.size_rank(group)
        nbytes = output.nbytes * size
        if nbytes >= self._limit:
            return self._ordered("reduce_scatter", self._inner.reduce_scatter,
                                 (output, input, op, group, async_op))
        _C.validate("reduce_scatter", output, input, op, size)
        return self._buffer("reduce_scatter", ("reduce_scatter", output.dtype, op), nbytes,
                            (output, input), group, async_op)

    def stats(self) -> dict[int, tuple[int, int]]:
        """(flushes, flushes that took fewer calls than this rank proposed) per group id."""
        return {gid: (s.rounds, s.short_rounds) for gid, s in self._streams.items()}

