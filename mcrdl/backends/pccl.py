"""The "pccl" backend: hierarchical two-level all_gather, reduce_scatter and all_reduce
(the PCCL paper), with the algorithms in C++ (``mcrdl._C.PcclComm``, csrc/pccl.cpp).

Nodes and group layouts are ``pccl_layout``'s (MPI's shared-memory split, or
``MCRDL_RANKS_PER_NODE=k`` to simulate several nodes on one machine). For each group
whose members spread evenly over N > 1 nodes with L > 1 ranks each, the backend builds
an intra-node communicator (this node's members) and an inter-node one (the members
with this rank's local index, one per node); every inter-node group runs its phase
concurrently with the others. Groups that are not even (say 5 ranks as 2 + 2 + 1) or
sit on one node run the inter-node algorithm over the whole group (flat).

  all_gather:     inter-node phase, intra-node phase, local shuffle
  reduce_scatter: local pre-shuffle, intra-node phase, inter-node phase
  all_reduce:     reduce_scatter + all_gather (the tensor padded to a multiple of the
                  group size), one C++ op: one sequence number, and a timeout names it

Algorithms (per phase): "ring", "rd" (recursive doubling / halving; any process count:
the extra ranks fold in before and out after) and "mpi" (the MPI library's collective:
its blocking or its nonblocking call, chosen per phase size and bytes as the "mpi"
backend chooses, MCRDL_MPI_BLOCKING included; blocking steps of async ops run on the
communicator's issue thread).
The inter-node one is chosen per call by the alpha-beta cost model of
``pccl_cost_model`` ("auto", the default), or fixed with ``MCRDL_PCCL_INTER=ring|rd|mpi``;
the intra-node one is "mpi" (the vendor library's role on CPU) unless
``MCRDL_PCCL_INTRA=ring|rd``. Both can be changed at run time with
:func:`use_algorithms`.

Every dtype of docs/api.md: bool reduces as uint8 0/1 (SUM/MAX = or, PRODUCT/MIN = and),
float16/bfloat16 reduce in float32 and round once, AVG is SUM then a division. Other
operations raise UnsupportedOperationError naming the backends that have them. CPU
tensors only (MPI point-to-point on GPU memory needs a CUDA-aware MPI, not assumed).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from .. import _C
from ..errors import BackendUnavailableError, InvalidArgumentError
from ..groups import Group
from ..ops import HALF_DTYPES, ReduceOp, reduce_plan
from ..ordering import IssueQueue
from ..work import ChainedWork
from .base import Capabilities, InitContext
from .mpi import MPILaneBackend, blocking_steps, step_codes
from .pccl_cost_model import CostModel
from .pccl_layout import Layout, node_ids

ALGORITHMS = ("ring", "rd", "mpi")
# Backends that can run the intra-node phase instead of pccl's C++ over MPI (their
# groups are created by the members alone, so pccl makes the node groups at first use).
# nccl/rccl would take GPU tensors, which the inter-node phase over MPI does not accept.
INTRA_BACKENDS = ("gloo",)
INTRA_CHOICES = (*ALGORITHMS, *INTRA_BACKENDS)


def _algo_env(var: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(var, default)
    if value not in allowed:
        raise InvalidArgumentError(f"{var}={value!r}: expected one of {', '.join(allowed)}")
    return value


@dataclass
class _Hier:
    """What a hierarchical group needs for a delegate intra-node phase: a C++ communicator
    over the inter-node ranks alone (its own Dup, so its tags never meet the hierarchical
    communicator's), the node's group (created on the delegate at first use), the
    [local][node] permutation and the sequencer of staged ops."""

    inter: object  # _C.PcclComm, flat over this rank's inter-node communicator
    node_group: Group
    perm: torch.Tensor  # perm[l * N + j] = group rank of (node j, local l)
    nodes: int
    per_node: int
    queue: IssueQueue  # the group's staged ops, posted in issue order
    made_on: set


class PCCLBackend(MPILaneBackend):
    name = "pccl"
    capabilities = Capabilities(
        notes={"layout": "hierarchical on even node layouts, flat otherwise",
               "float16/bfloat16": "reduced in float32, rounded once"},
    )

    @classmethod
    def availability(cls, launch) -> str | None:
        why = super().availability(launch)
        if why and not launch.mpi_world:
            return "needs an MPI world for its point-to-point phases: " + why
        return why

    _current: weakref.ref | None = None  # the initialized instance (one per process)

    @classmethod
    def current(cls) -> PCCLBackend | None:
        """The initialized "pccl" backend of this process, or None."""
        return cls._current() if cls._current is not None else None

    def __init__(self, ctx: InitContext):
        super().__init__(ctx)
        PCCLBackend._current = weakref.ref(self)
        self._base = self._MPI.COMM_WORLD.Dup()
        self.world_nodes = node_ids(self._base, self._base.Get_size())
        self.model = CostModel.from_env()
        self.inter_algo = _algo_env("MCRDL_PCCL_INTER", "auto", (*ALGORITHMS, "auto"))
        self.intra_algo = _algo_env("MCRDL_PCCL_INTRA", "mpi", INTRA_CHOICES)
        self._mpi_comms: list = []
        self.layouts: dict[int, Layout] = {}
        self._hier: dict[int, _Hier] = {}
        self._chained: list[ChainedWork] = []  # see _chain
        self._chained_lock = threading.Lock()
        self._make(ctx.world)

    # -- communicators ----------------------------------------------------------------
    def _split(self, color, key):
        c = self._base.Split(self._MPI.UNDEFINED if color is None else color, key)
        if c != self._MPI.COMM_NULL:
            self._mpi_comms.append(c)
            return c
        return None

    def _make(self, group: Group) -> None:
        lay = Layout.of(group.ranks, self.world_nodes)
        me = group.rank if group.is_member else -1
        if lay.hierarchical:
            # intra rank = local index (locals count in group order); inter rank = node
            # index (keyed by it: in a group like [0, 2, 3, 1] on 2 nodes x 2 the second
            # locals appear node 1 first, and the C++ places blocks by inter rank)
            intra = self._split(lay.node_of[me] if me >= 0 else None, me)
            inter = self._split(lay.local_of[me] if me >= 0 else None,
                                lay.node_of[me] if me >= 0 else 0)
        else:
            intra, inter = None, self._split(0 if me >= 0 else None, me)
        if me < 0:
            return
        self.layouts[group.id] = lay
        timeout = self.ctx.timeout
        if intra is None:
            c = _C.PcclComm(inter.handle, inter.Get_rank(), inter.Get_size(), 0, 0, 1, [],
                            group.describe(), self._lane, timeout)
        else:
            c = _C.PcclComm(inter.handle, inter.Get_rank(), inter.Get_size(), intra.handle,
                            intra.Get_rank(), intra.Get_size(), lay.perm(), group.describe(),
                            self._lane, timeout)
            # Dup'ed here, not at first delegated use: an op whose inter phase is the MPI
            # library's collective posts it on the lane when its turn comes, so a Dup
            # from the caller's thread could enter the collective order at different
            # points on different ranks
            alone = inter.Dup()
            self._mpi_comms.append(alone)
            node = lay.node_of[me]
            members = [group.ranks[g] for g in range(group.size) if lay.node_of[g] == node]
            self._hier[group.id] = _Hier(
                inter=_C.PcclComm(alone.handle, alone.Get_rank(), alone.Get_size(), 0, 0, 1,
                                  [], group.describe() + " (inter-node)", self._lane, timeout),
                # a deterministic id no mcrdl.new_group gives: negative, one per node
                node_group=Group(members, self.ctx.bootstrap.rank,
                                 -(group.id * 100_003 + node + 1)),
                perm=torch.tensor(lay.perm(), dtype=torch.long), nodes=lay.nodes,
                per_node=lay.per_node, made_on=set(),
                queue=IssueQueue(f"pccl group {group.describe()}", lambda: self.ctx.timeout))
        self._comms[group.id] = c
        for comm in (c, self._hier[group.id].inter) if group.id in self._hier else (c,):
            self._choose_blocking(comm)

    # -- the "mpi" algorithm's blocking variant ----------------------------------------
    def _cpp_comms(self):  # the inter-node phases of hierarchical groups' delegated ops too
        return [*self._comms.values(), *(h.inter for h in self._hier.values())]

    def _choose_blocking(self, c: _C.PcclComm) -> None:
        """Which variant the "mpi" algorithm's MPI collectives run in each phase of `c`:
        the "mpi" backend's choice for that op, phase size and buffer (blocking_steps, the
        tuning table's "mpi" steps or the shipped ones; MCRDL_MPI_BLOCKING; debug mode
        and oversubscribed nodes nonblocking), as they are the same MPI calls."""
        mode = self._blocking_mode()
        for op in ("all_gather", "reduce_scatter"):
            for phase, size in (("inter", c.nodes), ("intra", c.ranks_per_node)):
                steps = blocking_steps(op, size, mode, self._blocking_table,
                                       self._oversubscribed, self._shared_memory)
                c.set_blocking(op, phase, step_codes(steps, allreduce=False))

    def add_group(self, group: Group) -> None:
        self._lane.check_open("add_group")  # after finalize its communicators are gone
        self._make(group)

    def synchronize(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for h in self._hier.values():
            h.queue.drain(timeout)
            h.queue.complete_all(max(deadline - time.monotonic(), 0.0))
        super().synchronize(max(deadline - time.monotonic(), 0.0))
        for w in self._take_chained():  # their C++ steps are done: this runs each finish
            w.wait(max(deadline - time.monotonic(), 0.0))

    def finalize(self) -> None:
        try:
            for h in self._hier.values():  # post what staged ops still hold
                h.queue.close(self.ctx.timeout)
        finally:
            self._hier.clear()
            super().finalize()  # drains the lane: completed ops deliver their results
            for w in self._take_chained():
                with contextlib.suppress(Exception):  # an abandoned op: nothing to deliver
                    w.is_completed()
        for c in self._mpi_comms:
            c.Free()
        self._mpi_comms.clear()
        self._base.Free()
        PCCLBackend._current = None

    # -- algorithm choice ---------------------------------------------------------------
    def algorithms(self, comm: _C.PcclComm, block_bytes: int) -> tuple[str, str]:
        """(inter, intra) algorithms of the C++ communicator for a call moving
        `block_bytes` per rank (an intra-node phase on another backend, INTRA_BACKENDS,
        is _delegate's: the C++ then only sees flat groups or the inter-node ranks)."""
        inter = self.inter_algo
        if inter == "auto":
            inter = self.model.choose(comm.nodes, block_bytes * comm.ranks_per_node)
        return inter, self.intra_algo if self.intra_algo in ALGORITHMS else "mpi"

    # -- intra-node phase on another backend ------------------------------------------
    def _delegate(self, group: Group | None, op: str):
        """(the delegate backend, the group's _Hier) when the intra-node phase runs on
        another backend for this group; None for pccl's own C++ phases."""
        name = self.intra_algo
        if name not in INTRA_BACKENDS:
            return None
        h = self._hier.get(0 if group is None else group.id)
        if h is None:
            return None
        d = self.ctx.peer(name)  # the backend itself: the node group is internal
        if d is None:
            raise BackendUnavailableError(
                f"{op}: pccl's intra-node phase is set to backend {name!r} (MCRDL_PCCL_INTRA "
                f"or use_algorithms), which is not initialized; pass it to mcrdl.init, e.g. "
                f"mcrdl.init([{name!r}, 'pccl'])")
        if name not in h.made_on:  # collective over the node's members, at first use
            d.add_group(h.node_group)
            h.made_on.add(name)
        return d, h

    def _gather_phases(self, d, h: _Hier, out, inp, inter: str):
        """all_gather of `inp` (n elements) into `out` (p * n, rank order): the inter-node
        phase in C++, the node's all_gather on `d`, the shuffle into rank order. Moves are
        bit-exact in any dtype (the C++ moves bytes, the delegate validates its own)."""
        n, N, L = inp.numel(), h.nodes, h.per_node
        t1 = torch.empty(N * n, dtype=inp.dtype, device=inp.device)
        t2 = torch.empty(L * N * n, dtype=inp.dtype, device=inp.device)
        phases = [lambda: h.inter.all_gather(t1, inp, inter, "mpi", True),
                  lambda: d.all_gather(t2, t1, h.node_group, True)]

        def shuffle():  # out[perm[i]] = t2[i], blocks of n
            out.view(N * L, n).index_copy_(0, h.perm.to(out.device), t2.view(N * L, n))
        return phases, shuffle

    def _scatter_phases(self, d, h: _Hier, out, src, code: ReduceOp, inter: str):
        """reduce_scatter of `src` (p * n, rank order) into `out` (n): the pre-shuffle, the
        node's reduce_scatter on `d`, the inter-node phase in C++."""
        n, N, L = out.numel(), h.nodes, h.per_node
        acc = src.view(N * L, n).index_select(0, h.perm.to(src.device)).view(-1)
        mid = torch.empty(N * n, dtype=out.dtype, device=out.device)
        return [lambda: d.reduce_scatter(mid, acc, code, h.node_group, True),
                lambda: h.inter.reduce_scatter(out, mid, int(code), inter, "mpi", True)]

    def _staged(self, h: _Hier, phases, finish, async_op):
        """An op in phases on two backends (pccl's C++ inter-node phase, the delegate's
        intra-node phase): each phase is posted once the one before completed, as one
        task of the group's queue, so every rank posts the same sequence on each
        communicator whatever order the caller waits in."""
        def post():
            work = None
            for phase in phases:
                if work is not None:
                    work.wait()
                work = phase()
            return ChainedWork([work], finish, self.name)

        return h.queue.run_task(post, self.name, async_op)

    # -- operations -----------------------------------------------------------------------
    @staticmethod
    def _check_device(op: str, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            raise BackendUnavailableError(
                f"{op}: backend 'pccl' runs its phases over MPI point-to-point and handles CPU "
                f"tensors only here (got a tensor on {t.device}); use 'nccl' for GPU tensors")

    def _chain(self, steps: list, finish) -> ChainedWork:
        """The Work of an async op whose `finish` (a copy into the caller's tensor, AVG's
        division, a cast back) runs in Python once its C++ steps completed: kept until it
        ran, so that synchronize delivers the result as for the other backends."""
        work = ChainedWork(steps, finish, self.name)
        if finish is not None:
            with self._chained_lock:
                if len(self._chained) >= 256:
                    self._chained = [w for w in self._chained if w.pending]
                self._chained.append(work)
        return work

    def _take_chained(self) -> list[ChainedWork]:
        with self._chained_lock:
            chained, self._chained = self._chained, []
        return chained

    def _run(self, post, finish, async_op):
        w = post(async_op)
        if async_op:
            return self._chain([w], finish)
        if finish is not None:
            with torch.no_grad():
                finish()
        return None

    def all_gather(self, output, input, group, async_op):
        self._check_device("all_gather", input)
        c = self.comm(group)
        inp = input.reshape(-1)
        is_list = isinstance(output, (list, tuple))
        out = (torch.empty(inp.numel() * c.size, dtype=inp.dtype) if is_list
               else output.view(-1))
        if inp.data_ptr() and out.data_ptr() <= inp.data_ptr() < out.data_ptr() + out.nbytes:
            inp = inp.clone()  # in place (input is this rank's block of output)
        algos = self.algorithms(c, inp.nbytes)
        copy_out = None
        if is_list:
            def copy_out(out=out, output=output):
                for i, t in enumerate(output):
                    t.view(-1).copy_(out[i * inp.numel():(i + 1) * inp.numel()])
        dh = self._delegate(group, "all_gather")
        if dh is not None:
            phases, shuffle = self._gather_phases(*dh, out, inp, algos[0])
            return self._staged(dh[1], phases, _then(shuffle, copy_out), async_op)
        return self._run(lambda a: c.all_gather(_words(out), _words(inp), *algos, a),
                         copy_out, async_op)

    def reduce_scatter(self, output, input, op, group, async_op):
        self._check_device("reduce_scatter", output)
        c = self.comm(group)
        src = (torch.cat([t.reshape(-1) for t in input]) if isinstance(input, (list, tuple))
               else input.reshape(-1))
        plan = reduce_plan(output.dtype, op)
        wdtype, code, avg = plan.dtype, plan.op, plan.average
        src = _as(src, wdtype)
        flat = output.view(-1)
        out = _as(flat, wdtype) if output.dtype == torch.bool else (
            flat if output.dtype == wdtype else torch.empty(flat.numel(), dtype=wdtype))
        algos = self.algorithms(c, out.nbytes)
        finish = None
        if avg or out.data_ptr() != flat.data_ptr():
            def finish(out=out, flat=flat, size=c.size, avg=avg):
                if avg:
                    out.div_(size)
                if out.data_ptr() != flat.data_ptr():
                    flat.copy_(out)
        dh = self._delegate(group, "reduce_scatter")
        if dh is not None:
            return self._staged(dh[1], self._scatter_phases(*dh, out, src, code, algos[0]),
                                finish, async_op)
        return self._run(lambda a: c.reduce_scatter(out, src, int(code), *algos, a),
                         finish, async_op)

    def all_reduce(self, tensor, op, group, async_op):
        self._check_device("all_reduce", tensor)
        c = self.comm(group)
        p, count = c.size, tensor.numel()
        plan = reduce_plan(tensor.dtype, op)
        wdtype, code, avg = plan.dtype, plan.op, plan.average
        m = -(-count // p)  # block per rank, the tensor padded to p * m
        buf = torch.zeros(p * m, dtype=wdtype)
        buf[:count].copy_(_as(tensor.reshape(-1), wdtype) if tensor.dtype == torch.bool
                          else tensor.reshape(-1))
        piece = torch.empty(m, dtype=wdtype)
        algos = self.algorithms(c, m * buf.element_size())

        def finish():
            if avg:
                buf.div_(p)
            flat = tensor.view(-1)
            flat.copy_(buf[:count].view(torch.bool) if tensor.dtype == torch.bool
                       else buf[:count])

        dh = self._delegate(group, "all_reduce")
        if dh is not None:  # reduce_scatter into piece (buf is only read), all_gather to buf
            phases = self._scatter_phases(*dh, piece, buf, code, algos[0])
            more, shuffle = self._gather_phases(*dh, buf, piece, algos[0])
            return self._staged(dh[1], phases + more, _then(shuffle, finish), async_op)
        # one C++ op: its Work, sequence number and timeout message are all_reduce's
        return self._run(lambda a: c.all_reduce(buf, piece, int(code), *algos, a), finish,
                         async_op)


def _then(*steps):
    """One finish step running the given ones (None entries skipped) in order."""
    steps = [s for s in steps if s is not None]

    def run():
        for step in steps:
            step()
    return run


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` reinterpreted (bool as uint8) or converted to `dtype`."""
    if t.dtype == dtype:
        return t
    if t.dtype == torch.bool and dtype == torch.uint8:
        return t.view(torch.uint8)
    return t.to(dtype)


def _words(t: torch.Tensor) -> torch.Tensor:
    """Data movement is bit-exact: move 16-bit and bool tensors as integer words."""
    if t.dtype in HALF_DTYPES:
        return t.view(torch.int16)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t


def initialized(where: str = "pccl") -> PCCLBackend:
    """The initialized "pccl" backend object itself: its layouts, cost model and
    algorithm settings."""
    b = PCCLBackend.current()
    if b is None:
        raise BackendUnavailableError(f"{where}: backend 'pccl' is not initialized")
    return b


@contextlib.contextmanager
def use_algorithms(inter: str | None = None, intra: str | None = None):
    """Within the block, the initialized "pccl" backend uses these algorithms ("ring",
    "rd", "mpi"; inter also "auto"; intra also a backend of INTRA_BACKENDS, which must be
    initialized). For benchmarks and experiments."""
    b = initialized("use_algorithms")
    for name, v, allowed in (("inter", inter, (*ALGORITHMS, "auto")),
                             ("intra", intra, INTRA_CHOICES)):
        if v is not None and v not in allowed:
            raise InvalidArgumentError(f"use_algorithms: {name}={v!r}; expected one of "
                                       f"{', '.join(allowed)}")
    old = (b.inter_algo, b.intra_algo)
    b.inter_algo = inter or b.inter_algo
    b.intra_algo = intra or b.intra_algo
    try:
        yield b
    finally:
        b.inter_algo, b.intra_algo = old
