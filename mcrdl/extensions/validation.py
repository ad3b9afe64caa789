"""The validating layer: mcrdl's local argument checks for backends that do not run
them themselves (``Backend.validates_arguments`` False: third-party backends)."""

from __future__ import annotations

from collections.abc import Callable

from ..layers import Layer
from ..ops import OpSpec
from ..validate import validate


class Validated(Layer):
    """Runs :func:`mcrdl.validate.validate` on every call, then the backend's method.
    ``size_rank(group)`` gives (size, rank) of a group and raises for non-members."""

    def __init__(self, inner, size_rank: Callable):
        self._size_rank = size_rank
        super().__init__(inner)

    def passthrough(self, spec: OpSpec, forward: Callable) -> Callable:
        size_rank = self._size_rank

        def call(*args):
            c = spec.call(args)
            size, rank = size_rank(c.group)
            return validate(c, size, rank).forward(forward)

        return call
