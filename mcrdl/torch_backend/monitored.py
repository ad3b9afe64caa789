"""``torch.distributed.monitored_barrier`` on mcrdl process groups.

A monitored barrier is a barrier that says which ranks did not reach it: rank 0 of the
group waits for each other rank's arrival within the timeout, then releases them; a
rank that does not arrive in time is named ("Rank 1 failed to pass monitoredBarrier in
2000 ms"; with ``wait_all_ranks=True`` every one: "Ranks 1, 2 failed ..."), and the
ranks rank 0 does not release say so ("Rank 2 successfully reached monitoredBarrier,
but received errors while waiting for send/recv from rank 0"), with the words of Gloo's
(the only c10d backend that has one). It runs on the group's store, not on a
communication backend: a rank that never arrives then leaves no operation in flight,
so the group (and a later ``destroy_process_group``) keeps working.

torch's ``monitored_barrier`` refuses every backend but Gloo before it reaches the
group; :func:`install` puts a function in front of it that serves mcrdl's groups and
hands every other call to torch's.
"""

from __future__ import annotations

import datetime
import functools
import time

import torch.distributed as dist

KEY = "mcrdl-monitored-barrier"


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


def _arrived(store, key: str, seconds: float) -> bool:
    """Whether `key` is set in `store` within `seconds` (> 0)."""
    try:
        store.wait([key], datetime.timedelta(seconds=seconds))
    except (RuntimeError, dist.DistError):  # DistStoreError: the wait timed out
        return False
    return True


def monitored_barrier(store, where: str, rank: int, size: int, seconds: float,
                      wait_all_ranks: bool) -> None:
    """One monitored barrier of the group whose keys are under `where` in `store`
    (unique per group and call, the same on every rank), as group rank `rank` of
    `size`, waiting at most `seconds` (on rank 0: for each rank, with
    `wait_all_ranks`, else for them all)."""
    if size == 1:
        return
    if rank != 0:
        store.set(f"{where}/arrived/{rank}", b"1")
        if not _arrived(store, f"{where}/released/{rank}", max(seconds, 1e-3)):
            raise RuntimeError(
                f"Rank {rank} successfully reached monitoredBarrier, but received errors "
                f"while waiting for send/recv from rank 0. Please check rank 0 logs for "
                f"faulty rank (mcrdl: rank 0 did not release it within {_ms(seconds)} ms)")
        # each key is deleted by its last reader: a later world on the same store
        # (init_process_group again, its groups numbered again) finds none of them
        store.delete_key(f"{where}/released/{rank}")
        return
    start, failed = time.monotonic(), []
    for peer in range(1, size):
        remaining = seconds if wait_all_ranks else seconds - (time.monotonic() - start)
        if remaining <= 0:
            raise RuntimeError(
                f"Rank 0 timed out in monitoredBarrier after {_ms(seconds)} ms. Ranks "
                f"{', '.join(map(str, range(peer, size)))} were not waited for")
        if not _arrived(store, f"{where}/arrived/{peer}", remaining):
            if not wait_all_ranks:
                raise RuntimeError(f"[Rank 0]: Rank {peer} failed to pass monitoredBarrier "
                                   f"in {_ms(seconds)} ms")
            failed.append(peer)
    if failed:
        raise RuntimeError(f"[Rank 0]: Ranks {', '.join(map(str, failed))} failed to pass "
                           f"monitoredBarrier in {_ms(seconds)} ms")
    for peer in range(1, size):
        store.delete_key(f"{where}/arrived/{peer}")
        store.set(f"{where}/released/{peer}", b"1")


def install(group_class: type) -> None:
    """Put mcrdl's monitored barrier in front of torch's ``monitored_barrier`` (once per
    process): calls on a `group_class` group (the default group when none is given)
    that this rank is a member of go to the group's ``monitored_barrier``; the others,
    non-members' included (torch warns and returns), to torch's."""
    c10d = dist.distributed_c10d
    original = c10d.monitored_barrier
    if getattr(original, "mcrdl_group_class", None) is not None:
        return

    @functools.wraps(original)
    def front(group=None, timeout=None, wait_all_ranks=False):
        pg = group
        if pg is None and c10d.is_initialized():
            pg = c10d._get_default_group()
        if isinstance(pg, group_class) and not c10d._rank_not_in_group(group):
            if isinstance(timeout, (int, float)):
                timeout = datetime.timedelta(seconds=timeout)
            return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
        return original(group, timeout, wait_all_ranks)

    front.mcrdl_group_class = group_class
    c10d.monitored_barrier = dist.monitored_barrier = front
