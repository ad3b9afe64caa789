"""Debug mode (run with MCRDL_DEBUG=1 under mpiexec -n N, N >= 2): mismatched calls
raise DesyncError on EVERY rank with a table of each rank's view; a mismatched call is
never sent, so the backend stays usable afterwards (checked after each case). Each case
runs on a fresh init. BACKENDS is a comma-separated list, run in turn.
Usage: desync.py BACKENDS"""

import functools
import os
import sys

import torch

import mcrdl

assert os.environ.get("MCRDL_DEBUG") == "1"


def expect_desync(backend, name, call, what):
    mcrdl.init([backend], timeout=20)
    rank = mcrdl.get_rank()
    mcrdl.all_reduce(backend, torch.ones(2))  # agreeing calls pass the check
    try:
        call(rank, mcrdl.get_size())
        raise AssertionError(f"{name}: no DesyncError on rank {rank}")
    except mcrdl.DesyncError as e:
        msg = str(e)
        assert what in msg and "rank" in msg, (name, msg)
        if rank == 0:
            print(f"--- {name} ---\n{msg}", flush=True)
    t = torch.ones(3)
    mcrdl.all_reduce(backend, t)  # still usable: the mismatched call was never sent
    assert torch.all(t == mcrdl.get_size()), t
    mcrdl.finalize()
    print(f"rank {rank}: {backend}: {name}: DesyncError raised", flush=True)


def local_error(backend, r, n):  # rank 1's arguments are rejected before anything is sent
    if r == 1:
        try:
            mcrdl.all_reduce(backend, torch.ones(4, 2).t())  # non-contiguous
        except mcrdl.InvalidArgumentError:
            raise mcrdl.DesyncError("rank 1 raised locally: rejected their arguments") from None
    else:
        mcrdl.all_reduce(backend, torch.ones(8))


def cases(backend: str) -> None:
    expect_desync(backend, "count", lambda r, n: mcrdl.all_reduce(
        backend, torch.ones(4 + (r == 1))), "element count")
    expect_desync(backend, "dtype", lambda r, n: mcrdl.all_reduce(
        backend, torch.ones(4, dtype=torch.float64 if r == 1 else torch.float32)), "dtype")
    expect_desync(backend, "root", lambda r, n: mcrdl.bcast(
        backend, torch.ones(4), src=min(r, 1)), "root")
    expect_desync(backend, "reduce op", lambda r, n: mcrdl.all_reduce(
        backend, torch.ones(3), op=mcrdl.ReduceOp.MAX if r == 0 else mcrdl.ReduceOp.SUM),
        "reduce op")
    expect_desync(backend, "split sizes", lambda r, n: mcrdl.all_to_all_single(
        backend, torch.empty(n + (r == 0)), torch.ones(n),
        output_split_sizes=[1 + (r == 0 and i == 1) for i in range(n)]), "counts")
    expect_desync(backend, "async wait", lambda r, n: mcrdl.all_gather(
        backend, torch.empty(n * (2 + (r == 1))), torch.ones(2 + (r == 1)),
        async_op=True).wait(), "element count")
    expect_desync(backend, "local error", functools.partial(local_error, backend),
                  "rejected their arguments")


for name in sys.argv[1].split(","):
    cases(name)
