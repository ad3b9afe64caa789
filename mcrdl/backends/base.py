"""The backend plug-in interface: a Backend class per communication library.

A backend declares its :class:`Capabilities`, tells whether it is usable in this
process (:meth:`Backend.availability`), is constructed collectively by ``mcrdl.init``
and implements the operations it supports as methods named like them, taking the
parameters of :data:`mcrdl.ops.OPS` in order, then ``group`` (a
:class:`~mcrdl.groups.Group`, None for the world) and ``async_op``; ``op`` arguments
arrive as :class:`~mcrdl.ops.ReduceOp`. The methods it does not implement raise
UnsupportedOperationError (the front names the backends that have the operation).

Third-party backends subclass :class:`Backend` and register with
:func:`mcrdl.backends.register_backend` or the ``mcrdl.backends`` entry-point group
(``name = "package.module:BackendClass"``). Their arguments are validated before the
method is called unless the class sets ``validates_arguments = True``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from ..errors import UnsupportedOperationError
from ..ops import DTYPES, OPS, OpSpec

if TYPE_CHECKING:
    from ..bootstrap import Bootstrap
    from ..groups import Group


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do: operation names (None: the operations its class
    implements), dtypes, device types, stream awareness."""

    ops: frozenset[str] | None = None
    dtypes: frozenset[torch.dtype] = frozenset(DTYPES)
    devices: frozenset[str] = frozenset({"cpu"})
    stream_aware: bool = False
    notes: dict[str, str] = field(default_factory=dict)


@dataclass
class InitContext:
    """What a backend's constructor gets: the bootstrap channel, timeout, world group,
    and ``peer(name)``: another initialized backend of this process (None when it is not
    initialized), for backends that run a phase of their ops on another one."""

    bootstrap: Bootstrap
    timeout: float
    world: Group
    peer: Callable[[str], Backend | None] = lambda name: None


class Backend:
    """Base class of every backend; see the module docstring."""

    name: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    validates_arguments: ClassVar[bool] = False

    @classmethod
    def availability(cls, launch) -> str | None:
        """None when usable in this process, else the reason it is not."""
        return None

    @classmethod
    def supported_ops(cls) -> frozenset[str]:
        """The operations of this backend: its capabilities' list, else those its class
        implements."""
        if cls.capabilities.ops is not None:
            return cls.capabilities.ops
        return frozenset(op for op in OPS if getattr(cls, op) is not getattr(Backend, op))

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

    def use_tuning_table(self, table) -> None:
        """The tuning table of this init (a mcrdl.tuning.table.TuningTable, or None when
        there is none): a backend whose calls have variants it chooses between by
        measurement takes them from it. Collective: every rank, same table, same point."""


def _unsupported(spec: OpSpec):
    def method(self, *args):
        raise UnsupportedOperationError(spec.name, self.name)

    method.__name__ = method.__qualname__ = spec.name
    method.__doc__ = (f"{spec.doc}\n\nBackend method: {spec.name}({spec.signature()}). "
                      "Not implemented by this backend.")
    return method


# The operations, one method each, derived from the specs (override what you support).
for _spec in OPS.values():
    setattr(Backend, _spec.name, _unsupported(_spec))
del _spec
