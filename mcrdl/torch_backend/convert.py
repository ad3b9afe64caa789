"""c10d's arguments in mcrdl's terms, for the process groups (process_group.py) and their
works (work.py): reduce ops, tensor lists, timeouts, and errors named after the c10d
operation."""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ..errors import InvalidArgumentError, MCRDLError
from ..ops import ReduceOp

_TORCH_SUM, _SUM = dist.ReduceOp.SUM, ReduceOp.SUM
_REDUCE_OPS = {getattr(dist.ReduceOp.RedOpType, op.name).value: op for op in ReduceOp
               if hasattr(dist.ReduceOp.RedOpType, op.name)}


def _ops_by_hash() -> dict[int, ReduceOp]:
    """hash(torch ReduceOp) -> mcrdl ReduceOp, when the hash tells the op apart (torch
    binds ``ReduceOp.__hash__`` to the RedOpType value: one call, where ``==`` converts
    its argument and ``.op`` builds a RedOpType); empty when it does not, and the calls
    go the slow way (:func:`reduce_op`). Checked, not assumed: every op's hash is the
    same on two objects, the hashes differ, and PREMUL_SUM's (which mcrdl refuses, and
    whose object carries a factor) is none of them."""
    kinds = dist.ReduceOp.RedOpType
    pairs = [(getattr(kinds, op.name), op) for op in ReduceOp if hasattr(kinds, op.name)]
    table = {hash(dist.ReduceOp(kind)): op for kind, op in pairs}
    premul = getattr(dist, "_make_nccl_premul_sum", None)
    usable = (len(table) == len(pairs)
              and all(table.get(hash(dist.ReduceOp(kind))) is op and
                      table.get(hash(getattr(dist.ReduceOp, kind.name))) is op
                      for kind, op in pairs)
              and (premul is None or hash(premul(2.0)) not in table))
    return table if usable else {}


#: hash(opts.reduceOp) -> mcrdl ReduceOp (see _ops_by_hash); a miss goes to reduce_op.
BY_HASH = _ops_by_hash()


def reduce_op(op: dist.ReduceOp, where: str) -> ReduceOp:
    """mcrdl's ReduceOp of a torch one (the slow way: the hot paths look
    ``hash(op)`` up in BY_HASH first); raises for ops mcrdl does not have."""
    if op == _TORCH_SUM:
        return _SUM
    kind = op.op
    try:
        return _REDUCE_OPS[kind.value]
    except KeyError:
        raise InvalidArgumentError(
            f"{where}: reduce op {kind.name} has no mcrdl equivalent; mcrdl reduces with "
            f"{', '.join(o.name for o in ReduceOp)} (PREMUL_SUM is NCCL's own)") from None


def op_of(opts, where: str) -> ReduceOp:
    """mcrdl's ReduceOp of ``opts.reduceOp``, read once."""
    op = opts.reduceOp
    try:
        return BY_HASH[hash(op)]
    except KeyError:
        return reduce_op(op, where)


def not_one(tensors: Sequence[torch.Tensor], where: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{where}: mcrdl takes one tensor per call, got a list of {len(tensors)} (torch's "
        "multi-tensor form is for several devices per process); call once per tensor")


def single(tensors: Sequence[torch.Tensor], where: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise not_one(tensors, where)
    return tensors[0]


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a contiguous tensor; others as they are, for mcrdl to refuse."""
    return t.view(-1) if t.is_contiguous() else t


def timeout_seconds(timeout: object) -> float | None:
    """A c10d timeout (timedelta; zero means none given) in seconds, or None."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
        else float(timeout)
    return seconds if seconds > 0 else None


def explicit_timeout(timeout: datetime.timedelta | None) -> float | None:
    """Seconds of a timeout torch passes to a backend, None when it is torch's default:
    init_process_group and new_group always pass one, so a timeout equal to the default
    (30 min) counts as not given and mcrdl's own ($MCRDL_TIMEOUT, else 300 s) applies."""
    if timeout is None or timeout == default_pg_timeout:
        return None
    return timeout.total_seconds()


def c10d_error(exc: MCRDLError, family: str, backend: str) -> MCRDLError:
    """`exc` of the same class, its message led by the c10d operation and the route."""
    return type(exc)(f"torch.distributed {family} on mcrdl backend '{backend}': {exc}")
