"""Reduction operators and the operation names of the API."""

from __future__ import annotations

import enum

import torch

from .errors import InvalidArgumentError


class ReduceOp(enum.IntEnum):
    """Reduction operators. Values are shared with the C++ core (csrc/common.h).

    On bool tensors SUM, MAX and BOR are logical or; PRODUCT, MIN and BAND logical and;
    BXOR logical xor. AVG applies to floating types only (SUM divided by the group size);
    BAND, BOR and BXOR to integer and bool types only.
    """

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PROD = 1  # alias of PRODUCT


_TORCH_NAMES = {"SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"}


def to_reduce_op(op: object) -> ReduceOp:
    """Accept a mcrdl.ReduceOp or its int value, its name, or a torch.distributed.ReduceOp."""
    if isinstance(op, ReduceOp):
        return op
    name = None
    if isinstance(op, bool):
        pass
    elif isinstance(op, int):
        if 0 <= op <= 7:
            return ReduceOp(op)
    elif isinstance(op, str):
        name = op.upper()
    else:  # torch.distributed.ReduceOp / RedOpType
        name = getattr(op, "name", None)
        if name is None and torch.distributed.is_available():
            name = next((c for c in _TORCH_NAMES
                         if op == getattr(torch.distributed.ReduceOp, c, None)), None)
    if name in ReduceOp.__members__:
        return ReduceOp[name]
    raise InvalidArgumentError(
        f"'op' is {op!r}; expected a mcrdl.ReduceOp or torch.distributed.ReduceOp "
        f"(SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR)"
    )


#: Every operation of API.md, by the name used in capabilities and errors.
OPERATIONS = (
    "all_reduce",
    "reduce",
    "bcast",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all_single",
    "all_to_all",
    "gatherv",
    "scatterv",
    "all_gatherv",
    "all_to_allv",
    "send",
    "recv",
    "barrier",
)

#: Every dtype of API.md.
DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
)
