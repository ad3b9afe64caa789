"""The Work handle of async operations (docs/api.md "Work") and its implementations.

Every operation called with ``async_op=True`` returns a :class:`Work`. Three kinds
exist, and no other:

- ``mcrdl._C.Work``: one op posted from C++ (mpi, cray-mpich, pccl); the caller or the
  backend's lane thread drives it (csrc/lane.cpp). ``mcrdl._C.FusedCall``, tensor
  fusion's buffered call, is its C++ cousin.
- :class:`ChainedWork`: steps that complete in order (C++ Works, library works behind
  an adapter, other Works), then a finish step run once (copy-back, cast-back,
  division, decompression, a log record). Backends over libraries and every layer that
  adds work after an op use it.
- :class:`mcrdl.ordering.DeferredWork`: a call queued on a (backend, group)'s
  :class:`~mcrdl.ordering.IssueQueue` because it is posted later, in issue order
  (fusion rounds, compression's size exchanges, debug mode's agreement, pccl's phases
  on another backend): it completes once the call was posted, then its ChainedWork.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Callable, Sequence

import torch

from .errors import InvalidArgumentError


def wait_timeout(timeout: object, where: str = "Work.wait") -> float | None:
    """A ``wait(timeout=)`` argument checked: None (the op's own timeout) or seconds >= 0
    as a float; else InvalidArgumentError naming `where` (a string "1" had been taken as
    1 s by some Works and a raw TypeError by others)."""
    if timeout is None:
        return None
    if not isinstance(timeout, bool) and not isinstance(timeout, (str, bytes)):
        try:
            seconds = float(timeout)  # int, float, numpy scalars
        except (TypeError, ValueError, OverflowError):
            seconds = None
        if seconds is not None and seconds >= 0:
            return seconds
    raise InvalidArgumentError(f"{where}: 'timeout' is {timeout!r}; expected seconds >= 0, "
                               "or None for the op's own timeout")


class Work(abc.ABC):
    """Handle returned by every operation called with ``async_op=True``.

    ``wait(timeout=None)`` blocks until the op's result is ready (raising
    CommTimeoutError after ``timeout`` seconds, default: the init timeout) and returns
    True; ``is_completed()`` polls; ``backend`` names the backend that ran it (the
    resolved name when "auto" was used). ``mcrdl._C.Work`` and ``mcrdl._C.FusedCall``
    are registered as virtual subclasses.
    """

    __slots__ = ()

    backend: str

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> bool: ...

    @abc.abstractmethod
    def is_completed(self) -> bool: ...


class ChainedWork(Work):
    """Steps that complete in order, then ``finish`` run once (under no_grad, or under
    inference mode when the chain was made in it: finish may write inference tensors).

    A step is anything with ``wait(timeout)`` and ``is_completed()``. ``wait(timeout)``
    bounds the whole chain by `timeout` (None: each step's own default). A failure under
    the default timeout is kept and raised by every later wait; a caller's own shorter
    timeout leaves the chain pending, to be waited again.
    """

    __slots__ = ("_steps", "_finish", "_done", "_error", "_lock", "_inference", "backend")

    def __init__(self, steps: Sequence, finish: Callable[[], None] | None = None,
                 backend: str = ""):
        self._steps = tuple(steps)
        self._finish = finish
        self._done = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._inference = finish is not None and torch.is_inference_mode_enabled()
        self.backend = backend

    def wait(self, timeout: float | None = None) -> bool:
        timeout = wait_timeout(timeout)
        if self._done:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._done:
                return True
            try:
                for step in self._steps:
                    step.wait(None if deadline is None
                              else max(deadline - time.monotonic(), 0.0))
                if self._finish is not None:
                    with torch.inference_mode() if self._inference else torch.no_grad():
                        self._finish()
            except BaseException as exc:
                if timeout is None:  # not just the caller's own short timeout
                    self._error = exc
                raise
            self._steps, self._finish = (), None
            self._done = True
        return True

    @property
    def pending(self) -> bool:
        """Neither finished nor failed (its finish step has not run)."""
        return not self._done and self._error is None

    def is_completed(self) -> bool:
        """True once complete or failed (then wait() raises the error), as a C++ Work."""
        if self._done or self._error is not None:
            return True
        if all(step.is_completed() for step in self._steps):
            with contextlib.suppress(Exception):  # kept in _error: wait() raises it
                self.wait()
            return True
        return False


def poll_until(done: Callable[[], bool], limit: float) -> bool:
    """Poll `done` with a sleeping back-off (10 us doubling to 1 ms) for up to `limit`
    seconds; True when it became true, False on timeout. For Python-side waits on
    handles that offer no blocking wait with a deadline."""
    deadline = time.monotonic() + limit
    delay = 1e-5
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 1e-3)
    return True


class ThreadedWait:
    """A plain ``wait()`` of library works run once on a daemon thread of its own, for
    works whose ``is_completed()`` stays False until ``wait()`` was called and whose timed
    wait cannot be taken back: c10d's Gloo send and recv (``SendWork``/``RecvWork`` do not
    override ``isCompleted``, and their ``wait(timeout)`` signals the timeout to every
    pair of the process group, breaking it). ``done`` is set when every work finished;
    ``error`` is what a wait raised, or None. The library's own timeout bounds the
    thread."""

    __slots__ = ("done", "error")

    def __init__(self, works: Sequence, name: str = "mcrdl-wait"):
        self.done = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(tuple(works),), name=name,
                         daemon=True).start()

    def _run(self, works: tuple) -> None:
        try:
            for w in works:
                w.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self.error = exc
        finally:
            self.done.set()

    def succeeded(self) -> bool:
        return self.done.is_set() and self.error is None
