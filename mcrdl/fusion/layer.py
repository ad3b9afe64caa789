"""The fusion layer of a backend's call path: which calls it buffers (on the
:class:`~mcrdl.fusion.buffer.FusionBuffer` of their group) and which pass through, in
order behind the buffered ones."""

from __future__ import annotations

from .. import _C
from ..layers import OrderedLayer, layers
from ..ops import OPS, OpSpec
from .buffer import FusionBuffer
from .calls import ALL_GATHER, BCAST, REDUCE_SCATTER
from .config import FusionConfig

_validate = _C.validate


def _implements(top, op: str) -> bool:
    """Whether the backend under `top` (and the layers below this one) has `op`."""
    below = layers(top)
    backend = below[-1].inner if below else top
    supported = getattr(type(backend), "supported_ops", None)
    return supported is None or op in supported()


class Fused(OrderedLayer):
    """Wrapper backend doing tensor fusion; see the package docstring (mcrdl.fusion)."""

    def __init__(self, inner, rt, config: FusionConfig):
        self._config = config
        self._limit = config.buffer_bytes
        super().__init__(inner, rt)

    def wrap(self, spec: OpSpec, forward):
        if not _implements(self.inner, spec.name):
            # raises UnsupportedOperationError at the call: were it buffered, at a flush
            # that failed the whole round; were it queued in order, only at its wait
            return forward
        if spec.name not in self._config.ops:  # pass through, in order
            return self.passthrough(spec, forward)
        if spec.name == "all_reduce":  # world calls: one C++ call (_all_reduce the others)
            queue = self._queue(None, "fusion ").queue
            queue.set_fallback(self._all_reduce)
            return queue.all_reduce
        return super().wrap(spec, forward)

    def _make_queue(self, group, name: str) -> FusionBuffer:
        gsize = self._rt.world_size if group is None else group.size
        return FusionBuffer(name, self._rt, self.inner, group, gsize, self.name, self._config)

    def _pass(self, op: str, *args):
        """Hand the call (the Backend method's arguments) on unfused, in order."""
        return self._ordered(OPS[op].call(args), getattr(self.inner, op))

    def _buffer(self, kind: int, param: int, tensor, nbytes: int, args: tuple, group,
                async_op: bool):
        """Buffer a validated call on the queue of `group` (a member's group); its fusion
        key is (kind, the dtype of `tensor`, param)."""
        queue = self._queues.get(0 if group is None else group.id)
        if queue is None:
            queue = self._queue(group, "fusion ")
        call = queue.queue.add(kind, param, tensor, nbytes, args, async_op)
        if async_op:
            return call
        call.wait()
        return None

    def _all_reduce(self, tensor, op, group, async_op):
        """all_reduce, but for the world group's fused calls (the queue's C++ front)."""
        if group is None:
            queue = self._queues.get(0) or self._queue(None, "fusion ")
        else:
            self._rt.size_rank(group)
            queue = self._queues.get(group.id) or self._queue(group, "fusion ")
        call = queue.queue.add_all_reduce(tensor, op, async_op)
        if call is None:  # B bytes or more, or not on the CPU
            return self._pass("all_reduce", tensor, op, group, async_op)
        if async_op:
            return call
        call.wait()
        return None

    def bcast(self, tensor, src, group, async_op):
        size, rank = self._rt.size_rank(group)
        _validate("bcast", tensor, src, rank, size)
        nbytes = tensor.nbytes
        if nbytes >= self._limit or not tensor.is_cpu:
            return self._pass("bcast", tensor, src, group, async_op)
        return self._buffer(BCAST, src, tensor, nbytes, (tensor,), group, async_op)

    def all_gather(self, output, input, group, async_op):
        size, rank = self._rt.size_rank(group)
        _validate("all_gather", output, input, rank, size)
        nbytes = input.nbytes * size
        if nbytes >= self._limit or not input.is_cpu:
            return self._pass("all_gather", output, input, group, async_op)
        return self._buffer(ALL_GATHER, 0, input, nbytes, (output, input), group, async_op)

    def reduce_scatter(self, output, input, op, group, async_op):
        size, rank = self._rt.size_rank(group)
        _validate("reduce_scatter", output, input, op, rank, size)
        nbytes = output.nbytes * size
        if nbytes >= self._limit or not output.is_cpu:
            return self._pass("reduce_scatter", output, input, op, group, async_op)
        return self._buffer(REDUCE_SCATTER, int(op), output, nbytes, (output, input), group,
                            async_op)
