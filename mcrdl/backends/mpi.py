"""The "mpi" backend: mpi4py communicators, operations in C++ (mcrdl._C.MpiComm).

Each op is one nonblocking MPI call on a communicator owned by this backend (a Dup of
the world, or a Split per group), posted from the caller's thread in issue order.
Blocking ops are driven to completion by the caller under the timeout; async ops by
the backend's lane thread, so they progress while the caller computes or waits on
another backend. CPU tensors are used in place (zero-copy).
"""

from __future__ import annotations

import os

from .. import _C
from ..bootstrap import mpi_module
from ..groups import Group, bad_group_error
from ..launch import usable_cores
from .base import Backend, Capabilities, InitContext


def poll_spins(ranks_on_node: int) -> int:
    """Polls before yielding: spin when this node's ranks fit its cores, else yield at once
    (MCRDL_POLL_SPINS overrides). See csrc/lane.cpp for the measurements."""
    if os.environ.get("MCRDL_POLL_SPINS"):
        return int(os.environ["MCRDL_POLL_SPINS"])
    return 64 if ranks_on_node <= usable_cores() else 0


def idle_sleep(ranks_on_node: int) -> bool:
    """Whether waiters sleep after 100 us without progress (instead of yielding until done)
    and idle lane threads in slices growing to 1 ms (instead of 50 us): when this node's
    ranks outnumber its cores, a rank waiting for busy peers must leave them the cores
    (MCRDL_IDLE_SLEEP=0/1 overrides). See csrc/lane.cpp (Backoff) for the policy and its
    measurements."""
    v = os.environ.get("MCRDL_IDLE_SLEEP", "")
    if v:
        if v not in ("0", "1"):
            raise ValueError(f"MCRDL_IDLE_SLEEP must be 0 or 1, got {v!r}")
        return v == "1"
    return ranks_on_node > usable_cores()


class MPILaneBackend(Backend):
    """What the backends whose ops run in mcrdl._C over mpi4py communicators share
    ("mpi", "cray-mpich", "pccl"): the MPI checks, the lane, one C++ communicator per
    group in ``self._comms`` (the world under id 0), timeouts, failure, synchronize."""

    @classmethod
    def availability(cls, launch) -> str | None:
        if not launch.mpi_world:
            return launch.why_no_mpi
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return "mpi4py is not installed (pip install mpi4py, plus an MPI such as mpich)"
        return None

    def __init__(self, ctx: InitContext):
        super().__init__(ctx)
        MPI = mpi_module()
        self._MPI = MPI
        linked = _C.mpi_library_version().strip()
        loaded = MPI.Get_library_version().strip()
        if linked != loaded:
            raise RuntimeError(
                "mcrdl._C was built against a different MPI than mpi4py uses:\n"
                f"  mcrdl._C: {linked.splitlines()[0]}\n  mpi4py:   {loaded.splitlines()[0]}\n"
                "rebuild mcrdl (pip install --no-build-isolation .) with the same MPI"
            )
        self.library_version = loaded
        _C.set_poll_spins(poll_spins(ctx.bootstrap.info.local_size))
        _C.set_idle_sleep(idle_sleep(ctx.bootstrap.info.local_size))
        self._lane = _C.Lane(self.name)
        self._comms: dict[int, object] = {}

    def comm(self, group: Group | None):
        try:
            return self._comms[0 if group is None else group.id]
        except (KeyError, AttributeError):
            raise bad_group_error(group) from None

    def set_timeout(self, timeout: float) -> None:
        super().set_timeout(timeout)
        for c in self._comms.values():
            c.set_timeout(timeout)

    def mark_failed(self, why: str) -> None:
        self._lane.fail(why)

    def synchronize(self, timeout: float) -> None:
        self._lane.synchronize(timeout)

    def finalize(self) -> None:
        """Drain and stop the lane; subclasses then free their MPI communicators."""
        self._lane.shutdown(f"the {self.name!r} backend was finalized", self.ctx.timeout)
        self._comms.clear()


class MPIBackend(MPILaneBackend):
    name = "mpi"
    capabilities = Capabilities(
        notes={"float16/bfloat16": "moved as 16-bit words; reduced in float32, rounded once"}
    )
    validates_arguments = True

    def __init__(self, ctx: InitContext):
        super().__init__(ctx)
        self._mpi_comms: dict[int, object] = {}
        self._world = self._make(ctx.world, self._MPI.COMM_WORLD.Dup())

    def _make(self, group: Group, comm) -> _C.MpiComm:
        self._mpi_comms[group.id] = comm
        c = _C.MpiComm(comm.handle, comm.Get_rank(), comm.Get_size(), group.describe(),
                       self._lane, self.ctx.timeout, self.name)
        self._comms[group.id] = c
        return c

    def add_group(self, group: Group) -> None:
        MPI = self._MPI
        world = self._mpi_comms[0]
        color = 0 if group.is_member else MPI.UNDEFINED
        comm = world.Split(color, group.rank if group.is_member else 0)
        if group.is_member:
            self._make(group, comm)

    def finalize(self) -> None:
        super().finalize()
        for comm in self._mpi_comms.values():
            if comm != self._MPI.COMM_NULL:
                comm.Free()
        self._mpi_comms.clear()

    # -- operations: argument handling and validation happen in C++ -------------------
    def all_reduce(self, tensor, op, group, async_op):
        return (self._world if group is None else self.comm(group)).all_reduce(tensor, op, async_op)

    def reduce(self, tensor, dst, op, group, async_op):
        return self.comm(group).reduce(tensor, dst, op, async_op)

    def bcast(self, tensor, src, group, async_op):
        return (self._world if group is None else self.comm(group)).bcast(tensor, src, async_op)

    def all_gather(self, output, input, group, async_op):
        return (self._world if group is None else self.comm(group)).all_gather(output, input,
                                                                                async_op)

    def gather(self, output, input, dst, group, async_op):
        return self.comm(group).gather(output, input, dst, async_op)

    def scatter(self, output, input, src, group, async_op):
        return self.comm(group).scatter(output, input, src, async_op)

    def reduce_scatter(self, output, input, op, group, async_op):
        return self.comm(group).reduce_scatter(output, input, op, async_op)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, group,
                          async_op):
        return (self._world if group is None else self.comm(group)).all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, async_op)

    def all_to_all(self, output_list, input_list, group, async_op):
        return self.comm(group).all_to_all(output_list, input_list, async_op)

    def gatherv(self, output, input, counts, displs, dst, group, async_op):
        return self.comm(group).gatherv(output, input, counts, displs, dst, async_op)

    def scatterv(self, output, input, counts, displs, src, group, async_op):
        return self.comm(group).scatterv(output, input, counts, displs, src, async_op)

    def all_gatherv(self, output, input, counts, displs, group, async_op):
        return self.comm(group).all_gatherv(output, input, counts, displs, async_op)

    def all_to_allv(self, output, input, send_counts, recv_counts, send_displs, recv_displs,
                    group, async_op):
        return self.comm(group).all_to_allv(output, input, send_counts, recv_counts, send_displs,
                                            recv_displs, async_op)

    def send(self, tensor, dst, tag, group, async_op):
        return self.comm(group).send(tensor, dst, tag, async_op)

    def recv(self, tensor, src, tag, group, async_op):
        return self.comm(group).recv(tensor, src, tag, async_op)

    def barrier(self, group, async_op):
        return self.comm(group).barrier(async_op)
