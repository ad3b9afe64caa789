"""zfp compression of the data that collectives and point-to-point calls move.

For float32/float64 CPU tensors, each block a rank sends (its input, or one block per
peer) is compressed with zfpy in the configured mode; compressed sizes differ per rank,
so every call first moves the sizes, then the bytes, both with the backend's own
operations:

============================  ======================================================
operation                     protocol on the same backend and group
============================  ======================================================
all_gather, all_reduce        all_gather of the sizes, all_gatherv of the bytes;
                              all_reduce then reduces the decompressed contributions
                              locally, in rank order (SUM, AVG, MIN, MAX, PRODUCT)
gather                        all_gather of the sizes, gatherv of the bytes
scatter                       bcast of the sizes from the root, scatterv of the bytes
bcast                         bcast of the size, bcast of the bytes
all_to_all(_single)           all_to_all of the sizes, all_to_allv of the bytes
send / recv                   the size, then the bytes (same tag)
============================  ======================================================

Every rank, the sender or root included, ends with the *decompressed* values (so all
ranks hold the same bits, e.g. after a bcast of weights). Each block starts with one
tag byte: zfp, or raw when zfp would not make it smaller or it holds NaN/Inf (zfp's
lossy modes do not keep non-finite values), magnitudes of 2**126 (float32) / 2**1022
(float64) or more (zfp may decode them as Inf), a tolerance finer than the dtype's
smallest normal value, or a fixed rate below zfp's minimum for the block shape (9 bits
per block of float32, 12 of float64); raw blocks are exact. Other dtypes
(float16/bfloat16 included: zfp has no 16-bit floats), GPU tensors, the other
operations and reduce ops are passed through uncompressed, in order. The sizes are
exchanged before the bytes can be posted, so an async call is posted by the group's
queue worker (mcrdl.layers.OrderedLayer), never blocking the caller.

Error bounds (zfp 1.0 documentation): "accuracy" keeps every value within
``tolerance`` (zfp rounds the tolerance down to a power of two); "precision" keeps
``precision`` bit planes of the block transform, error at most
``k(d) * 2**(emax - precision)`` for a block of 4**d values whose largest magnitude has
exponent emax (k(1) = 20, k(2) = 125, ...), except that a block whose values are all
subnormal decodes as zeros (error below the dtype's smallest normal value); "rate"
stores every block of 4**d values in ``round(4**d * rate)`` bits (the queue is written
in 64-bit words after a 96-bit header) with no error bound. A compressed
all_reduce(SUM) adds up to one error bound per rank. Tensors are compressed with their
own shape less its size-1 dimensions (up to 4-D; more dims are folded into the first).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..errors import DesyncError, MCRDLError
from ..layers import OrderedLayer
from ..ops import OPS, OpSpec, ReduceOp
from ..ordering import IssueQueue
from ..validate import validate
from ..work import ChainedWork
from .config import CompressionConfig

_FLOATS = (torch.float32, torch.float64)
_RAW, _ZFP = 0, 1  # tag byte of a block
_SIZE_BYTES = 8  # one int64 size per block
_REDUCE = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
}

_stats_lock = threading.Lock()
_stats: dict[str, list[int]] = {}  # op -> [calls, uncompressed bytes, bytes sent]


def _count(op: str, raw: int, wire: int) -> None:
    with _stats_lock:
        s = _stats.setdefault(op, [0, 0, 0])
        s[0] += 1
        s[1] += raw
        s[2] += wire


def compression_stats(reset: bool = False) -> dict[str, dict]:
    """Bytes this rank sent through compressed calls, per operation and in total:
    ``calls``, ``raw_bytes`` (the bytes of the blocks it would have sent uncompressed),
    ``wire_bytes`` (compressed blocks with their tag bytes, plus 8 bytes per size sent)
    and ``ratio`` = wire / raw. ``reset=True`` starts counting afresh."""
    with _stats_lock:
        items = {op: list(v) for op, v in _stats.items()}
        if reset:
            _stats.clear()
    out = {}
    total = [0, 0, 0]
    for op, (calls, raw, wire) in sorted(items.items()):
        out[op] = {"calls": calls, "raw_bytes": raw, "wire_bytes": wire,
                   "ratio": wire / raw if raw else None}
        total = [a + b for a, b in zip(total, (calls, raw, wire), strict=True)]
    out["total"] = {"calls": total[0], "raw_bytes": total[1], "wire_bytes": total[2],
                    "ratio": total[2] / total[1] if total[1] else None}
    return out


def _zfp_shape(shape: tuple) -> tuple:
    """The shape given to zfp: without size-1 dimensions (as 2-D, a (1, n) tensor filled
    each 4x4 block with 4 values and 12 of padding, and was sent raw), up to 4 dims."""
    shape = tuple(n for n in shape if n != 1)
    if not shape:
        return (1,)
    if len(shape) > 4:
        return (-1, *shape[-3:])
    return shape


def _rate_too_low(zfp_args: dict, ndim: int, itemsize: int) -> bool:
    """Whether fixed-rate blocks of `ndim` dims would get fewer bits than zfp needs for
    a float block (its common exponent plus one bit); zfpy 1.0.1 then overruns its
    output buffer (heap corruption), so such tensors are never given to it."""
    rate = zfp_args.get("rate")
    return rate is not None and round(4 ** ndim * rate) < (9 if itemsize == 4 else 12)


#: Magnitudes from which zfp's lossy modes may decode a finite value as infinite: its
#: block transform needs two exponents of headroom (probed with zfpy 1.0.1: float32
#: blocks holding values in [2**126, 2**127) decoded to inf at 4 bits a value, none
#: below 2**126 over 1 to 4 dims, every rate, precision and tolerance).
_ZFP_LIMIT = {np.dtype(np.float32): 2.0 ** 126, np.dtype(np.float64): 2.0 ** 1022}


def _zfp_may_take(a: np.ndarray, zfp_args: dict) -> bool:
    """Whether zfp keeps its mode's guarantee on `a` (else the block is sent raw): every
    value finite and below _ZFP_LIMIT, a rate zfp can meet for the block shape, and a
    tolerance no finer than the smallest normal float (zfp decodes a block whose values
    are all subnormal as zeros)."""
    if _rate_too_low(zfp_args, a.ndim, a.itemsize):
        return False
    if zfp_args.get("tolerance", np.inf) < np.finfo(a.dtype).tiny:
        return False
    top = max(a.max(), -a.min())  # NaN propagates, and fails the comparison
    return bool(top < _ZFP_LIMIT[a.dtype])


def encode(t: torch.Tensor, zfp_args: dict) -> torch.Tensor:
    """The bytes of one block (uint8, tag byte first); empty for an empty tensor."""
    import zfpy

    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    a = t.detach().numpy().reshape(_zfp_shape(tuple(t.shape)))
    if _zfp_may_take(a, zfp_args):
        packed = zfpy.compress_numpy(a, **zfp_args)
        if len(packed) < a.nbytes:
            out = np.empty(1 + len(packed), dtype=np.uint8)
            out[0] = _ZFP
            out[1:] = np.frombuffer(packed, dtype=np.uint8)
            return torch.from_numpy(out)
    out = np.empty(1 + a.nbytes, dtype=np.uint8)
    out[0] = _RAW
    out[1:] = a.reshape(-1).view(np.uint8)
    return torch.from_numpy(out)


def decode(block: torch.Tensor, dst: torch.Tensor, where: str) -> None:
    """Write the values of `block` (from :func:`encode`) into `dst`."""
    import zfpy

    n = dst.numel()
    out = dst.detach().view(-1).numpy()
    if block.numel() == 0:
        if n:
            raise DesyncError(f"{where}: received an empty block where {n} values were "
                              "expected; the ranks passed tensors of different sizes")
        return
    data = block.numpy()
    if data[0] == _RAW and (data.size - 1) % out.itemsize == 0:
        values = np.frombuffer(data[1:], dtype=out.dtype)
    elif data[0] == _RAW:
        raise DesyncError(f"{where}: received {data.size - 1} bytes, not a whole number of "
                          f"{out.dtype} values; the ranks passed tensors of different dtypes")
    elif data[0] == _ZFP:
        values = zfpy.decompress_numpy(data[1:].tobytes())
    else:
        raise MCRDLError(f"{where}: received a block with unknown tag {int(data[0])}; the "
                         "ranks do not run the same compression protocol")
    if values.size != n or values.dtype != out.dtype:
        raise DesyncError(
            f"{where}: received {values.size} {values.dtype} values where {n} {out.dtype} "
            "were expected; the ranks passed tensors of different sizes or dtypes")
    out[:] = values.reshape(-1)


def _blocks(output, size: int) -> list[torch.Tensor]:
    """The per-rank blocks of a gathered output: one tensor of `size` blocks, or a list."""
    return list(output.view(size, -1)) if isinstance(output, torch.Tensor) else list(output)


def _eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in _FLOATS and t.is_cpu


class Compressed(OrderedLayer):
    """Wrapper backend compressing payloads with zfp; see the module docstring."""

    def __init__(self, inner, rt, config: CompressionConfig):
        self._config = config
        self._zfp = config.zfp_args()
        self._p2p: dict[tuple, IssueQueue] = {}
        super().__init__(inner, rt)

    def wrap(self, spec: OpSpec, forward):
        if spec.name not in self._config.ops:  # pass through, in order
            return self.passthrough(spec, forward)
        return super().wrap(spec, forward)

    # -- helpers ---------------------------------------------------------------------
    def _check(self, op: str, args: tuple, group) -> tuple[int, int]:
        """(size, rank) of `group` after validating the call `args` (without group)."""
        size, rank = self._rt.size_rank(group)
        validate(OPS[op].call((*args, group, False)), size, rank)
        return size, rank

    def _pass(self, op: str, *args):
        """Hand the call (the Backend method's arguments) on uncompressed, in order."""
        return self._ordered(OPS[op].call(args), getattr(self.inner, op))

    def _run(self, group, post, async_op: bool):
        return self._queue(group, "compression ").run_task(post, self.name, async_op)

    def _sizes_all_gather(self, payload: torch.Tensor, group, size: int) -> list[int]:
        mine = torch.tensor([payload.numel()], dtype=torch.int64)
        sizes = torch.empty(size, dtype=torch.int64)
        self.inner.all_gather(sizes, mine, group, False)
        return sizes.tolist()

    def _all_gather_encoded(self, op: str, t: torch.Tensor, group, size: int):
        """Every rank's encoded `t` (in post()): the sizes, then an async all_gatherv of
        the bytes. Returns (received bytes, their sizes per rank, the all_gatherv work)."""
        payload = encode(t, self._zfp)
        counts = self._sizes_all_gather(payload, group, size)
        recv = torch.empty(sum(counts), dtype=torch.uint8)
        work = self.inner.all_gatherv(recv, payload, counts, None, group, True)
        _count(op, t.nbytes, payload.numel() + _SIZE_BYTES)
        return recv, counts, work

    def _where(self, op: str, group) -> str:
        gname = "world" if group is None else group.describe()
        return f"compressed {op} on backend '{self.name}' (group {gname})"

    # -- collectives -------------------------------------------------------------------
    def all_gather(self, output, input, group, async_op):
        if not _eligible(input):
            return self._pass("all_gather", output, input, group, async_op)
        size, _ = self._check("all_gather", (output, input), group)
        where = self._where("all_gather", group)

        def post():
            recv, counts, work = self._all_gather_encoded("all_gather", input, group, size)

            def then():
                for block, dst in zip(recv.split(counts), _blocks(output, size), strict=True):
                    decode(block, dst, where)

            return ChainedWork([work], then)

        return self._run(group, post, async_op)

    def all_reduce(self, tensor, op, group, async_op):
        if not _eligible(tensor) or op not in _REDUCE:
            return self._pass("all_reduce", tensor, op, group, async_op)
        size, _ = self._check("all_reduce", (tensor, op), group)
        where = self._where("all_reduce", group)
        combine = _REDUCE[op]

        def post():
            recv, counts, work = self._all_gather_encoded("all_reduce", tensor, group, size)

            def then():
                acc, part = torch.empty_like(tensor), torch.empty_like(tensor)
                for r, block in enumerate(recv.split(counts)):
                    decode(block, acc if r == 0 else part, where)
                    if r:
                        combine(acc, part, out=acc)
                if op == ReduceOp.AVG:
                    acc.div_(size)
                tensor.copy_(acc)

            return ChainedWork([work], then)

        return self._run(group, post, async_op)

    def gather(self, output, input, dst, group, async_op):
        if not _eligible(input):
            return self._pass("gather", output, input, dst, group, async_op)
        size, rank = self._check("gather", (output, input, dst), group)
        where = self._where("gather", group)

        def post():
            payload = encode(input, self._zfp)
            counts = self._sizes_all_gather(payload, group, size)
            recv = torch.empty(sum(counts) if rank == dst else 0, dtype=torch.uint8)
            work = self.inner.gatherv(recv if rank == dst else None, payload, counts, None,
                                       dst, group, True)
            _count("gather", input.nbytes, payload.numel() + _SIZE_BYTES)

            def then():
                if rank != dst:
                    return
                for block, d in zip(recv.split(counts), _blocks(output, size), strict=True):
                    decode(block, d, where)

            return ChainedWork([work], then)

        return self._run(group, post, async_op)

    def scatter(self, output, input, src, group, async_op):
        if not _eligible(output):
            return self._pass("scatter", output, input, src, group, async_op)
        size, rank = self._check("scatter", (output, input, src), group)
        where = self._where("scatter", group)

        def post():
            if rank == src:
                blocks = (list(input.view(size, *output.shape)) if isinstance(input, torch.Tensor)
                          else list(input))
                payloads = [encode(b, self._zfp) for b in blocks]
                sizes = torch.tensor([p.numel() for p in payloads], dtype=torch.int64)
                send = torch.cat(payloads)
                _count("scatter", sum(b.nbytes for b in blocks),
                       send.numel() + _SIZE_BYTES * size)
            else:
                sizes, send = torch.empty(size, dtype=torch.int64), None
            self.inner.bcast(sizes, src, group, False)
            counts = sizes.tolist()
            recv = torch.empty(counts[rank], dtype=torch.uint8)
            work = self.inner.scatterv(recv, send, counts, None, src, group, True)
            return ChainedWork([work], lambda: decode(recv, output, where))

        return self._run(group, post, async_op)

    def bcast(self, tensor, src, group, async_op):
        if not _eligible(tensor):
            return self._pass("bcast", tensor, src, group, async_op)
        _, rank = self._check("bcast", (tensor, src), group)
        where = self._where("bcast", group)

        def post():
            if rank == src:
                buf = encode(tensor, self._zfp)
                n = torch.tensor([buf.numel()], dtype=torch.int64)
                _count("bcast", tensor.nbytes, buf.numel() + _SIZE_BYTES)
            else:
                n = torch.empty(1, dtype=torch.int64)
            self.inner.bcast(n, src, group, False)
            if rank != src:
                buf = torch.empty(int(n[0]), dtype=torch.uint8)
            work = self.inner.bcast(buf, src, group, True)
            return ChainedWork([work], lambda: decode(buf, tensor, where))

        return self._run(group, post, async_op)

    def _exchange(self, op, sends: list, dsts: list, group, size: int, where: str,
                  raw: int):
        """all_to_all of the block sizes, all_to_allv of the blocks (in post())."""
        payloads = [encode(b, self._zfp) for b in sends]
        send_sizes = torch.tensor([p.numel() for p in payloads], dtype=torch.int64)
        recv_sizes = torch.empty(size, dtype=torch.int64)
        self.inner.all_to_all_single(recv_sizes, send_sizes, None, None, group, False)
        scounts, rcounts = send_sizes.tolist(), recv_sizes.tolist()
        send = torch.cat(payloads)
        recv = torch.empty(sum(rcounts), dtype=torch.uint8)
        work = self.inner.all_to_allv(recv, send, scounts, rcounts, None, None, group, True)
        _count(op, raw, send.numel() + _SIZE_BYTES * size)

        def then():
            for block, d in zip(recv.split(rcounts), dsts, strict=True):
                decode(block, d, where)

        return ChainedWork([work], then)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, group,
                          async_op):
        if not _eligible(input) or input.dim() == 0:
            return self._pass("all_to_all_single", output, input, output_split_sizes,
                              input_split_sizes, group, async_op)
        size, _ = self._check("all_to_all_single", (output, input, output_split_sizes,
                                                    input_split_sizes), group)
        where = self._where("all_to_all_single", group)

        def rows(t, splits):
            return [int(s) for s in splits] if splits is not None else [t.shape[0] // size] * size

        def post():
            sends = list(input.split(rows(input, input_split_sizes)))
            dsts = list(output.split(rows(output, output_split_sizes)))
            return self._exchange("all_to_all_single", sends, dsts, group, size, where,
                                  input.nbytes)

        return self._run(group, post, async_op)

    def all_to_all(self, output_list, input_list, group, async_op):
        if not isinstance(input_list, (list, tuple)) or not input_list \
                or not _eligible(input_list[0]):
            return self._pass("all_to_all", output_list, input_list, group, async_op)
        size, _ = self._check("all_to_all", (output_list, input_list), group)
        where = self._where("all_to_all", group)

        def post():
            return self._exchange("all_to_all", list(input_list), list(output_list), group,
                                  size, where, sum(t.nbytes for t in input_list))

        return self._run(group, post, async_op)

    # -- point to point ----------------------------------------------------------------
    def send(self, tensor, dst, tag, group, async_op):
        if not _eligible(tensor):
            return self.inner.send(tensor, dst, tag, group, async_op)
        self._check("send", (tensor, dst, tag), group)
        payload = encode(tensor, self._zfp)
        n = torch.tensor([payload.numel()], dtype=torch.int64)
        works = [self.inner.send(n, dst, tag, group, True)]
        if payload.numel():
            works.append(self.inner.send(payload, dst, tag, group, True))
        _count("send", tensor.nbytes, payload.numel() + _SIZE_BYTES)
        keep = (n, payload)  # alive until the sends complete
        work = ChainedWork(works, lambda: keep, self.name)
        if async_op:
            return work
        work.wait()
        return None

    def recv(self, tensor, src, tag, group, async_op):
        key = (0 if group is None else group.id, src, tag)
        queue = self._p2p.get(key)
        if not _eligible(tensor):
            if queue is None:
                return self.inner.recv(tensor, src, tag, group, async_op)
            # behind the compressed recvs queued on this (group, src, tag): posted now, it
            # could match the size message a queued one is about to receive
            return queue.run_task(lambda: self.inner.recv(tensor, src, tag, group, True),
                                  self.name, async_op)
        self._check("recv", (tensor, src, tag), group)
        where = self._where("recv", group)
        if queue is None:
            with self._queues_lock:
                queue = self._p2p.setdefault(key, IssueQueue(
                    f"compression {self.name} recv from {src} tag {tag}", self._rt.timeout_of))

        def post():
            n = torch.empty(1, dtype=torch.int64)
            self.inner.recv(n, src, tag, group, False)
            buf = torch.empty(int(n[0]), dtype=torch.uint8)
            works = [self.inner.recv(buf, src, tag, group, True)] if buf.numel() else []
            return ChainedWork(works, lambda: decode(buf, tensor, where))

        return queue.run_task(post, self.name, async_op)

    def _all_queues(self) -> list:
        return [*self._queues.values(), *self._p2p.values()]
