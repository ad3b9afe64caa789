"""The Work handle of async operations (API.md "Work")."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable


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
