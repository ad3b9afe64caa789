"""Timeout (run under mpiexec -n N, N >= 2): rank 0 never joins a collective; every
other rank must raise CommTimeoutError (not before the timeout; a ceiling of 10x it
only catches a hang), naming op, backend,
group and sequence number; the backend then refuses calls. BACKENDS is a
comma-separated list: each in turn, in one launch (the others keep working after one
timed out). Outside debug mode the op is async, and a second wait() on its Work
raises the same error: at once on gloo and pccl, after waiting again on mpi. With
"fusion", the calls go through tensor fusion: the round's agreement times out (async
call, waited).
Usage: timeout.py BACKENDS [TIMEOUT_S] [fusion]

Rank 0 stays out until the others are through (idle_rank.py), or (limit + 1) s per
backend."""

import os
import sys
import time

import torch
from idle_rank import done, wait_for_others

import mcrdl

backends = sys.argv[1].split(",")
limit = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
fusion = sys.argv[3:] == ["fusion"]
if fusion:
    mcrdl.configure(fusion=True)
mcrdl.init(backends, timeout=limit)
rank = mcrdl.get_rank()
for backend in backends:
    mcrdl.all_reduce(backend, torch.ones(4))  # a healthy op first: sequence number 1


def one_rank_missing(backend: str) -> None:
    start = time.monotonic()
    debug = os.environ.get("MCRDL_DEBUG") == "1"
    work = None
    try:
        if fusion:  # buffered; the wait posts the round, whose agreement times out
            mcrdl.all_reduce(backend, torch.ones(4), async_op=True).wait()
        elif debug:
            mcrdl.all_reduce(backend, torch.ones(4))
        else:  # async: its Work is waited on again below
            work = mcrdl.all_reduce(backend, torch.ones(4), async_op=True)
            work.wait()
        raise AssertionError(f"all_reduce on {backend} without rank 0 returned")
    except mcrdl.MCRDLError as e:
        took = time.monotonic() - start
        msg, error = str(e), type(e)
        assert took < 10 * limit, took  # a hang guard (test_mixing.py checks not early)
    if error is not mcrdl.CommTimeoutError:
        # Gloo: the other waiting rank's own timeout fired first and its failed op closed
        # their connection (docs/api.md "Work"); test_mixing.py checks that one timed out
        assert backend == "gloo" and "closed by peer" in msg, msg
        print(f"rank {rank}: {backend}: peer closed after {took:.2f} s: {msg}", flush=True)
    else:
        # pccl's all_reduce is one C++ op: it is numbered and named like the others'
        parts = (("never called it", "world rank(s) [0]", "sequence number 2") if debug
                 else ("sequence number",) if fusion else ("sequence number 2",))
        assert msg.startswith("all_reduce on backend") or fusion or debug, msg
        for part in ("all_reduce", f"'{backend}'", "world", *parts):
            assert part in msg, (part, msg)
        print(f"rank {rank}: {backend}: CommTimeoutError after {took:.2f} s "
              f"(timeout {limit} s): {msg}", flush=True)
    if work is not None:  # a second wait raises the same error (docs/api.md "Work")
        start = time.monotonic()
        try:
            work.wait()
            raise AssertionError(f"a second wait on {backend} returned")
        except mcrdl.MCRDLError as e:
            again = time.monotonic() - start
            assert type(e) is error and str(e) == msg, (msg, str(e))
            if backend == "mpi":  # still in flight: it waits again, and could complete
                assert limit <= again < 10 * limit and not work.is_completed(), again
            else:  # failed for good: at once, not after waiting out another timeout
                assert again < limit and work.is_completed(), again
            print(f"rank {rank}: {backend}: second wait raised again after {again:.3f} s",
                  flush=True)
    try:  # the backend is unusable after a timeout: say so instead of mismatching ops
        mcrdl.all_reduce(backend, torch.ones(4))
        raise AssertionError(f"op on {backend} after a timeout did not raise")
    except mcrdl.MCRDLError as e:
        print(f"rank {rank}: {backend}: next op refused: {type(e).__name__}", flush=True)


if rank != 0:
    for backend in backends:
        one_rank_missing(backend)
    done(rank)
else:  # past the others' deadlines (limit + 5 s a backend) at most
    wait_for_others(mcrdl.get_size() - 1, (limit + 5) * len(backends),
                    (limit + 1) * len(backends))
    print("rank 0: skipped the collectives", flush=True)
mcrdl.finalize()
print(f"rank {rank}: finalized", flush=True)
