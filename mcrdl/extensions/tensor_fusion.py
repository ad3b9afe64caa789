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
queue's worker thread, or on the caller's thread when it is about to block anyway, so
an async call never blocks on other ranks.

The calls themselves live in C++ (``_C.FusionQueue``, csrc/fusion.cpp): buffering a call
(validated, recorded, its Work returned) and a flush's per-call work (cutting, packing,
copying back, marking posted) cost a fraction of a microsecond each; the rounds, the
timer and the posting stay here.

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
from ..ops import FUSABLE_OPS, OPS, OpSpec, ReduceOp
from ..ordering import IssueQueue, Task
from ..work import wait_timeout
from .base import layers
from .config import FusionConfig
from .ordered import OrderedLayer

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


# Post one fused call: (backend Work or None when posted blocking, copy-back or None).
# A lone call is posted as it is (nothing to copy). Arguments: inner backend, the chunk of
# calls (one fusion key: _C.FusedChunk), group, group size, this rank's group rank,
# async_op.

def _post_all_reduce(inner, chunk, group, gsize, grank, async_op):
    op = ReduceOp(chunk.param)
    if len(chunk) == 1:
        return inner.all_reduce(chunk.calls[0].args[0], op, group, async_op), None
    buf = chunk.pack()
    work = inner.all_reduce(buf, op, group, async_op)
    return work, lambda: chunk.unpack(buf)


def _post_bcast(inner, chunk, group, gsize, grank, async_op):
    root = chunk.param
    if len(chunk) == 1:
        return inner.bcast(chunk.calls[0].args[0], root, group, async_op), None
    if grank == root:  # copied back too: a layer below (compression) may change the bits
        buf = chunk.pack()
        return inner.bcast(buf, root, group, async_op), lambda: chunk.unpack(buf)
    first = chunk.calls[0].args[0]
    buf = torch.empty(chunk.nbytes // first.element_size(), dtype=first.dtype)
    work = inner.bcast(buf, root, group, async_op)
    return work, lambda: chunk.unpack(buf)


def _post_all_gather(inner, chunk, group, gsize, grank, async_op):
    calls = chunk.calls
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


def _post_reduce_scatter(inner, chunk, group, gsize, grank, async_op):
    op = ReduceOp(chunk.param)
    calls = chunk.calls
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
    fused_out = torch.empty(chunk.nbytes // gsize // fused_in.element_size(),
                            dtype=fused_in.dtype)
    work = inner.reduce_scatter(fused_out, fused_in.view(-1), op, group, async_op)
    return work, lambda: chunk.unpack(fused_out)


# By _C.FusedCall.kind (the C++ fast path posts all_reduce as kind 0)
_ALL_REDUCE, _BCAST, _ALL_GATHER, _REDUCE_SCATTER = range(4)
_POST = (_post_all_reduce, _post_bcast, _post_all_gather, _post_reduce_scatter)
KIND_NAMES = tuple(f.__name__.removeprefix("_post_") for f in _POST)
if set(KIND_NAMES) != FUSABLE_OPS or KIND_NAMES[0] != "all_reduce":
    raise ImportError(f"fusion kinds {KIND_NAMES} do not match mcrdl.ops ({FUSABLE_OPS})")


class FusionBuffer(IssueQueue):
    """The fusion buffer of one (backend, group): an ordered queue whose items are
    buffered calls and deferred unfusable calls; see the module docstring."""

    kind_names = KIND_NAMES  # FusedCall reprs name their kind from here

    def __init__(self, name: str, rt, inner, group, gsize: int, backend: str,
                 config: FusionConfig):
        super().__init__(name, rt.timeout_of)
        self.inner, self.group, self.gsize = inner, group, gsize
        self.grank = rt.rank if group is None else group.rank
        self.backend = backend
        self.limit = config.buffer_bytes
        self.wait_s = config.wait_us * 1e-6
        self.batches: list[Batch] = []  # posted async, not known complete (synchronize)
        self._count = torch.empty(1, dtype=torch.int64)  # the agreement's buffer
        self._count_np = self._count.numpy()  # the same memory, cheaper to set and read
        self.rounds = 0  # flushes so far
        # The calls themselves (C++): buffered calls stand in _items as runs
        # (_C.FusedRun: the calls issued between two unfusable calls) beside Tasks.
        self.queue = _C.FusionQueue(self, self._items, self.limit, self.wait_s)

    # -- hooks of the C++ queue -------------------------------------------------------
    def _wake(self, seq: int) -> None:
        """B bytes are buffered: flush up to call `seq` soon."""
        self.request(seq)

    def _on_timer(self) -> None:
        """The queue's T-timer fired (its own thread, see csrc/fusion.cpp): the oldest
        buffered call is T old; flush everything buffered so far."""
        self._wake(self.queue.seq)

    def wait_call(self, call, timeout: float | None) -> bool:
        """``_C.FusedCall.wait`` before its batch is known done."""
        timeout = wait_timeout(timeout)
        batch = call.batch
        if batch is not None and batch.done:
            return True
        deadline = self.deadline(timeout)
        if not call.posted:
            self.wait_posted(call, deadline, inline=timeout is None)
        elif call.error is not None:
            raise call.error
        call.batch.complete(None if timeout is None else deadline)
        return True

    def poll_call(self, call) -> bool:
        """``_C.FusedCall.is_completed`` before its batch is known done."""
        if not call.posted:
            self.request(call.seq)
            return False
        if call.error is not None:
            raise call.error
        return call.batch.poll()

    # -- the ordered queue ---------------------------------------------------------
    def _append(self, item) -> None:
        self.queue.push_task(item)  # deferred unfusable calls (Tasks): after every call

    def _last_seq(self) -> int:
        return self.queue.seq

    def _refuse_items(self) -> None:
        self.queue.set_failed()

    def _fail_item(self, item, exc: BaseException) -> None:
        if item.__class__ is Task:
            super()._fail_item(item, exc)
        else:
            item.fail(exc)

    def _due_at(self) -> float | None:
        head = self._items[0] if self._items else None
        return head.t + self.wait_s if head.__class__ is _C.FusedRun else None

    def _on_due(self) -> None:
        self._want = self.queue.seq

    def _advance_head(self, waiting: bool) -> None:
        with self._lock:
            head = self._items[0]
        if head.__class__ is Task:
            super()._advance_head(waiting)
            return
        proposal = len(head)  # every call before the next unfusable one
        agreed = proposal if self.gsize == 1 else self._agree(proposal)
        if not 1 <= agreed <= proposal:
            raise DesyncError(
                f"{self.name}: tensor fusion round {self.rounds + 1}: this rank proposed "
                f"{proposal} buffered call(s), the group agreed on {agreed}; the ranks did not "
                "issue the same calls in the same order on this (backend, group)")
        with self._lock:
            chunks, emptied = self.queue.take(head, agreed)
            if emptied:
                self._items.popleft()
        self.rounds += 1
        _tally(agreed, proposal)
        self._post(chunks, blocking=waiting)
        self._notify_posted()

    def _agree(self, proposal: int) -> int:
        """all_reduce(MIN) of the proposals on this (backend, group) - blocking."""
        self._count_np[0] = proposal
        self.inner.all_reduce(self._count, ReduceOp.MIN, self.group, False)
        return int(self._count_np[0])

    def _post(self, chunks: list, blocking: bool) -> None:
        """One fused call per chunk (one fusion key, at most B bytes; cut by
        _C.FusionQueue.take); blocking ones (completed here) when the posting thread is
        about to wait anyway, which spares the hand-off to the backend's lane."""
        if len(self.batches) >= 64:
            self.batches = [b for b in self.batches if not b.done]
        for i, chunk in enumerate(chunks):
            try:
                work, copy_back = _POST[chunk.kind](self.inner, chunk, self.group, self.gsize,
                                                    self.grank, not blocking)
            except BaseException as exc:  # the chunks posted before keep their batches
                for rest in chunks[i:]:
                    rest.fail(exc)
                raise
            batch = Batch(work, copy_back)
            if blocking:
                batch.complete(None)
            else:
                self.batches.append(batch)
            chunk.posted(batch)

    def close(self, timeout: float) -> None:
        super().close(timeout)
        self.queue.close()

    def complete_all(self, timeout: float) -> None:
        """Wait for every posted batch and deferred call and copy the results back
        (synchronize)."""
        deadline = time.monotonic() + timeout
        batches, self.batches = self.batches, []
        for b in batches:
            b.complete(deadline)
        super().complete_all(max(deadline - time.monotonic(), 0.0))


def _implements(top, op: str) -> bool:
    """Whether the backend under `top` (and the layers below this one) has `op`."""
    below = layers(top)
    backend = below[-1].inner if below else top
    supported = getattr(type(backend), "supported_ops", None)
    return supported is None or op in supported()


class Fused(OrderedLayer):
    """Wrapper backend doing tensor fusion; see the module docstring."""

    def __init__(self, inner, rt, config: FusionConfig):
        self._config = config
        self._limit = config.buffer_bytes
        super().__init__(inner, rt)

    def wrap(self, spec: OpSpec, forward):
        if not _implements(self.inner, spec.name):
            # raises UnsupportedOperationError at the call: were it buffered, at a flush
            # that failed the whole round; were it queued in order, only at its wait
            return forward
        if spec.name not in self._config.ops:  # pass through, in order
            return self.passthrough(spec, forward)
        if spec.name == "all_reduce":  # world calls: one C++ call (_all_reduce the others)
            queue = self._queue(None, "fusion ").queue
            queue.set_fallback(self._all_reduce)
            return queue.all_reduce
        return super().wrap(spec, forward)

    def _make_queue(self, group, name: str) -> FusionBuffer:
        gsize = self._rt.world_size if group is None else group.size
        return FusionBuffer(name, self._rt, self.inner, group, gsize, self.name, self._config)

    def _pass(self, op: str, *args):
        """Hand the call (the Backend method's arguments) on unfused, in order."""
        return self._ordered(OPS[op].call(args), getattr(self.inner, op))

    def _buffer(self, kind: int, param: int, tensor, nbytes: int, args: tuple, group,
                async_op: bool):
        """Buffer a validated call on the queue of `group` (a member's group); its fusion
        key is (kind, the dtype of `tensor`, param)."""
        queue = self._queues.get(0 if group is None else group.id)
        if queue is None:
            queue = self._queue(group, "fusion ")
        call = queue.queue.add(kind, param, tensor, nbytes, args, async_op)
        if async_op:
            return call
        call.wait()
        return None

    def _all_reduce(self, tensor, op, group, async_op):
        """all_reduce, but for the world group's fused calls (the queue's C++ front)."""
        if group is None:
            queue = self._queues.get(0) or self._queue(None, "fusion ")
        else:
            self._rt.size_rank(group)
            queue = self._queues.get(group.id) or self._queue(group, "fusion ")
        call = queue.queue.add_all_reduce(tensor, op, async_op)
        if call is None:  # B bytes or more, or not on the CPU
            return self._pass("all_reduce", tensor, op, group, async_op)
        if async_op:
            return call
        call.wait()
        return None

    def bcast(self, tensor, src, group, async_op):
        size, rank = self._rt.size_rank(group)
        _validate("bcast", tensor, src, rank, size)
        nbytes = tensor.nbytes
        if nbytes >= self._limit or not tensor.is_cpu:
            return self._pass("bcast", tensor, src, group, async_op)
        return self._buffer(_BCAST, src, tensor, nbytes, (tensor,), group, async_op)

    def all_gather(self, output, input, group, async_op):
        size, rank = self._rt.size_rank(group)
        _validate("all_gather", output, input, rank, size)
        nbytes = input.nbytes * size
        if nbytes >= self._limit or not input.is_cpu:
            return self._pass("all_gather", output, input, group, async_op)
        return self._buffer(_ALL_GATHER, 0, input, nbytes, (output, input), group, async_op)

    def reduce_scatter(self, output, input, op, group, async_op):
        size, rank = self._rt.size_rank(group)
        _validate("reduce_scatter", output, input, op, rank, size)
        nbytes = output.nbytes * size
        if nbytes >= self._limit or not output.is_cpu:
            return self._pass("reduce_scatter", output, input, op, group, async_op)
        return self._buffer(_REDUCE_SCATTER, int(op), output, nbytes, (output, input), group,
                            async_op)
