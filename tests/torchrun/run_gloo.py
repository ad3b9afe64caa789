"""Runs on every rank under torchrun: no MPI world, so "mpi" is unavailable with a
reason, and "gloo" rendezvouses on torchrun's env:// store (its agent's, or with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 one rank 0 hosts). Usage: run_gloo.py DEBUGS, a
comma-separated list of MCRDL_DEBUG values: each an init/finalize session in turn."""

import os
import sys
import time

import torch

import mcrdl
import mcrdl.api


def session(debug: str) -> None:
    os.environ["MCRDL_DEBUG"] = debug
    avail = mcrdl.available_backends()
    assert avail == ["gloo"], avail
    mcrdl.init()
    assert mcrdl.get_backends() == ["gloo"]
    # this session's debug setting took effect (runtime.bases: the stack below extensions)
    base = mcrdl.api.current_runtime().bases["gloo"]
    assert (type(base).__name__ == "Debugged") == (debug == "1"), type(base)
    # the same object collective in every session: each reads its own session's values
    # (the store outlives a session: torchrun's agent or rank 0 hosts it)
    views = mcrdl.all_gather_object((debug, mcrdl.get_rank()))
    assert views == [(debug, r) for r in range(mcrdl.get_size())], views
    rank, size = mcrdl.get_rank(), mcrdl.get_size()

    try:
        mcrdl.all_reduce("mpi", torch.ones(1))
        raise AssertionError("'mpi' did not raise under torchrun")
    except mcrdl.BackendUnavailableError as e:
        assert "torchrun" in str(e) and "mpiexec" in str(e), e

    t = torch.full((7,), rank + 1, dtype=torch.int64)
    mcrdl.all_reduce("auto", t)
    assert t.tolist() == [size * (size + 1) // 2] * 7, t
    w = mcrdl.all_reduce("auto", torch.ones(2), async_op=True)
    assert w.wait() and w.backend == "gloo"

    counts = [r + 1 for r in range(size)]
    out = torch.empty(sum(counts), dtype=torch.bfloat16)
    mcrdl.all_gatherv("gloo", out, torch.full((rank + 1,), rank, dtype=torch.bfloat16), counts)
    assert out.tolist() == [float(r) for r in range(size) for _ in range(r + 1)], out

    # an async recv polled and waited with a timeout (Gloo's completes only through wait())
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    buf = torch.zeros(5)
    wr = mcrdl.recv("gloo", buf, src=prv, tag=3, async_op=True)
    ws = mcrdl.send("gloo", torch.full((5,), float(rank)), dst=nxt, tag=3, async_op=True)
    deadline = time.monotonic() + 30
    while not wr.is_completed():  # polling (sleeping between polls: ranks share 2 cores)
        assert time.monotonic() < deadline, "polling never completed the recv"
        time.sleep(1e-4)
    assert ws.wait(timeout=30) and buf.eq(float(prv)).all(), buf

    g = mcrdl.new_group(list(reversed(range(size))))
    t = torch.tensor([float(rank)])
    mcrdl.bcast("gloo", t, src=0, group=g)  # group rank 0 is world rank size-1
    assert t.item() == size - 1, t
    mcrdl.finalize()
    store = "agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
    os.write(1, f"rank {rank}: debug {debug}: torchrun gloo OK, {store} store\n".encode())


for debug in sys.argv[1].split(","):
    session(debug)
