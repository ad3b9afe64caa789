"""The rank that stays out of a collective (the timeout scripts' rank 0) waits for the
others through files, not the backends it starves: with $TIMEOUT_DONE_DIR set (a
directory every rank sees, empty at the start), each other rank leaves a file there when
it is through, and the idle rank waits for all of them; without it, a fixed time."""

import os
import time


def done(rank: int) -> None:
    """This rank is through (call it on every rank but the idle one)."""
    where = os.environ.get("TIMEOUT_DONE_DIR")
    if where:
        open(os.path.join(where, str(rank)), "w").close()


def wait_for_others(others: int, longest: float, fixed: float) -> None:
    """Until `others` ranks called done(), at most `longest` s; `fixed` s without the
    directory."""
    where = os.environ.get("TIMEOUT_DONE_DIR")
    if not where:
        time.sleep(fixed)
        return
    deadline = time.monotonic() + longest
    while len(os.listdir(where)) < others and time.monotonic() < deadline:
        time.sleep(0.05)
