"""Local argument checks of every operation (always on, before anything is sent).

The checks live in C++ (csrc/validate.cpp) so the "mpi" hot path runs them without
leaving C++; :func:`validate` runs them for one :class:`~mcrdl.ops.Call`, for the
layers that validate on a backend's behalf (third-party backends, debug mode, the
extensions that defer calls).
"""

from __future__ import annotations

from . import _C
from .ops import Call, Kind

_FILLED = (Kind.SPLITS, Kind.DISPLS)


def validate(call: Call, size: int, rank: int) -> Call:
    """Raise InvalidArgumentError for bad arguments; return the call with the split sizes
    and displacements that validation fills in (equal splits, packed displacements)."""
    spec = call.spec
    filled = _C.validate(spec.name, *call.args, rank, size)
    if filled is None:
        return call
    names = [p.name for p in spec.params if p.kind in _FILLED]
    return call.replace(**dict(zip(names, filled, strict=True)))
