"""pccl after something went wrong (run under mpiexec -n 4 with MCRDL_RANKS_PER_NODE=2,
a hierarchical 2 x 2 world; tests/test_pccl.py checks what each rank prints):

- timeouts: a second mcrdl.init with another timeout reaches every C++ communicator of
  the backend, the inter-node one of a hierarchical group's delegated phases included,
  and groups made later start with it.
- a failed op: ranks 0 and 1 pass different counts to a ring all_gather of their own
  group, so rank 1's receive is truncated (MPI_ERR_TRUNCATE). On rank 1 the async op
  posted behind it fails as soon as it does, with its error, and a later call is refused
  at once: neither waits out the timeout on an op that will never finish. Other
  communicators (the world) still work on every rank.
- a timed-out op: rank 0 never joins an all_gather of ranks 0 and 1; on rank 1 its wait
  raises CommTimeoutError after the (2 s) timeout, which fails the backend's lane, and
  the async op queued behind it fails as soon as it is waited, not after its own.
"""

import os
import time

import torch

import mcrdl
from mcrdl.backends.pccl import initialized, use_algorithms

FIRST, SECOND, LAST = 60.0, 7.5, 2.0


def say(rank: int, text: str) -> None:
    os.write(1, f"rank {rank}: {text}\n".encode())


def timeouts(rank: int) -> None:
    b = initialized()
    before = sorted({c.timeout for c in b._cpp_comms()})
    inter = len(b._hier)
    mcrdl.init(["pccl"], timeout=SECOND)
    after = sorted({c.timeout for c in b._cpp_comms()})
    mcrdl.new_group([1, 0, 3, 2])  # hierarchical too: its delegated phases' comm as well
    made = sorted({c.timeout for c in b._cpp_comms()})
    say(rank, f"timeouts before={before} after={after} hierarchical={inter}, later "
        f"{len(b._hier)} after_new_group={made}")


def outcomes(rank: int, prefix: str, calls) -> None:
    """Run each (name, call) in turn; say how it ended, and after how long."""
    start = time.monotonic()
    for name, call in calls:
        try:
            call()
            say(rank, f"{prefix}{name} op completed (unexpected)")
        except mcrdl.MCRDLError as e:
            say(rank, f"{prefix}{name} op raised {type(e).__name__} after "
                f"{time.monotonic() - start:.2f} s: {e}")
        start = time.monotonic()


def failed_op(rank: int) -> None:
    g = mcrdl.new_group([0, 1])
    if rank in (0, 1):
        n = 4 if rank == 0 else 2  # rank 1's block is too small for rank 0's message

        def gather(async_op: bool):
            return mcrdl.all_gather("pccl", torch.empty(2 * n), torch.ones(n), group=g,
                                    async_op=async_op)

        with use_algorithms("ring", "ring"):
            first = gather(True)
            if rank == 0:
                first.wait()  # rank 1's shorter message fits: this side completes
                say(rank, "first op completed")
            else:
                try:  # usually queued behind the first; refused if that failed already
                    behind = gather(True).wait
                except mcrdl.MCRDLError as e:
                    def behind(refused=e):
                        raise refused
                outcomes(rank, "", (("first", first.wait), ("behind", behind),
                                    ("later", lambda: gather(False))))
    x = torch.full((3,), float(rank))
    mcrdl.all_reduce("pccl", x)
    say(rank, f"world all_reduce ok={torch.equal(x, torch.full((3,), 6.0))}")


def timed_out_op(rank: int) -> None:
    g = mcrdl.new_group([0, 1])
    mcrdl.init(["pccl"], timeout=LAST)
    if rank != 1:
        return  # rank 0 never joins
    with use_algorithms("ring", "ring"):
        first, behind = (mcrdl.all_gather("pccl", torch.empty(4), torch.ones(2), group=g,
                                          async_op=True) for _ in range(2))
        outcomes(rank, "timed-out ", (("first", first.wait), ("behind", behind.wait)))


mcrdl.init(["pccl"], timeout=FIRST)
me = mcrdl.get_rank()
timeouts(me)
failed_op(me)
timed_out_op(me)  # last: the pccl backend is unusable after it on rank 1
mcrdl.finalize()
say(me, "finalized")
