"""The Work handle of async operations (docs/api.md "Work")."""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Sequence


class Work(abc.ABC):
    """Handle returned by every operation called with ``async_op=True``.

    ``wait(timeout=None)`` blocks until the op's result is ready (raising
    CommTimeoutError after ``timeout`` seconds, default: the init timeout) and returns
    True; ``is_completed()`` polls; ``backend`` names the backend that ran it (the
    resolved name when "auto" was used). The C++ handle of host backends
    (``mcrdl._C.Work``) is registered as a virtual subclass.
    """

    __slots__ = ()

    backend: str

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> bool: ...

    @abc.abstractmethod
    def is_completed(self) -> bool: ...


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
