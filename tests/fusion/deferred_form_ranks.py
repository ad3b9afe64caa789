"""A call deferred behind buffered fused calls reaches the backend exactly as issued
(run on 2 ranks under mpiexec).

Rank 0 issues a blocking all_to_all_single (even splits, none given) while its fusion
queue still holds a buffered async all_reduce, so the call is deferred behind the flush;
rank 1 first waits on its all_reduce (which flushes it), so its call is posted inline.
Whether a call is deferred thus differs between the ranks, as timing makes it differ in
any program. Both ranks must hand the mpi backend the same arguments: with the split
sizes that validation fills in, the deferred call ran MPI_Ialltoallv while the inline
one ran MPI_Alltoall (under MCRDL_MPI_BLOCKING=always), and the job hung until the
timeout. Every rank prints the split sizes the backend received; rank 0 prints
"<mode>: deferred form OK" after checking the results against a formula.

Usage: deferred_form_ranks.py TIMEOUT_S MODES, MODES a comma-separated list of
MCRDL_MPI_BLOCKING values: each an init/finalize session in turn.
"""

from __future__ import annotations

import os
import sys

import torch

import mcrdl
from mcrdl.backends.mpi import MPIBackend
from mcrdl.extensions import FusionConfig

TIMEOUT = float(sys.argv[1])
seen: list[tuple] = []
_a2a = MPIBackend.all_to_all_single


def recording_a2a(self, output, input, output_split_sizes, input_split_sizes, group,
                  async_op):
    seen.append((output_split_sizes, input_split_sizes))
    return _a2a(self, output, input, output_split_sizes, input_split_sizes, group, async_op)


MPIBackend.all_to_all_single = recording_a2a  # before init: the layers bind the method


def session(mode: str) -> None:
    os.environ["MCRDL_MPI_BLOCKING"] = mode
    seen.clear()
    mcrdl.init(["mpi"], timeout=TIMEOUT)
    rank, size = mcrdl.get_rank(), mcrdl.get_size()
    assert size == 2, "run on 2 ranks"

    # No flush by the timer or by size during the test: only the wait on rank 1 and the
    # deferred call on rank 0 flush.
    config = FusionConfig(buffer_bytes=1 << 20, wait_us=60e6)
    x = torch.full((4,), float(rank + 1))
    inp = torch.arange(6, dtype=torch.float32) + 100 * rank
    out = torch.empty(6)
    with mcrdl.extensions(fusion=config):
        w = mcrdl.all_reduce("mpi", x, async_op=True)
        assert not w.posted, "the all_reduce must be buffered"
        if rank == 1:
            w.wait()  # flushes now: this rank's all_to_all_single goes inline
            assert w.posted
        mcrdl.all_to_all_single("mpi", out, inp)  # rank 0: deferred behind the flush
        if rank == 0:
            w.wait()

    print(f"rank {rank}: {mode}: backend got split sizes {seen}", flush=True)
    assert seen == [(None, None)], seen
    assert torch.equal(x, torch.full((4,), 3.0)), x
    expect = torch.tensor([100.0 * r + 3 * rank + k for r in range(2) for k in range(3)])
    assert torch.equal(out, expect), (out, expect)
    mcrdl.barrier("mpi")
    if rank == 0:
        print(f"{mode}: deferred form OK", flush=True)
    mcrdl.finalize()


for mode in sys.argv[2].split(","):
    session(mode)
