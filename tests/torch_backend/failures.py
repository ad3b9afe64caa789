"""mcrdl's failure behaviour in a torch program on "mcrdl" (run under mpiexec -n 3).

Usage: failures.py debug-and-timeout LIMIT_S | dead-rank LIMIT_S | group-timeouts LIMIT_S

- ``debug-and-timeout`` (MCRDL_DEBUG=1): ``init_process_group(timeout=LIMIT_S)`` becomes
  mcrdl's timeout. A dist.all_reduce whose element count differs on rank 1 raises
  DesyncError on every rank and sends nothing (the next all_reduce is right). Then
  rank 0 never joins an all_reduce: on the others, the future of the async call (what
  a DDP communication hook waits on) raises CommTimeoutError within LIMIT_S + 5 s
  naming the rank that never arrived; the next (blocking) call is refused.
- ``dead-rank``: rank 1 SIGKILLs itself mid-loop; the survivors raise (CommTimeoutError)
  instead of hanging, so the job ends non-zero.
- ``group-timeouts`` (mpiexec -n 2): timeouts of a call or a group, as on Gloo.
  ``barrier(timeout=30 s)`` waits for a rank LIMIT_S + 1.5 s late (past the group's
  timeout); ``barrier(timeout=1 s)`` raises CommTimeoutError after 1 s. A sub-group's
  own timeout (1 s) raises on the rank that waited, and the op's timeout breaks that
  group: its next call raises BackendUnavailableError (the timed-out op is still in
  flight: a later call would pair with the late rank's next one), while the late
  rank's call completes against the op in flight and the world goes on.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import mcrdl

mode, limit = sys.argv[1], float(sys.argv[2])
dist.init_process_group("mcrdl", timeout=datetime.timedelta(seconds=limit))
rank, size = dist.get_rank(), dist.get_world_size()
print(f"rank {rank}: pid {os.getpid()}", flush=True)

if mode == "dead-rank":
    t = torch.ones(1000)
    for it in range(100000):
        if it == 50 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
        t.fill_(1.0)
    print(f"rank {rank}: loop finished, which a dead peer should have made impossible")
    sys.exit(0)

if mode == "group-timeouts":
    assert size == 2, "run with mpiexec -n 2"
    late = limit + 1.5  # how late rank 1 comes, past every timeout below

    def resync():
        dist.barrier(timeout=datetime.timedelta(seconds=60))

    def timed(what, fn, low, exc_type=mcrdl.CommTimeoutError):
        start = time.monotonic()
        try:
            fn()
            raise AssertionError(f"rank {rank}: {what} returned")
        except exc_type as exc:
            took = time.monotonic() - start
            assert low <= took < low + 5, (what, took)
            print(f"rank {rank}: {what}: {type(exc).__name__} after {took:.2f} s: {exc}",
                  flush=True)

    start = time.monotonic()  # a barrier's own timeout, longer than the group's
    if rank == 1:
        time.sleep(late)
    resync()
    print(f"rank {rank}: barrier(timeout=60 s) waited {time.monotonic() - start:.2f} s "
          f"(group timeout {limit:g} s)", flush=True)

    g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    if rank == 0:
        timed("sub-group all_reduce", lambda: dist.all_reduce(torch.ones(2), group=g), 1.0)
        timed("sub-group retry", lambda: dist.all_reduce(torch.ones(2), group=g), 0.0,
              mcrdl.BackendUnavailableError)
    else:
        time.sleep(1 + 1.5)
        t = torch.ones(2)
        dist.all_reduce(t, group=g)  # meets rank 0's op in flight
        assert torch.all(t == 2), t
    resync()
    t = torch.ones(3)
    dist.all_reduce(t)  # the world is not broken by the sub-group's timeout
    assert torch.all(t == 2), t

    if rank == 0:
        timed("barrier(timeout=1 s)",
              lambda: dist.barrier(timeout=datetime.timedelta(seconds=1)), 1.0)
        timed("world after it", lambda: dist.all_reduce(torch.ones(2)), 0.0,
              mcrdl.BackendUnavailableError)
    else:
        time.sleep(1 + 1.5)
        dist.barrier()  # meets rank 0's barrier in flight
    dist.destroy_process_group()
    print(f"rank {rank}: group timeouts OK", flush=True)
    sys.exit(0)

assert mode == "debug-and-timeout" and os.environ.get("MCRDL_DEBUG") == "1"
t = torch.ones(4)
dist.all_reduce(t)
try:
    dist.all_reduce(torch.ones(4 + (rank == 1)))
    raise AssertionError(f"rank {rank}: mismatched all_reduce did not raise")
except mcrdl.DesyncError as exc:
    assert "element count" in str(exc), exc
    print(f"rank {rank}: DesyncError raised", flush=True)
t = torch.ones(3)
dist.all_reduce(t)  # the mismatched call was never sent
assert torch.all(t == size), t

if rank != 0:
    for how in ("future", "blocking"):
        start = time.monotonic()
        try:
            if how == "blocking":
                dist.all_reduce(torch.ones(4))
            else:
                dist.all_reduce(torch.ones(4), async_op=True).get_future().wait()
            raise AssertionError(f"rank {rank}: all_reduce without rank 0 returned")
        except mcrdl.MCRDLError as exc:
            took = time.monotonic() - start
            if how == "future":
                assert isinstance(exc, mcrdl.CommTimeoutError) and isinstance(exc, TimeoutError)
                assert took < limit + 5, took
                assert "never called it" in str(exc) and "[0]" in str(exc), exc
                print(f"rank {rank}: CommTimeoutError after {took:.1f} s (timeout {limit} s)",
                      flush=True)
            else:  # refused: the backend failed with the first timeout
                print(f"rank {rank}: next op refused: {type(exc).__name__}", flush=True)
else:
    time.sleep(limit + 1)
dist.destroy_process_group()
print(f"rank {rank}: finalized", flush=True)
