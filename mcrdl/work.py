"""The Work handle of async operations (API.md "Work")."""

from __future__ import annotations

import abc


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
