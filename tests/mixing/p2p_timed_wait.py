"""Timed waits and polls of async send/recv (run under mpiexec -n N, N >= 2).

Rank 1 posts a recv of a message rank 0 only sends once rank 1's ``wait(timeout)`` has
raised CommTimeoutError (the ranks line up on an mpi4py barrier of their own, not on a
delay): the op stays pending; ``is_completed()`` polled alone, and a later
``wait(timeout)``, complete it once the data is there (well before the timeout), with
the right values; the same with the send posted before its receiver comes; the backend
stays usable (a collective afterwards). Gloo's send/recv report completion
only through a plain wait, which mcrdl runs on a thread for timed waits and polls.
BACKENDS is a comma-separated list, checked in turn in one init.
Usage: p2p_timed_wait.py BACKENDS"""

import sys
import time

import torch

import mcrdl
from mcrdl.bootstrap import mpi_module

backends = sys.argv[1].split(",")
mcrdl.init(backends, timeout=30)
rank, size = mcrdl.get_rank(), mcrdl.get_size()
harness = mpi_module().COMM_WORLD.Dup()  # orders the ranks' steps, independently of mcrdl
WAIT_S = 60.0  # the completing wait's timeout: it must return long before


def expect_timeout(w, what: str) -> None:
    start = time.monotonic()
    try:
        w.wait(timeout=0.2)
        raise AssertionError(f"{what}: wait(timeout=0.2) returned before the peer was there")
    except mcrdl.CommTimeoutError:
        took = time.monotonic() - start
        assert 0.2 * 0.99 <= took < 10 * 0.2, (what, took)  # not early; a hang guard
    assert not w.is_completed(), what  # still pending: completed below


def complete_by(w, how: str, what: str) -> float:
    start = time.monotonic()
    if how == "poll":
        while not w.is_completed():
            assert time.monotonic() - start < WAIT_S, f"{what}: polling never completed it"
            time.sleep(1e-3)
    else:
        assert w.wait(timeout=WAIT_S)
    took = time.monotonic() - start
    assert took < WAIT_S / 2, (what, how, took)  # done when the data came, not at timeout
    return took


def check(backend: str) -> None:
    for k, how in enumerate(("wait", "poll")):
        tag = 10 + k
        if rank == 1:
            buf = torch.zeros(64)
            w = mcrdl.recv(backend, buf, src=0, tag=tag, async_op=True)
            expect_timeout(w, f"recv ({how})")
            harness.Barrier()  # rank 0 sends only now
            took = complete_by(w, how, f"recv ({how})")
            assert buf.eq(7.0 + k).all(), buf
            print(f"rank 1: recv completed by {how} after {took:.2f} s", flush=True)
        elif rank == 0:
            harness.Barrier()  # rank 1's timed wait is over
            w = mcrdl.send(backend, torch.full((64,), 7.0 + k), dst=1, tag=tag, async_op=True)
            complete_by(w, how, f"send ({how})")
        else:
            harness.Barrier()
        # the other way round: the send is posted first and its receiver comes after
        if rank == 0:
            w = mcrdl.send(backend, torch.full((16,), 3.0 + k), dst=1, tag=tag + 50,
                           async_op=True)
            harness.Barrier()  # posted: rank 1 may receive
            complete_by(w, how, f"early send ({how})")
        elif rank == 1:
            harness.Barrier()
            buf = torch.zeros(16)
            mcrdl.recv(backend, buf, src=0, tag=tag + 50)
            assert buf.eq(3.0 + k).all(), buf
        else:
            harness.Barrier()

    t = torch.full((4,), float(rank))
    mcrdl.all_reduce(backend, t)  # the process group survived the timed-out waits
    assert t.eq(float(sum(range(size)))).all(), t
    print(f"rank {rank}: p2p timed waits OK on {backend}", flush=True)


for backend in backends:
    check(backend)
harness.Free()
mcrdl.finalize()
