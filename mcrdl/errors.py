"""Error classes of mcrdl (docs/api.md "Errors"); all re-exported from ``mcrdl``."""


class MCRDLError(RuntimeError):
    """Base class of every mcrdl error."""


class BackendUnavailableError(MCRDLError):
    """Unknown backend name, library missing, device mismatch, or use before init."""


class InvalidArgumentError(MCRDLError, ValueError):
    """A bad argument detectable locally (dtype, device, sizes, counts, ranks, group...)."""


class UnsupportedOperationError(MCRDLError):
    """The backend cannot do this operation at all; the message names backends that can.

    ``op`` and ``backend`` name the call; ``alternatives`` (the backends that have the
    operation and are usable in this process) and ``unusable`` (those that have it but
    are not usable here: nccl without a GPU) are filled in by the front, which knows the
    registry. Given one argument (as the C++ core raises it), that is the whole message."""

    def __init__(self, op: str, backend: str | None = None,
                 alternatives: list[str] | None = None, unusable: list[str] | None = None):
        self.op, self.backend = op, backend
        self.alternatives, self.unusable = alternatives, unusable
        if backend is None:
            super().__init__(op)
            return
        text = f"{op}: backend '{backend}' does not implement it"
        if alternatives is not None:
            text += (f"; backends that do: {', '.join(alternatives)}" if alternatives
                     else "; no backend usable in this process does")
        if unusable:
            also = " also" if alternatives else ""
            text += (f" ({', '.join(unusable)}{also} do{'es' if len(unusable) == 1 else ''}, "
                     "but cannot run in this process)")
        super().__init__(text)

    def __reduce__(self):
        return type(self), (self.op, self.backend, self.alternatives, self.unusable)


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
