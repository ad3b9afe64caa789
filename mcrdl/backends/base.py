"""The backend plug-in interface: a Backend class per communication library.

A backend declares its :class:`Capabilities`, tells whether it is usable in this
process (:meth:`Backend.availability`), is constructed collectively by ``mcrdl.init``
and implements the operations it supports. The front (``mcrdl.api``) resolves the
backend name and calls the method of the same name as the operation, with group
resolved to a :class:`~mcrdl.groups.Group` (or None for the world) and ``op`` to a
:class:`~mcrdl.ops.ReduceOp`. Operations not overridden raise
UnsupportedOperationError naming the backends that can do them.

Third-party backends subclass :class:`Backend` and register with
:func:`mcrdl.backends.register_backend` or the ``mcrdl.backends`` entry-point group
(``name = "package.module:BackendClass"``). Their arguments are validated by the front
before the method is called unless the class sets ``validates_arguments = True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from ..errors import UnsupportedOperationError
from ..ops import DTYPES, OPERATIONS

if TYPE_CHECKING:
    from ..bootstrap import Bootstrap
    from ..groups import Group


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do: operation names, dtypes, device types, stream awareness."""

    ops: frozenset[str] = frozenset(OPERATIONS)
    dtypes: frozenset[torch.dtype] = frozenset(DTYPES)
    devices: frozenset[str] = frozenset({"cpu"})
    stream_aware: bool = False
    notes: dict[str, str] = field(default_factory=dict)


@dataclass
class InitContext:
    """What a backend's constructor gets: the bootstrap channel, timeout, world groups."""

    bootstrap: Bootstrap
    timeout: float
    world: Group


class Backend:
    """Base class of every backend; see the module docstring."""

    name: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    validates_arguments: ClassVar[bool] = False

    @classmethod
    def availability(cls, launch) -> str | None:
        """None when usable in this process, else the reason it is not."""
        return None

    def __init__(self, ctx: InitContext):
        self.ctx = ctx

    # -- lifecycle ---------------------------------------------------------------
    def add_group(self, group: Group) -> None:
        """Create this backend's communicator for a new group (collective, world order)."""

    def synchronize(self, timeout: float) -> None:
        """Wait for every outstanding op of this backend."""

    def set_timeout(self, timeout: float) -> None:
        self.ctx.timeout = timeout

    def finalize(self) -> None:
        """Release communicators and threads."""

    def mark_failed(self, why: str) -> None:
        """Ops no longer match across ranks (timeout, desync): refuse new ones from now on."""

    # -- operations (override what the backend supports) -----------------------------
    def _unsupported(self, op: str):
        from .registry import backends_supporting

        others = [b for b in backends_supporting(op) if b != self.name]
        raise UnsupportedOperationError(
            f"{op}: backend '{self.name}' does not implement it; backends that do: "
            f"{', '.join(others) if others else 'none'}"
        )

    def all_reduce(self, tensor, op, group, async_op):
        self._unsupported("all_reduce")

    def reduce(self, tensor, dst, op, group, async_op):
        self._unsupported("reduce")

    def bcast(self, tensor, src, group, async_op):
        self._unsupported("bcast")

    def all_gather(self, output, input, group, async_op):
        self._unsupported("all_gather")

    def gather(self, output, input, dst, group, async_op):
        self._unsupported("gather")

    def scatter(self, output, input, src, group, async_op):
        self._unsupported("scatter")

    def reduce_scatter(self, output, input, op, group, async_op):
        self._unsupported("reduce_scatter")

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, group,
                          async_op):
        self._unsupported("all_to_all_single")

    def all_to_all(self, output_list, input_list, group, async_op):
        self._unsupported("all_to_all")

    def gatherv(self, output, input, counts, displs, dst, group, async_op):
        self._unsupported("gatherv")

    def scatterv(self, output, input, counts, displs, src, group, async_op):
        self._unsupported("scatterv")

    def all_gatherv(self, output, input, counts, displs, group, async_op):
        self._unsupported("all_gatherv")

    def all_to_allv(self, output, input, send_counts, recv_counts, send_displs, recv_displs,
                    group, async_op):
        self._unsupported("all_to_allv")

    def send(self, tensor, dst, tag, group, async_op):
        self._unsupported("send")

    def recv(self, tensor, src, tag, group, async_op):
        self._unsupported("recv")

    def barrier(self, group, async_op):
        self._unsupported("barrier")
