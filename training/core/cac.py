"""CAC, communication-aware activation checkpointing (DeepSpeed-TED, dissertation ch. 7).

:func:`checkpointed` runs a segment under torch's non-reentrant activation
checkpointing; with ``cac=True`` a :class:`CommStash` records the output of every
forward collective of the segment's first forward and returns them, in order, when the
backward pass recomputes the segment, so the recomputation moves no data (TED's
debug_checks, off by default, still run their checks there). Backward collectives are
never stashed (they run once either way).

Layers opt in by issuing each *forward, blocking* collective through
:func:`through_stash` (the TED collectives of training/ted/autograd_collectives.py and the 4D
engine's ``AxisComm``). The contract for a caller: use the returned tensor, never the
input it reduced in place, since a replayed call writes nothing. The recomputation must
issue the same collectives in the same order as the first forward; the stash checks
the operation of each and raises otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


class CommStash:
    """Outputs of a checkpointed segment's forward collectives: recorded in its first
    forward, replayed in order by its recomputation (module docstring)."""

    def __init__(self):
        self.saved: list[tuple[str, torch.Tensor | None]] = []
        self.replaying = False
        self.position = 0

    def run(self, op: str, move: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`move()`'s result, recorded; or in the recomputation the recorded result."""
        if not self.replaying:
            out = move()
            self.saved.append((op, out.detach()))
            return out
        if self.position >= len(self.saved):
            raise RuntimeError(f"CAC: the recomputation issued a {op} the first forward "
                               "did not; the segment is not deterministic")
        have_op, out = self.saved[self.position]
        if have_op != op:
            raise RuntimeError(f"CAC: the recomputation issued a {op} where the first "
                               f"forward issued a {have_op}")
        self.saved[self.position] = (have_op, None)  # release it with its last use
        self.position += 1
        return out


_stash: CommStash | None = None  # the stash of the segment running now, if any


def through_stash(op: str, move: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`move()` (a forward collective named `op`, returning its result), through the
    running segment's stash if any."""
    return move() if _stash is None else _stash.run(op, move)


def checkpointed(fn: Callable, *args, cac: bool = False, early_stop: bool = True):
    """``fn(*args)`` under non-reentrant activation checkpointing; with `cac`, its
    forward collectives are stashed and not repeated by the recomputation.
    `early_stop=False` makes torch recompute the whole segment (the call-count baseline
    of the CAC tests: with early stop, torch skips the segment's tail)."""
    stash = CommStash() if cac else None

    def body(*inner):
        global _stash
        outer, _stash = _stash, stash
        try:
            out = fn(*inner)
        finally:
            _stash = outer
        if stash is not None:
            stash.replaying = True  # the next run of this body is the recomputation
        return out

    return checkpoint(body, *args, use_reentrant=False, early_stop=early_stop)
