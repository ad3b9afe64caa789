"""The fusion buffer of one (backend, group): buffered calls, flushed in rounds whose
first step is the agreement of the ranks on the calls each round flushes.

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
"""

from __future__ import annotations

import threading
import time

import torch

from .. import _C
from ..errors import DesyncError
from ..ops import ReduceOp
from ..ordering import IssueQueue, Task
from ..work import wait_timeout
from .calls import KIND_NAMES, POST
from .config import FusionConfig

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
                work, copy_back = POST[chunk.kind](self.inner, chunk, self.group, self.gsize,
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
