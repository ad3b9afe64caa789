"""A user program of mcrdl's documented API (docs/api.md): every operation as documented,
blocking and with ``async_op=True``, groups, object collectives, extensions and errors.

tests/test_typing.py runs pyright and mypy on it (no error expected) and runs it in a
one-rank world: ``python user_program.py [backend]`` (default "mpi"), so the types the
checkers accept are the values the runtime gives (``assert_type`` checks statically,
the ``isinstance`` checks beside it at run time). Works at any world size.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from typing_extensions import assert_type

import mcrdl
from mcrdl import Group, ReduceOp, Work


def waited(work: Work) -> Work:
    """`work` checked to be a Work at run time, then waited (as every async call's is)."""
    assert isinstance(work, Work), type(work)
    assert_type(work.wait(), bool)
    assert_type(work.is_completed(), bool)
    assert_type(work.backend, str)
    return work


def operations(backend: str, group: Group | None) -> None:
    """Every operation of docs/api.md "Operations", in its documented forms."""
    size = mcrdl.get_size(backend, group)
    rank = mcrdl.get_rank(backend, group)
    n = 4
    t = torch.ones(n)

    mcrdl.all_reduce(backend, t)
    mcrdl.all_reduce(backend, t, op=ReduceOp.MAX, group=group)
    mcrdl.all_reduce(backend, t, dist.ReduceOp.SUM)
    waited(assert_type(mcrdl.all_reduce(backend, t, ReduceOp.SUM, group, async_op=True), Work))
    mcrdl.reduce(backend, t, dst=0, op=ReduceOp.PRODUCT, group=group)
    waited(mcrdl.reduce(backend, t, 0, ReduceOp.MIN, async_op=True))
    mcrdl.bcast(backend, t, src=0, group=group)
    mcrdl.broadcast(backend, t, 0)
    waited(mcrdl.broadcast(backend, t, async_op=True))

    blocks = torch.empty(size * n)
    block_list = [torch.empty(n) for _ in range(size)]
    mcrdl.all_gather(backend, blocks, t, group=group)
    mcrdl.all_gather(backend, block_list, t, group=group)
    waited(mcrdl.all_gather(backend, blocks, t, group=group, async_op=True))
    mcrdl.gather(backend, blocks if rank == 0 else None, t, dst=0, group=group)
    waited(mcrdl.gather(backend, block_list, t, group=group, async_op=True))
    mcrdl.scatter(backend, t, blocks if rank == 0 else None, src=0, group=group)
    waited(mcrdl.scatter(backend, t, tuple(block_list), group=group, async_op=True))
    mcrdl.reduce_scatter(backend, t, blocks, op=ReduceOp.SUM, group=group)
    waited(mcrdl.reduce_scatter(backend, t, block_list, group=group, async_op=True))

    out = torch.empty(size * n)
    mcrdl.all_to_all_single(backend, out, blocks, group=group)
    splits = [n] * size
    waited(mcrdl.all_to_all_single(backend, out, blocks, output_split_sizes=splits,
                                   input_split_sizes=splits, group=group, async_op=True))
    mcrdl.all_to_all(backend, [torch.empty(n) for _ in range(size)], block_list, group=group)
    waited(mcrdl.all_to_all(backend, block_list, [torch.ones(n)] * size, group=group,
                            async_op=True))

    counts = [rank_ + 1 for rank_ in range(size)]  # elements from group rank i
    total = sum(counts)
    mine = torch.ones(rank + 1)
    vector = torch.empty(total)
    mcrdl.gatherv(backend, vector if rank == 0 else None, mine, counts, dst=0, group=group)
    waited(mcrdl.gatherv(backend, vector if rank == 0 else None, mine, counts,
                         displs=None, group=group, async_op=True))
    mcrdl.scatterv(backend, mine, vector if rank == 0 else None, counts, src=0, group=group)
    waited(mcrdl.scatterv(backend, mine, vector, torch.tensor(counts), group=group,
                          async_op=True))
    mcrdl.all_gatherv(backend, vector, mine, counts, group=group)
    displs = [sum(counts[:i]) for i in range(size)]
    waited(mcrdl.all_gatherv(backend, vector, mine, counts, displs, group=group,
                             async_op=True))
    ones = [1] * size
    mcrdl.all_to_allv(backend, torch.empty(size), torch.ones(size), ones, ones, group=group)
    waited(mcrdl.all_to_allv(backend, torch.empty(size), torch.ones(size), send_counts=ones,
                             recv_counts=ones, send_displs=None, recv_displs=None,
                             group=group, async_op=True))

    # A ring: send to the next rank, receive from the previous one (itself in one rank).
    received = torch.empty(n)
    sent = mcrdl.send(backend, t, (rank + 1) % size, tag=7, group=group, async_op=True)
    mcrdl.recv(backend, received, src=(rank - 1) % size, tag=7, group=group)
    waited(sent)
    pending = mcrdl.recv(backend, received, (rank - 1) % size, group=group, async_op=True)
    mcrdl.send(backend, t, dst=(rank + 1) % size, group=group)
    waited(pending)

    mcrdl.barrier(backend, group=group)
    assert mcrdl.barrier(backend, group, async_op=True).wait(timeout=60.0)


def main(backend: str) -> None:
    assert_type(mcrdl.available_backends(), list[str])
    mcrdl.init([backend], timeout=120.0)
    assert_type(mcrdl.is_initialized(), bool)
    assert_type(mcrdl.get_backends(), list[str])
    world = mcrdl.get_world_size()
    group: Group = mcrdl.new_group(list(range(world)))
    assert_type(group.ranks, tuple[int, ...])
    assert_type(group.rank, int)

    operations(backend, None)
    operations("auto", group)
    mcrdl.synchronize()
    mcrdl.synchronize(backend)

    views = mcrdl.all_gather_object({"rank": group.rank}, group=group)
    assert_type(views, list)
    assert len(views) == group.size
    assert mcrdl.broadcast_object("config", src=0) == "config"

    with mcrdl.extensions(logging=True):
        mcrdl.all_reduce(backend, torch.ones(8))
        records = mcrdl.log_summary(quiet=True)
        assert_type(records, list[dict])
    mcrdl.configure(fusion=mcrdl.FusionConfig(), logging=False)
    waited(mcrdl.all_reduce(backend, torch.ones(8), async_op=True))
    mcrdl.configure(fusion=False)

    try:
        mcrdl.all_reduce("no-such-backend", torch.ones(1))
    except mcrdl.BackendUnavailableError as exc:
        assert "no-such-backend" in str(exc)
    try:
        mcrdl.all_gatherv(backend, torch.empty(1), torch.ones(1), counts=[2] * world)
    except mcrdl.InvalidArgumentError as exc:
        assert isinstance(exc, ValueError) and isinstance(exc, mcrdl.MCRDLError)
    mcrdl.finalize()
    assert not mcrdl.is_initialized()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mpi")
