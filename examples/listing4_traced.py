"""MCR-DL paper, Listing 4 with communication logging: two backends in flight at once,
and a Chrome trace that shows them overlap.

    mpiexec -n 4 python examples/listing4_traced.py trace.json
    # then open trace.json in https://ui.perfetto.dev (one process per rank, one row per
    # backend lane)

An all_reduce on "mpi" and an all_to_all_single on "gloo" are issued back to back
(different order on odd and even ranks) and waited in opposite orders, a few times.
Rank 0 prints the gathered log summary (counts, bytes, latency, algbw/busbw, straggler
view) and writes the trace of every rank.
"""

import sys

import torch

import mcrdl

path = sys.argv[1] if len(sys.argv) > 1 else "listing4_trace.json"
mcrdl.configure(logging=True)
mcrdl.init(["mpi", "gloo"])
rank, size = mcrdl.get_rank(), mcrdl.get_size()

grads = torch.full((1 << 20,), float(rank))
tokens = torch.arange(size * 4, dtype=torch.float32) + 100 * rank
routed = torch.empty_like(tokens)

for _ in range(3):
    grads.fill_(float(rank))
    if rank % 2 == 0:
        w_ar = mcrdl.all_reduce("mpi", grads, async_op=True)
        w_a2a = mcrdl.all_to_all_single("gloo", routed, tokens, async_op=True)
        w_ar.wait()
        w_a2a.wait()
    else:
        w_a2a = mcrdl.all_to_all_single("gloo", routed, tokens, async_op=True)
        w_ar = mcrdl.all_reduce("mpi", grads, async_op=True)
        w_a2a.wait()
        w_ar.wait()
    assert torch.all(grads == sum(range(size))).item()
    expect = torch.cat([torch.arange(rank * 4, rank * 4 + 4, dtype=torch.float32) + 100 * r
                        for r in range(size)])
    assert torch.equal(routed, expect)

mcrdl.log_summary(gather=True)  # every rank calls it; rank 0 prints
written = mcrdl.export_trace(path, gather=True)
if written:
    print(f"rank {rank}: wrote the trace of {size} ranks to {written}")
print(f"rank {rank}: listing 4 traced, results correct")
mcrdl.finalize()
