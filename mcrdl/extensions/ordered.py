"""The base of the layers that defer calls (fusion, compression): each keeps one
:class:`~mcrdl.ordering.IssueQueue` per group it deferred a call on, and posts every
other call of that (backend, group) in issue order behind them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..ops import Call, OpSpec
from ..ordering import IssueQueue
from ..validate import validate
from ..work import ChainedWork
from .base import Layer


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
