"""Differentiable collectives of the TED engine, with per-kind backend pinning and CAC.

Each function moves a tensor over one :class:`Comm` (an mcrdl group and the backend of
each collective kind) inside autograd:

==================  ==============================  ===============================
function            forward                          backward
==================  ==============================  ===============================
``copy_to``         identity                         all_reduce (SUM) of the grad
``reduce_from``     all_reduce (SUM)                 identity
``all_to_all``      all_to_all_single, equal splits  the same all_to_all of the grad
``gather_share``    all_gather along ``dim``         keep this rank's share of the grad
``drop_share``      keep this rank's share of dim    all_gather of the grad along dim
==================  ==============================  ===============================

``copy_to``/``reduce_from`` are Megatron's f and g; ``drop_share``/``gather_share`` are
DTD's drop and all-gather, whose roles swap in the backward pass. A Comm of one rank
(group None) moves nothing: every function is then the identity, so a layout with
G_expert = 1 issues no all_to_all at all.

**Backends.** Every collective goes to ``"auto"`` unless its kind is pinned:
``Backends.parse("a2a=gloo,allreduce=mpi")`` (kinds: a2a, allreduce, allgather; plain
names in the same string are backends to initialize, e.g. ``"mpi,gloo,a2a=gloo"``).

**CAC**: every forward collective here goes through :func:`training.cac.through_stash`,
so a segment run by :func:`training.cac.checkpointed` with ``cac=True`` replays them in
its recomputation instead of communicating again (training/core/cac.py).
"""

from __future__ import annotations

import torch

import mcrdl

from ..core.backends import Backends
from ..core.cac import through_stash


class Comm:
    """One group of the engine (None: a single rank) and the backends its collectives
    use. `name` ("tensor", "expert", ...) names it in messages."""

    def __init__(self, group: mcrdl.Group | None, backends: Backends | None = None,
                 name: str = ""):
        self.group = group
        self.backends = backends or Backends()
        self.name = name
        self.size = 1 if group is None else group.size
        self.rank = 0 if group is None else group.rank

    @classmethod
    def world(cls, backends: Backends | None, size: int, rank: int) -> Comm:
        """The world (mcrdl's group None) as a Comm of `size` ranks."""
        comm = cls(None, backends, "world")
        comm.size, comm.rank = size, rank
        return comm

    @property
    def active(self) -> bool:
        return self.size > 1

    # --- the raw collectives (no autograd) -----------------------------------------------
    def all_reduce(self, t: torch.Tensor, op=mcrdl.ReduceOp.SUM) -> torch.Tensor:
        """`t` reduced over the group, in place (returned)."""
        if self.active:
            mcrdl.all_reduce(self.backends.of("allreduce"), t, op=op, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's `t` concatenated along `dim`, in group rank order."""
        if not self.active:
            return t
        t = t.contiguous()
        out = torch.empty((self.size * t.shape[0],) + t.shape[1:], dtype=t.dtype,
                          device=t.device)
        mcrdl.all_gather(self.backends.of("allgather"), out, t, group=self.group)
        if dim == 0:
            return out
        shape = list(t.shape)
        shape[dim] *= self.size
        return out.view(self.size, *t.shape).movedim(0, dim).reshape(shape)

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """Rows (dim 0) of `t` in `size` equal blocks, block i to rank i."""
        if not self.active:
            return t
        t = t.contiguous()
        out = torch.empty_like(t)
        mcrdl.all_to_all_single(self.backends.of("a2a"), out, t, group=self.group)
        return out

    def share(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's 1/size block of `t` along `dim` (a contiguous copy)."""
        if not self.active:
            return t
        n = t.shape[dim]
        if n % self.size:
            raise ValueError(f"cannot split dimension {dim} of size {n} over the {self.size} "
                             f"ranks of the {self.name or 'process'} group")
        k = n // self.size
        return t.narrow(dim, self.rank * k, k).contiguous()

    def __repr__(self) -> str:
        return f"Comm({self.name or 'group'}, size {self.size}, rank {self.rank})"


# --- autograd functions ----------------------------------------------------------------

class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_reduce(g.contiguous().clone()), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return through_stash("all_reduce", lambda: comm.all_reduce(x.contiguous().clone()))

    @staticmethod
    def backward(ctx, g):
        return g, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return through_stash("all_to_all_single", lambda: comm.all_to_all(x))

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_to_all(g), None


class _GatherShare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.comm, ctx.dim = comm, dim
        return through_stash("all_gather", lambda: comm.all_gather(x, dim))

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.share(g, ctx.dim), None, None


class _DropShare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.comm, ctx.dim = comm, dim
        return comm.share(x, dim)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_gather(g, ctx.dim), None, None


def copy_to(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Megatron's f: identity forward, all_reduce of the grad backward."""
    return _CopyTo.apply(x, comm) if comm.active else x


def reduce_from(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Megatron's g: all_reduce forward, identity backward."""
    return _ReduceFrom.apply(x, comm) if comm.active else x


def all_to_all(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """all_to_all_single over `comm` (dim 0 in equal blocks), and back for the grad."""
    return _AllToAll.apply(x, comm) if comm.active else x


def gather_share(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    """all_gather along `dim` forward; the rank's share of the grad backward."""
    return _GatherShare.apply(x, dim, comm) if comm.active else x


def drop_share(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    """The rank's share along `dim` forward; all_gather of the grad backward."""
    return _DropShare.apply(x, dim, comm) if comm.active else x
