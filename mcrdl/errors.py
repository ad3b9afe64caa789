"""Error classes of mcrdl (API.md "Errors"); all re-exported from ``mcrdl``."""


class MCRDLError(RuntimeError):
    """Base class of every mcrdl error."""


class BackendUnavailableError(MCRDLError):
    """Unknown backend name, library missing, device mismatch, or use before init."""


class InvalidArgumentError(MCRDLError, ValueError):
    """A bad argument detectable locally (dtype, device, sizes, counts, ranks, group...)."""


class UnsupportedOperationError(MCRDLError):
    """The backend cannot do this operation at all; the message names backends that can."""


class CommTimeoutError(MCRDLError, TimeoutError):
    """A wait exceeded the timeout; the message names op, backend, group and sequence number."""


class DesyncError(MCRDLError):
    """Ranks disagree on a call (debug mode); the message shows each rank's view."""


__all__ = [
    "MCRDLError",
    "BackendUnavailableError",
    "InvalidArgumentError",
    "UnsupportedOperationError",
    "CommTimeoutError",
    "DesyncError",
]
