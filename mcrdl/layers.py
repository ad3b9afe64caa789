"""The base classes of the layers on the call path between the front and a backend
(mcrdl/extensions/, mcrdl/fusion/): :class:`Layer`, and :class:`OrderedLayer` for the
layers that defer calls.

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

A layer that defers calls (fusion, compression) is an :class:`OrderedLayer`: it keeps one
:class:`~mcrdl.ordering.IssueQueue` per group it deferred a call on, and posts every
other call of that (backend, group) in issue order behind them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from .errors import InvalidArgumentError
from .ops import OPS, Call, OpSpec
from .ordering import IssueQueue
from .validate import validate
from .work import ChainedWork


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


class OrderedLayer(Layer):
    """Base of the layers that defer calls (fusion, compression).

    Holds one :class:`IssueQueue` per group this layer ever deferred a call on.
    Operations a subclass does not handle pass through in order: straight to the next
    layer when the group has no queue or its queue is idle (the caller posts inline),
    else validated now and queued behind the deferred calls. Point-to-point calls always
    go straight through (see the module docstring). ``rt`` is the runtime (world,
    timeout, group checks).
    """

    queue_class = IssueQueue

    def __init__(self, inner, rt):
        self._rt = rt
        self._queues: dict[int, IssueQueue] = {}
        self._queues_lock = threading.Lock()
        super().__init__(inner)

    def passthrough(self, spec: OpSpec, forward: Callable) -> Callable:
        if spec.p2p:
            return forward

        def call(*args):
            return self._ordered(spec.call(args), forward)

        return call

    def _ordered(self, call: Call, forward: Callable):
        """Hand `call` to `forward` behind whatever its group's queue holds."""
        group = call.group
        queue = self._queues.get(0 if group is None else getattr(group, "id", None))
        if queue is None:
            return call.forward(forward)
        if queue.try_inline():
            try:
                return call.forward(forward)
            finally:
                queue.release()
        size, rank = self._rt.size_rank(group)
        # Errors now, not later. The call goes on as issued, not with the split sizes and
        # displacements validation fills in: whether a call is deferred depends on timing,
        # which differs between ranks, and a backend may pick its collective by the form of
        # the arguments (mpi: all_to_all_single without splits is MPI_Alltoall, with splits
        # MPI_Ialltoallv), so a filled-in call could meet another collective on a rank that
        # posted the same call inline.
        validate(call, size, rank)
        posted = call.replace(async_op=True)

        def post():
            return ChainedWork([posted.forward(forward)])

        return queue.run_task(post, self.name, call.async_op)

    def _queue(self, group, what: str = "") -> IssueQueue:
        """The queue of `group` (created on first use)."""
        gid = 0 if group is None else group.id
        queue = self._queues.get(gid)
        if queue is None:
            with self._queues_lock:
                queue = self._queues.get(gid)
                if queue is None:
                    gname = "world" if group is None else group.describe()
                    queue = self._make_queue(group, f"{what}{self.name} group {gname}")
                    self._queues[gid] = queue
        return queue

    def _make_queue(self, group, name: str) -> IssueQueue:
        return self.queue_class(name, self._rt.timeout_of)

    def drain(self, timeout: float) -> None:
        """Post every deferred call (blocking on the other ranks, bounded by `timeout`)."""
        for queue in self._all_queues():
            queue.drain(timeout)

    def synchronize(self, timeout: float) -> None:
        """Post every deferred call, complete them (their results reach the tensors),
        then synchronize the next layer."""
        deadline = time.monotonic() + timeout
        self.drain(timeout)
        for queue in self._all_queues():
            queue.complete_all(max(deadline - time.monotonic(), 0.0))
        self.inner.synchronize(max(deadline - time.monotonic(), 0.0))

    def _all_queues(self) -> list:
        return list(self._queues.values())

    def close(self, timeout: float) -> None:
        for queue in self._all_queues():
            queue.close(timeout)


# -- checks of the layers' settings (FusionConfig, CompressionConfig, LoggingConfig) --


def positive_number(where: str, name: str, value: object, *, integer: bool = False) -> None:
    """Refuse `value`, field `name` of the settings `where`, unless a finite number > 0
    (an int with `integer`)."""
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0 \
            or not math.isfinite(value):
        what = "an int > 0" if integer else "a finite number > 0"
        raise InvalidArgumentError(f"{where}: '{name}' is {value!r}; expected {what}")


def op_names(where: str, ops: object, allowed: frozenset) -> frozenset:
    """The field 'ops' of the settings `where` as a frozenset, refused unless a collection
    of names from `allowed`."""
    if isinstance(ops, str) or not hasattr(ops, "__iter__"):
        raise InvalidArgumentError(
            f"{where}: 'ops' is {ops!r}; expected a collection of operation names from "
            f"{sorted(allowed)}")
    ops = frozenset(ops)
    bad = sorted(str(o) for o in ops - allowed)
    if bad:
        raise InvalidArgumentError(
            f"{where}: 'ops' names {bad}, which this extension does not apply to; "
            f"choose from {sorted(allowed)}")
    return ops
