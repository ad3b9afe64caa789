"""The base class of every layer on the call path between the front and a backend.

A layer stands in front of the next one (a backend or another layer) and looks like a
backend to the layer above: one callable per operation of :data:`mcrdl.ops.OPS`, named
like it, taking the Backend method's arguments. For each operation the layer decides
once, when it is built, what that callable is (:meth:`Layer.wrap`):

- a method of its class named like the operation, when it defines one (it calls the
  next layer's method itself: ``self.inner.all_reduce(...)``);
- else :meth:`Layer.passthrough`, which by default is the next layer's callable itself,
  so a layer costs nothing on the operations it does not touch.

Layers that treat every operation alike override :meth:`wrap` or :meth:`passthrough`
and usually work on a :class:`~mcrdl.ops.Call` (``spec.call(args)``). The order of the
layers and where they are installed is mcrdl.extensions.stack's.
"""

from __future__ import annotations

from collections.abc import Callable

from ..ops import OPS, OpSpec


class Layer:
    """One layer of a backend's call path; see the module docstring."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        for op, spec in OPS.items():
            self.__dict__[op] = self.wrap(spec, getattr(inner, op))

    def wrap(self, spec: OpSpec, forward: Callable) -> Callable:
        """What this layer runs for operation `spec`, given `forward`, the next layer's
        callable for it."""
        own = getattr(type(self), spec.name, None)
        if own is not None:
            return own.__get__(self)
        return self.passthrough(spec, forward)

    def passthrough(self, spec: OpSpec, forward: Callable) -> Callable:
        """What this layer runs for an operation it does not handle itself."""
        return forward

    def unwrap(self):
        """The next layer (or the backend)."""
        return self.inner

    # -- lifecycle: what a layer holds, then the next layer ----------------------------
    def add_group(self, group) -> None:
        self.inner.add_group(group)

    def synchronize(self, timeout: float) -> None:
        self.inner.synchronize(timeout)

    def set_timeout(self, timeout: float) -> None:
        self.inner.set_timeout(timeout)

    def mark_failed(self, why: str) -> None:
        self.inner.mark_failed(why)

    def finalize(self) -> None:
        self.inner.finalize()

    def drain(self, timeout: float) -> None:
        """Post every call this layer still holds (blocking, bounded by `timeout`)."""

    def close(self, timeout: float) -> None:
        """Stop what this layer runs (threads); it is no longer called."""


def layers(top) -> list:
    """The layers from `top` down to (not including) the backend, outermost first."""
    out = []
    while isinstance(top, Layer):
        out.append(top)
        top = top.inner
    return out
