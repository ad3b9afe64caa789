"""A refused run says why once per job, in one line, before anything is built.

The validation pass is the options' own (training/core/options.py ``parse_args`` with
the world's size): the rules between the options, between them and the model's shape
and the world's size, then what this node must provide (paths, backends). What follows
from the command line and the world's size is the same on every rank of a launch, so
the launch's rank 0 prints it and every rank exits (training/core/runner.py). What only
some ranks may see (a path missing on one node, a backend another node has, a
``--config`` file of another content there) is gathered here: every rank joins one
object collective on mcrdl's bootstrap, and rank 0 prints each distinct message once
with the ranks it concerns (``error (ranks 3, 7 of 8): ...``), instead of one copy per
rank interleaved. ``MCRDL_DEBUG=1`` adds each refusing rank's traceback.
"""

from __future__ import annotations

import sys
import traceback

import mcrdl
from mcrdl.api import current_runtime
from mcrdl.runtime import debug_enabled


def print_traceback(error: BaseException) -> None:
    """`error`'s traceback on stderr where MCRDL_DEBUG=1 asks for it (developers)."""
    if debug_enabled():
        traceback.print_exception(error, file=sys.stderr)


def describe_ranks(ranks: list[int], size: int) -> str:
    """``rank 3 of 8``, ``ranks 3, 7 of 8``, runs of three or more as ranges:
    ``ranks 0-511, 700 of 1024``."""
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
        else:
            parts.extend(str(r) for r in ranks[i:j + 1])
        i = j + 1
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(parts)} of {size}"


def refusal_lines(messages: list[str | None]) -> list[str]:
    """The lines that report the ranks' `messages` (None: the rank refused nothing): a
    message every rank has as ``error: ...``, others with the ranks that have it, in
    the order of their lowest rank."""
    by_message: dict[str, list[int]] = {}
    for rank, message in enumerate(messages):
        if message is not None:
            by_message.setdefault(message, []).append(rank)
    size = len(messages)
    return [f"error: {m}" if len(ranks) == size else
            f"error ({describe_ranks(ranks, size)}): {m}" for m, ranks in by_message.items()]


def refuse_together(error: Exception | None, timeout: float | None = None) -> bool:
    """Collective over the launch's world (every rank calls it after its validation
    pass): whether any rank refused the run (its `error`). Rank 0 prints the refusals
    once (``refusal_lines``). The ranks meet on mcrdl's bootstrap alone (``mcrdl.init([])``,
    `timeout` bounding the wait): a backend the run names may be the refusal, and the
    run's own init adds its backends afterwards."""
    if current_runtime() is None:
        mcrdl.init([], **({"timeout": timeout} if timeout else {}))
    if error is not None:
        print_traceback(error)
    messages = current_runtime().all_gather_object(
        None if error is None else str(error), None)
    if all(m is None for m in messages):
        return False
    if current_runtime().launch.rank == 0:
        print("\n".join(refusal_lines(messages)), file=sys.stderr, flush=True)
    return True
