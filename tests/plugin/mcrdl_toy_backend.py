"""A third-party mcrdl backend used by tests/test_plugin.py.

It lives outside the mcrdl package and is found through the ``mcrdl.backends``
entry-point group. Its collectives exchange bytes through the rendezvous store that
mcrdl hands every backend, and reduce with numpy: slow, but independent of MPI/Gloo.
"""

from __future__ import annotations

import numpy as np
import torch

import mcrdl
from mcrdl.backends import Backend, Capabilities


class ToyWork(mcrdl.Work):
    __slots__ = ("backend",)

    def __init__(self):
        self.backend = "toy"

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


_REDUCE = {
    mcrdl.ReduceOp.SUM: np.sum,
    mcrdl.ReduceOp.PRODUCT: np.prod,
    mcrdl.ReduceOp.MIN: np.min,
    mcrdl.ReduceOp.MAX: np.max,
}


class ToyBackend(Backend):
    capabilities = Capabilities(ops=frozenset({"all_reduce", "bcast", "all_gather", "barrier"}))

    def __init__(self, ctx):
        super().__init__(ctx)
        self.store = ctx.bootstrap.store()
        self.rank = ctx.world.rank
        self.size = ctx.world.size
        self.seq = 0

    def _exchange(self, t: torch.Tensor) -> list[np.ndarray]:
        self.seq += 1
        key = f"toy/{self.seq}"
        self.store.set(f"{key}/{self.rank}", t.numpy().tobytes())
        return [np.frombuffer(self.store.get(f"{key}/{r}"), dtype=t.numpy().dtype)
                for r in range(self.size)]

    def _done(self, async_op):
        return ToyWork() if async_op else None

    def all_reduce(self, tensor, op, group, async_op):
        parts = self._exchange(tensor)
        red = _REDUCE[op](np.stack(parts), axis=0)
        tensor.copy_(torch.from_numpy(red.astype(parts[0].dtype)).reshape(tensor.shape))
        return self._done(async_op)

    def bcast(self, tensor, src, group, async_op):
        parts = self._exchange(tensor)
        tensor.copy_(torch.from_numpy(parts[src].copy()).reshape(tensor.shape))
        return self._done(async_op)

    def all_gather(self, output, input, group, async_op):
        parts = self._exchange(input)
        output.copy_(torch.from_numpy(np.concatenate(parts)).reshape(output.shape))
        return self._done(async_op)

    def barrier(self, group, async_op):
        self._exchange(torch.zeros(1))
        return self._done(async_op)
