"""The c10d Work of the "mcrdl" process groups' async calls (:class:`McrdlWork`), the
watchdog that fails the futures of works pending past their timeout, and the threads
that complete the other futures."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .._C import Work as _CWork
from ..errors import CommTimeoutError
from .convert import timeout_seconds

if TYPE_CHECKING:
    from .process_group import ProcessGroupMCRDL


_completer_lock = threading.Lock()
_completer: ThreadPoolExecutor | None = None


def _completer_pool() -> ThreadPoolExecutor:
    """Threads that complete the futures of works that are not plain mcrdl._C.Works (or
    that have a finish step), one per pending future up to 128: a wait never holds up
    another's future."""
    global _completer
    with _completer_lock:
        if _completer is None:
            _completer = ThreadPoolExecutor(128, thread_name_prefix="mcrdl-torch-future")
        return _completer


class _Watchdog:
    """Fails the futures of works that completion callbacks settle (see
    :meth:`McrdlWork.get_future`) once they are pending past their timeout: a callback
    alone never comes for an op a rank never joins.

    One sleeping thread per process. Works are kept per timeout in dicts, in the order
    they were watched, which is their deadlines' order; a settled work leaves at once.
    The thread sleeps until the first deadline (indefinitely when nothing is watched),
    and is woken only when a work's deadline comes before its wake-up: once per busy
    spell, not per work.
    """

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._queues: dict[float, dict[McrdlWork, float]] = {}
        self._wake_at = float("inf")
        self._thread: threading.Thread | None = None
        #: mcrdl's timeout in force, for works whose group has none of its own (set by
        #: create(); a work's own default is the one its op was posted with, the same).
        self.default_timeout: Callable[[], float] = lambda: 300.0

    def watch(self, work: McrdlWork, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            queue = self._queues.get(timeout)
            if queue is None:
                queue = self._queues[timeout] = {}
            queue[work] = deadline
            if deadline < self._wake_at:
                self._wake_at = deadline
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="mcrdl-torch-watchdog")
                    self._thread.start()
                else:
                    self._cond.notify()

    def forget(self, work: McrdlWork, timeout: float) -> None:
        with self._cond:
            queue = self._queues.get(timeout)
            if queue is not None:
                queue.pop(work, None)

    def _run(self) -> None:
        while True:
            due = []
            with self._cond:
                now = time.monotonic()
                wake = float("inf")
                for queue in self._queues.values():
                    expired = []
                    for work, deadline in queue.items():
                        if deadline > now:
                            wake = min(wake, deadline)
                            break
                        expired.append(work)
                    for work in expired:
                        del queue[work]
                    due += expired
                if not due:
                    self._wake_at = wake
                    self._cond.wait(None if wake == float("inf") else wake - now)
                    continue
            for work in due:
                work._expire()


watchdog = _Watchdog()


class McrdlWork(dist.Work):
    """The c10d Work of async calls: mcrdl works, the tensors they write (the future's
    value, as c10d gives it) and a finish step (copying a packed result out) run once
    when they are complete. Made by :meth:`of`.

    ``wait(timeout)`` blocks until then (timeout zero or None: the group's, else
    mcrdl's). Only one thread waits on the mcrdl works at a time (the lock), so the
    finish step runs once. A failed op's error is kept: every later ``wait`` raises it,
    ``exception()`` returns it. A timeout of ``wait()`` is not kept (the op may still
    complete); the watchdog's timeout of a future is (the future failed with it and the
    group is broken): the work is then completed, and failed. ``result()`` before the
    work completed raises, as torch's works do; after a failure it raises the failure
    (the outputs may be half written).

    ``get_future()``: when every work is an ``mcrdl._C.Work`` and there is no finish
    step (every single-op call, DDP's buckets among them), the works' completion
    callbacks settle the future, on the thread that completes the last one (the
    backend's lane thread, or a waiter), and the watchdog fails it with the
    CommTimeoutError ``wait()`` would raise when it is pending past the timeout. Other
    works (the Python works of extensions, debug mode) are waited on by a thread of the
    completer pool, which settles the future.
    """

    # Slots: a work is made per async call, and attributes of a Python subclass of a
    # pybind class are cheaper in slots; __dict__ stays for what torch may set.
    __slots__ = ("_works", "_outputs", "_timeout", "_finish", "_what", "_lock", "_done",
                 "_error", "_future", "_unsettled", "_left", "_watched", "_pg", "__dict__")

    @classmethod
    def of(cls, works: tuple, outputs: list, timeout: float | None,
           finish: Callable[[], None] | None, what: str,
           pg: ProcessGroupMCRDL | None = None) -> McrdlWork:
        """`pg`: the group the works are ops of, which a timeout of theirs breaks."""
        # No __init__ of its own: pybind's constructor alone is the cheaper call.
        work = cls()
        work._pg = pg
        work._works = works
        work._outputs = outputs
        work._timeout = timeout
        work._finish = finish
        work._what = what
        work._lock = threading.Lock()
        work._done = False
        work._error = None
        work._future = None
        return work

    def _complete(self) -> None:
        if self._finish is not None:
            with torch.no_grad():
                self._finish()
            self._finish = None
        self._works = ()
        self._done = True

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._finish = None
        self._works = ()
        self._done = True

    def _settle(self, deadline: float | None) -> None:
        """Wait on the works until `deadline` (time.monotonic(); None: each work's own
        bound) and finish, or keep the failure; called with the lock held."""
        try:
            for w in self._works:
                w.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        except CommTimeoutError:
            raise  # the op may still complete: not kept
        except BaseException as exc:
            self._fail(exc)
            return
        self._complete()

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        if not self._done and self._error is None:
            seconds = self._timeout if timeout is None \
                else (timeout_seconds(timeout) or self._timeout)
            lock = self._lock
            # One deadline bounds the whole wait: the lock (another thread's wait) and
            # every work after it share `seconds`.
            deadline = None if seconds is None else time.monotonic() + seconds
            if seconds is None:  # mcrdl's timeout bounds the waits, hence this one
                lock.acquire()
            elif not lock.acquire(timeout=seconds):
                raise self._timed_out(CommTimeoutError(
                    f"it did not complete within wait(timeout={seconds}) s; it is still "
                    "pending"), seconds)
            try:
                if not self._done:
                    self._settle(deadline)
            except CommTimeoutError as exc:
                raise self._timed_out(exc, seconds) from None
            finally:
                lock.release()
        if self._error is not None:
            raise self._error
        return True

    def _timed_out(self, exc: CommTimeoutError, seconds: float | None) -> CommTimeoutError:
        """`exc` led by the c10d operation and the wait ("Timed out waiting", the words
        of Gloo's and NCCL's timeouts, which torch's tests and users match), having
        broken the group: the op stays in flight on every rank that posted it, so the
        group's later ops would no longer match across ranks (as Gloo closes its pairs
        and NCCL aborts its communicator after a timeout)."""
        if seconds is not None:
            exc = type(exc)(f"torch.distributed {self._what} on mcrdl: Timed out waiting "
                            f"{seconds * 1000:.0f} ms: {exc}")
        if self._pg is not None:
            self._pg._break(self._what, exc)
        return exc

    def is_completed(self) -> bool:
        if self._done or self._error is not None:
            return True
        if not self._lock.acquire(blocking=False):  # another thread is waiting on it
            return False
        try:
            if not self._done:
                try:
                    if not all(w.is_completed() for w in self._works):
                        return False
                except BaseException as exc:  # noqa: BLE001 - a failed step: kept
                    self._fail(exc)
                    return True
                try:
                    self._settle(None)  # returns at once: every work is complete
                except CommTimeoutError as exc:  # a work's own timeout, not a wait's: kept
                    self._fail(exc)
            return True
        finally:
            self._lock.release()

    def get_future(self) -> torch.futures.Future:
        with _completer_lock:
            if self._future is not None:
                return self._future
            future = self._future = torch.futures.Future()
        works = self._works
        if self.is_completed():
            if self._error is None:
                future.set_result(self._outputs)
            else:
                future.set_exception(self._error)
        elif self._finish is None and all(type(w) is _CWork for w in works):
            # Settled by whoever takes the one entry of _unsettled (list.pop is atomic):
            # the last completion callback (the one that pops True off _left), a failing
            # one, or the watchdog.
            self._unsettled = [future]
            self._left = [True, *(False for _ in works[1:])]
            self._watched = self._timeout if self._timeout is not None \
                else watchdog.default_timeout()
            watchdog.watch(self, self._watched)
            for w in works:
                w.add_done_callback(self._on_done)
        else:
            _completer_pool().submit(self._complete_future)
        return future

    def _on_done(self, error: BaseException | None) -> None:
        """Completion callback of each mcrdl._C.Work (GIL held, any thread)."""
        if error is not None:
            self._settle_future(error)
        elif self._left.pop():
            self._done = True  # no finish step on this path, and every work is complete
            self._settle_future(None)

    def _settle_future(self, error: BaseException | None) -> None:
        try:
            future = self._unsettled.pop()
        except IndexError:
            return  # settled already
        watchdog.forget(self, self._watched)
        if error is None:
            future.set_result(self._outputs)
        else:
            self._error = error
            future.set_exception(error)

    def _expire(self) -> None:
        """The watchdog's call at the deadline: the CommTimeoutError of the first work
        still pending (wait()'s, and as wait() it fails the backend under mcrdl's
        default timeout) goes to the future."""
        if not self._unsettled:
            return
        try:
            for w in self._works:
                w.time_out(-1.0 if self._timeout is None else self._timeout)
        except CommTimeoutError as exc:
            self._settle_future(self._timed_out(exc, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the future's waiters
            self._settle_future(exc)

    def _complete_future(self) -> None:
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the future's waiters
            self._error = exc
            self._future.set_exception(exc)
            return
        self._future.set_result(self._outputs)

    def result(self) -> list:
        if not self.is_completed():
            raise RuntimeError(
                f"torch.distributed {self._what} on mcrdl: Work needs to be completed before "
                "calling result(). Should call wait() before result().")
        if self._error is not None:
            raise self._error
        return self._outputs

    def exception(self) -> BaseException | None:
        return self._error

    def is_success(self) -> bool:
        return self._done and self._error is None
