"""Where the ranks of the "pccl" backend sit: the node of every world rank, and how a
group's members spread over nodes (hierarchical when evenly, flat otherwise).

Nodes come from Slurm's placement where srun started the world (every rank's
SLURM_NODEID), else MPI's shared-memory split; ``MCRDL_RANKS_PER_NODE=k`` (world ranks
``0..k-1`` are node 0, and so on) simulates several nodes on one machine."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..bootstrap import mpi_module
from ..errors import InvalidArgumentError
from ..launch import slurm_step


def node_ids(comm, world_size: int) -> list[int]:
    """Node index of every world rank, nodes numbered in order of their lowest world
    rank: MCRDL_RANKS_PER_NODE=k; else Slurm's node of every rank where srun started
    each rank of `comm` as its task of the same rank (the launch discovery's source:
    mcrdl.launch.slurm_step); else MPI's shared-memory split of `comm`."""
    text = os.environ.get("MCRDL_RANKS_PER_NODE")
    if text:
        try:
            k = int(text)
        except ValueError:
            k = 0
        if k < 1:
            raise InvalidArgumentError(
                f"MCRDL_RANKS_PER_NODE={text!r}: expected a positive integer (ranks per "
                "simulated node)")
        return [r // k for r in range(world_size)]
    step = slurm_step()
    # A step of this world's ranks and size, else None (mpiexec inside an sbatch job
    # inherits the batch step's variables): decided together, from every rank's view.
    mine = (step.node if step is not None and step.rank == comm.Get_rank()
            and step.size == world_size else None)
    keys = comm.allgather(mine)
    if None in keys:
        MPI = mpi_module()
        shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
        keys = comm.allgather(shared.allreduce(comm.Get_rank(), op=MPI.MIN))
        shared.Free()
    order: dict[object, int] = {}
    return [order.setdefault(key, len(order)) for key in keys]


@dataclass(frozen=True)
class Layout:
    """How a group's members sit on nodes: N nodes x L ranks each when even."""

    nodes: int
    per_node: int
    node_of: tuple[int, ...]  # group rank -> node index within the group
    local_of: tuple[int, ...]  # group rank -> local index on its node
    hierarchical: bool

    @classmethod
    def of(cls, ranks: tuple[int, ...], world_nodes: list[int]) -> Layout:
        """The layout of the group of world ranks `ranks` (in group order), given the
        node of every world rank: nodes numbered in order of first appearance, locals
        in group order."""
        order: dict[int, int] = {}
        node_of, local_of, count = [], [], {}
        for r in ranks:
            n = order.setdefault(world_nodes[r], len(order))
            node_of.append(n)
            local_of.append(count.get(n, 0))
            count[n] = count.get(n, 0) + 1
        sizes = set(count.values())
        even = len(sizes) == 1
        per_node = sizes.pop() if even else 0
        hier = even and len(order) > 1 and per_node > 1
        return cls(len(order), per_node, tuple(node_of), tuple(local_of), hier)

    def perm(self) -> list[int]:
        """perm[l * N + j] = group rank of (node j, local l)."""
        out = [0] * len(self.node_of)
        for g, (j, loc) in enumerate(zip(self.node_of, self.local_of, strict=True)):
            out[loc * self.nodes + j] = g
        return out
