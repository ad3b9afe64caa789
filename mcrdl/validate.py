"""Local argument checks of every operation (API.md "Errors"), by operation name.

The checks themselves live in C++ (csrc/validate.cpp) so the "mpi" hot path runs them
without leaving C++; this table maps each operation's arguments (in the order of the
Backend methods, without group/async_op) onto them, for backends that do not validate
themselves and for debug mode.
"""

from __future__ import annotations

from . import _C

# op -> function(args, group_size, group_rank) -> args (v variants get their displs filled)
_CHECKS = {
    "all_reduce": lambda a, s, r: _C.validate("all_reduce", a[0], a[1]),
    "reduce": lambda a, s, r: _C.validate("reduce", a[0], a[1], a[2], s),
    "bcast": lambda a, s, r: _C.validate("bcast", a[0], a[1], s),
    "all_gather": lambda a, s, r: _C.validate("all_gather", a[0], a[1], s),
    "gather": lambda a, s, r: _C.validate("gather", a[0], a[1], a[2], r, s),
    "scatter": lambda a, s, r: _C.validate("scatter", a[0], a[1], a[2], r, s),
    "reduce_scatter": lambda a, s, r: _C.validate("reduce_scatter", a[0], a[1], a[2], s),
    "all_to_all_single": lambda a, s, r: _C.validate("all_to_all_single", *a[:4], s),
    "all_to_all": lambda a, s, r: _C.validate("all_to_all", a[0], a[1], s),
    "send": lambda a, s, r: _C.validate("send", a[0], a[1], a[2], r, s),
    "recv": lambda a, s, r: _C.validate("recv", a[0], a[1], a[2], r, s),
    "barrier": lambda a, s, r: None,
}


def validate_call(op: str, args: tuple, size: int, rank: int) -> tuple:
    """Raise InvalidArgumentError for bad arguments; return the (completed) arguments."""
    if op == "gatherv":
        displs = _C.validate("gatherv", *args[:5], rank, size)
        return (*args[:3], displs, args[4])
    if op == "scatterv":
        displs = _C.validate("scatterv", *args[:5], rank, size)
        return (*args[:3], displs, args[4])
    if op == "all_gatherv":
        displs = _C.validate("all_gatherv", *args[:4], rank, size)
        return (*args[:3], displs)
    if op == "all_to_allv":
        sd, rd = _C.validate("all_to_allv", *args[:6], size)
        return (*args[:4], sd, rd)
    _CHECKS[op](args, size, rank)
    return args


OPERATIONS = frozenset(_CHECKS) | {"gatherv", "scatterv", "all_gatherv", "all_to_allv"}
