"""The fused backend calls of a flush: one per chunk (one fusion key, at most B bytes,
cut by ``_C.FusionQueue.take``), and the copy of each result back into the callers'
tensors. By kind (``_C.FusedCall.kind``), in the order of :data:`POST`."""

from __future__ import annotations

import torch

from .. import _C
from ..ops import FUSABLE_OPS, ReduceOp


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.view(-1)


# Post one fused call: (backend Work or None when posted blocking, copy-back or None).
# A lone call is posted as it is (nothing to copy). Arguments: inner backend, the chunk of
# calls (one fusion key: _C.FusedChunk), group, group size, this rank's group rank,
# async_op.

def _post_all_reduce(inner, chunk, group, gsize, grank, async_op):
    op = ReduceOp(chunk.param)
    if len(chunk) == 1:
        return inner.all_reduce(chunk.calls[0].args[0], op, group, async_op), None
    buf = chunk.pack()
    work = inner.all_reduce(buf, op, group, async_op)
    return work, lambda: chunk.unpack(buf)


def _post_bcast(inner, chunk, group, gsize, grank, async_op):
    root = chunk.param
    if len(chunk) == 1:
        return inner.bcast(chunk.calls[0].args[0], root, group, async_op), None
    if grank == root:  # copied back too: a layer below (compression) may change the bits
        buf = chunk.pack()
        return inner.bcast(buf, root, group, async_op), lambda: chunk.unpack(buf)
    first = chunk.calls[0].args[0]
    buf = torch.empty(chunk.nbytes // first.element_size(), dtype=first.dtype)
    work = inner.bcast(buf, root, group, async_op)
    return work, lambda: chunk.unpack(buf)


def _post_all_gather(inner, chunk, group, gsize, grank, async_op):
    calls = chunk.calls
    if len(calls) == 1:
        out, inp = calls[0].args
        return inner.all_gather(out, inp, group, async_op), None
    ins = [c.args[1] for c in calls]
    sizes = [t.numel() for t in ins]
    total = sum(sizes)
    fused_out = torch.empty(gsize * total, dtype=ins[0].dtype)
    work = inner.all_gather(fused_out, _C.pack_flat(ins), group, async_op)

    @torch.no_grad()  # the outputs may be tensors that require grad
    def copy_back():
        blocks = fused_out.view(gsize, total)
        dsts, srcs, off = [], [], 0
        for c, n in zip(calls, sizes, strict=True):
            out = c.args[0]
            if isinstance(out, torch.Tensor):
                dsts.append(out.view(gsize, n))
                srcs.append(blocks[:, off:off + n])
            else:
                dsts.extend(_flat(o) for o in out)
                srcs.extend(blocks[r, off:off + n] for r in range(gsize))
            off += n
        torch._foreach_copy_(dsts, srcs)

    return work, copy_back


def _post_reduce_scatter(inner, chunk, group, gsize, grank, async_op):
    op = ReduceOp(chunk.param)
    calls = chunk.calls
    if len(calls) == 1:
        out, inp = calls[0].args
        return inner.reduce_scatter(out, inp, op, group, async_op), None
    rows = []
    for c in calls:
        inp = c.args[1]
        if isinstance(inp, torch.Tensor):
            rows.append(inp.detach().view(gsize, -1))
        else:
            rows.append(torch.stack([_flat(t.detach()) for t in inp]))
    fused_in = torch.cat(rows, dim=1)
    fused_out = torch.empty(chunk.nbytes // gsize // fused_in.element_size(),
                            dtype=fused_in.dtype)
    work = inner.reduce_scatter(fused_out, fused_in.view(-1), op, group, async_op)
    return work, lambda: chunk.unpack(fused_out)


# By _C.FusedCall.kind (the C++ fast path posts all_reduce as kind 0)
ALL_REDUCE, BCAST, ALL_GATHER, REDUCE_SCATTER = range(4)
POST = (_post_all_reduce, _post_bcast, _post_all_gather, _post_reduce_scatter)
KIND_NAMES = tuple(f.__name__.removeprefix("_post_") for f in POST)
if set(KIND_NAMES) != FUSABLE_OPS or KIND_NAMES[0] != "all_reduce":
    raise ImportError(f"fusion kinds {KIND_NAMES} do not match mcrdl.ops ({FUSABLE_OPS})")
