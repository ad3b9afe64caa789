"""Issue order of one (backend, group) for calls posted later than they are issued.

Fusion holds calls back until a buffer is flushed; compression posts some calls in
several dependent steps (sizes first, then payloads); debug mode posts a call only after
every rank's view of it arrived; pccl posts a phase on another backend only after the
phase before it completed. Each must still hand the backend the calls of one (backend,
group) in the order the program issued them, and none may block the calling thread on
other ranks when the call was asynchronous (the caller may go on to issue the call on
another backend that those ranks are waiting for). :class:`IssueQueue` is the one
mechanism they share.

An IssueQueue is the queue of one (backend, group) for one user: items are posted in
FIFO order by whoever holds its *runner* lock, which is either

- the calling thread, when nothing is queued ahead and no one else is posting (the
  fast path: a call is posted inline, exactly as if it were not deferred), or a thread
  that is about to block anyway (a blocking call, ``Work.wait``, ``synchronize``);
- else the queue's worker thread (started on first use), which may block on other
  ranks; that stalls only this (backend, group), whose calls are ordered anyway.

The worker is a Python thread because every step it runs is Python policy (what to
post next) that holds the GIL while it decides; the C++ lanes keep progressing the
posted ops without it. Point-to-point calls never go through a queue: their matching
does not depend on the order of collectives, and queueing a send behind a collective
could deadlock.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from .errors import (
    BackendUnavailableError,
    CommTimeoutError,
    InvalidArgumentError,
    UnsupportedOperationError,
)
from .work import ChainedWork, Work, wait_timeout

#: Errors raised before anything was posted: a task failing with one of these leaves
#: the ranks in step, so the queue stays usable.
# BackendUnavailableError too: raised before a call posts anything (a tensor on a device
# the backend cannot use, a backend already refusing calls), never halfway through one.
LOCAL_ERRORS = (InvalidArgumentError, UnsupportedOperationError, BackendUnavailableError)
#: How much longer than the timeout a default wait on a deferred call waits for it to be
#: posted: a task whose own step timed out (debug mode's exchange, a fusion round) says
#: precisely what did not arrive, and that error should win over "not posted".
_GRACE_S = 2.0


class Task:
    """One deferred item: ``post()`` posts its calls and returns what completes them (a
    :class:`~mcrdl.work.ChainedWork`, or None when nothing is left to do after posting).

    Items of a queue (tasks here, buffered calls in fusion) have ``seq`` (issue
    order), ``posted`` (set once their calls were handed to the backend) and ``error``.
    """

    __slots__ = ("seq", "post", "posted", "finish", "error")

    def __init__(self, post: Callable[[], ChainedWork | None]):
        self.seq = 0
        self.post = post
        self.posted = False
        self.finish: ChainedWork | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.finish = self.post()
        except BaseException as exc:  # delivered to whoever waits on the task
            self.error = exc
        finally:
            self.post = None
            self.posted = True



class DeferredWork(Work):
    """The Work of a deferred task: waits until the task posted its calls, then for the
    task's ChainedWork under the remaining timeout."""

    __slots__ = ("_task", "_queue", "backend", "_lock", "_completed", "_error")

    def __init__(self, task: Task, queue: IssueQueue, backend: str):
        self._task, self._queue, self.backend = task, queue, backend
        self._lock = threading.Lock()
        self._completed = False
        self._error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> bool:
        timeout = wait_timeout(timeout)
        if self._completed:
            return True
        deadline = self._queue.deadline(timeout)
        if timeout is None:  # a task's own timeout error, precise, comes first
            deadline += _GRACE_S
        self._queue.wait_posted(self._task, deadline, inline=timeout is None)
        with self._lock:
            if self._error is not None:
                raise self._error
            if not self._completed:
                finish = self._task.finish
                if finish is not None:
                    try:
                        finish.wait(None if timeout is None
                                    else max(deadline - time.monotonic(), 0.0))
                    except BaseException as exc:
                        if timeout is None:  # not just the caller's own short timeout
                            self._error = exc
                        raise
                self._completed = True
        return True

    def is_completed(self) -> bool:
        if self._completed:
            return True
        task = self._task
        if not task.posted:
            self._queue.request(task.seq)
            return False
        if task.error is not None:
            raise task.error
        if task.finish is not None and not task.finish.is_completed():
            return False
        self.wait()
        return True



class IssueQueue:
    """The issue-order queue of one (backend, group); see the module docstring.

    A task that fails with one of `local_errors` (raised before anything was sent, or
    raised alike on every rank) leaves the queue usable; any other failure fails it:
    ranks may have posted part of the call, so it refuses new calls."""

    def __init__(self, name: str, timeout_of: Callable[[], float],
                 local_errors: tuple[type[BaseException], ...] = LOCAL_ERRORS):
        self.name = name
        self.local_errors = local_errors
        self.timeout_of = timeout_of
        self.failed: str | None = None
        self._lock = threading.Lock()  # the cv's lock, taken directly on hot paths
        self._cv = threading.Condition(self._lock)
        self._items: collections.deque = collections.deque()
        self._runner = threading.Lock()
        self._seq = 0
        self._want = 0  # post every item with seq <= _want soon
        self._thread: threading.Thread | None = None
        self._closed = False
        self.outstanding: list[DeferredWork] = []  # async tasks' works, for synchronize

    # -- for subclasses -------------------------------------------------------------
    def _due_at(self) -> float | None:
        """Monotonic time at which the worker must advance on its own (fusion's timer)."""
        return None

    def _on_due(self) -> None:
        """Called by the worker, with the cv held, when _due_at() has passed."""

    def _last_seq(self) -> int:
        """Sequence number of the latest item queued."""
        return self._seq

    def _refuse_items(self) -> None:
        """The queue failed (cv held): nothing may join the queue from now on."""

    def _fail_item(self, item, exc: BaseException) -> None:
        """`item` will never be posted: it fails with `exc`."""
        item.error = item.error or exc
        item.posted = True

    def _advance_head(self, waiting: bool) -> None:
        """Post the head item (runner held, items not empty). Tasks run here; fusion
        overrides this to flush buffered calls. `waiting`: the posting thread is a
        caller about to wait (it may post blocking calls). A failed task fails the
        queue: ranks may have posted part of it."""
        with self._cv:
            task = self._items.popleft()
        task.run()
        if task.error is not None and not isinstance(task.error, self.local_errors):
            self._fail(task.error)
        self._notify_posted()

    def _notify_posted(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # -- issuing ------------------------------------------------------------------
    def deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout_of() if timeout is None else float(timeout))

    def _check(self) -> None:
        if self.failed is not None:
            raise BackendUnavailableError(
                f"{self.name} is unusable since an earlier call failed (ranks may no longer "
                f"issue matching operations); finalize and restart the job. Earlier: "
                f"{self.failed}")

    def _append(self, item) -> None:
        """Queue `item` (cv held); it gets the next sequence number."""
        self._seq += 1
        item.seq = self._seq
        self._items.append(item)

    def try_inline(self) -> bool:
        """Take the runner when nothing is queued: the caller then posts directly and
        must call :meth:`release`. False: queue the call instead."""
        if not self._runner.acquire(blocking=False):
            return False
        with self._cv:
            if not self._items:
                return True
        self._runner.release()
        return False

    def release(self) -> None:
        self._runner.release()

    def submit(self, task: Task) -> Task:
        """Queue a task and have the worker post it soon."""
        with self._cv:
            self._check()
            self._append(task)
            self._want = task.seq
            self._ensure_worker()
            self._cv.notify()
        return task

    def run_task(self, post: Callable, backend: str, async_op: bool):
        """Post a multi-step call: inline when the queue is idle and the caller blocks
        anyway; else on the worker. Returns its Work (async) or None after completion."""
        task = Task(post)
        if not async_op and self.try_inline():
            try:
                with self._cv:  # refused as submit refuses it, inline or not
                    self._check()
                task.run()
                if task.error is not None and not isinstance(task.error, self.local_errors):
                    self._fail(task.error)
            finally:
                self.release()
        else:
            self.submit(task)
        work = DeferredWork(task, self, backend)
        if async_op:
            if len(self.outstanding) >= 64:  # amortized: drop the completed ones
                self.outstanding = [w for w in self.outstanding if not w._completed]
            self.outstanding.append(work)
            return work
        work.wait()
        return None

    def complete_all(self, timeout: float) -> None:
        """Complete every async task's Work (synchronize): results reach the tensors."""
        deadline = time.monotonic() + timeout
        works, self.outstanding = self.outstanding, []
        for w in works:
            w.wait(max(deadline - time.monotonic(), 0.0))

    def request(self, seq: int) -> None:
        """Ask the worker to post everything up to `seq` soon (non-blocking)."""
        with self._cv:
            if seq > self._want:
                self._want = seq
                self._ensure_worker()
                self._cv.notify()

    def wait_posted(self, item, deadline: float, inline: bool = True) -> None:
        """Block until `item` was posted. With `inline`, posts it (and what precedes it)
        on this thread when the worker is not busy, so a waiter does not pay a thread
        hand-off; without (a wait with an explicit timeout: posting may block on other
        ranks for the backend's whole timeout, and cannot be taken back), the worker
        posts and this thread only waits until `deadline`."""
        requested = False
        while not item.posted:
            if inline and self._runner.acquire(blocking=False):
                try:
                    self._advance_upto(item.seq, True)
                except BaseException as exc:
                    self._fail(exc)
                    raise
                finally:
                    self._runner.release()
            else:
                if not requested:  # the worker is posting: have it go on up to `item`
                    self.request(item.seq)
                    requested = True
                with self._cv:
                    if not item.posted:
                        self._cv.wait(min(max(deadline - time.monotonic(), 0.0), 0.05))
            if not item.posted and time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"{self.name}: deferred call number {item.seq} (in issue order) was not "
                    "posted within the timeout; a rank of the group may never have issued the "
                    "calls before it")
        if item.error is not None:
            raise item.error

    def drain(self, timeout: float) -> None:
        """Post everything queued so far (blocking; used by synchronize/finalize)."""
        with self._cv:
            last = self._last_seq()
            if not self._items:
                return
        deadline = time.monotonic() + timeout
        self.request(last)
        while True:
            with self._cv:
                if not self._items or self._items[0].seq > last:
                    return
            if self._runner.acquire(timeout=0.05):
                try:
                    self._advance_upto(last, True)
                except BaseException as exc:
                    self._fail(exc)
                    raise
                finally:
                    self._runner.release()
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"{self.name}: deferred calls were not posted within {timeout} s; a rank "
                    "of the group may never have issued them")

    def _advance_upto(self, seq: int, waiting: bool) -> None:
        """Post items while the head's seq <= `seq` (runner held)."""
        while True:
            with self._cv:
                if not self._items or self._items[0].seq > seq:
                    return
            self._advance_head(waiting)

    # -- the worker ----------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._work, name=f"mcrdl-{self.name}",
                                            daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._closed and not self._items:
                        return
                    if self._items and self._items[0].seq <= self._want:
                        break
                    due = self._due_at()
                    now = time.monotonic()
                    if due is not None and now >= due:
                        self._on_due()
                        continue
                    self._cv.wait(None if due is None else due - now)
                upto = self._want
            with self._runner:
                try:
                    self._advance_upto(upto, False)
                except BaseException as exc:  # noqa: BLE001 - recorded, reported to waiters
                    self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """A posting step raised: every queued item gets the error; the queue refuses
        new calls (ranks no longer agree on what was posted)."""
        with self._cv:
            self.failed = self.failed or f"{type(exc).__name__}: {exc}"
            self._refuse_items()
            items = list(self._items)
            self._items.clear()
        for item in items:
            self._fail_item(item, exc)
        self._notify_posted()

    def close(self, timeout: float) -> None:
        """Stop the worker after it posted what is queued."""
        with self._cv:
            self._closed = True
            self._want = self._last_seq()
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
