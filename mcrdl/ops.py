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


#: Bus bandwidth factor of each operation as a function of the group size n, as
#: nccl-tests computes busbw = algbw * factor (mcrdl-bench and the comm logger).
BUS_FACTORS = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_gatherv": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_to_allv": lambda n: (n - 1) / n,
    "bcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "gather": lambda n: (n - 1) / n,
    "gatherv": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "scatterv": lambda n: (n - 1) / n,
    "barrier": lambda n: 0.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}

#: Bytes of a call in the tuning table's convention (mcrdl.bench's size column): the
#: largest buffer one rank touches. ``args`` are the Backend method's arguments (group
#: and async_op last), ``g`` the group size. Used by "auto" and the comm logger.
CALL_BYTES = {
    "all_reduce": lambda a, g: a[0].nbytes,
    "reduce": lambda a, g: a[0].nbytes,
    "bcast": lambda a, g: a[0].nbytes,
    "all_gather": lambda a, g: a[1].nbytes * g,
    "gather": lambda a, g: a[1].nbytes * g,
    "scatter": lambda a, g: a[0].nbytes * g,
    "reduce_scatter": lambda a, g: a[0].nbytes * g,
    "all_to_all_single": lambda a, g: a[1].nbytes,
    "all_to_all": lambda a, g: sum(t.nbytes for t in a[1]),
    "gatherv": lambda a, g: sum(a[2]) * a[1].element_size(),
    "scatterv": lambda a, g: sum(a[2]) * a[0].element_size(),
    "all_gatherv": lambda a, g: sum(a[2]) * a[1].element_size(),
    "all_to_allv": lambda a, g: a[1].nbytes,
    "send": lambda a, g: a[0].nbytes,
    "recv": lambda a, g: a[0].nbytes,
    "barrier": lambda a, g: 0,
}
