"""Layers of AxoNN's 4D algorithm: a 3D parallel matrix multiplication (X, Y, Z)
replicated over data-parallel groups, as torch modules over ``TensorComms``.

Linear layer (I is [t, k] per rank, torch's weight [n, k], i.e. the paper's k x n W):

- **N-layer** (``transposed=False``): out-features split over X, in-features over Y.
  The local [n/G_x, k/G_y] block is flattened and rank z keeps contiguous chunk z of it
  (the shard, the only copy of the weight between steps). Its input [t, k/G_y] is
  replicated over X, its output [t, n/G_x] over Y.
  forward: all_gather the block over Z; O = I W^T; all_reduce over Y (O's partial sums
  over the in-features). The gathered block is kept for the backward (``keep_weights``).
  backward: dI = dO W, all_reduce over X; dW = dO^T I, reduce_scatter over Z into the
  shard's gradient; after the whole backward the shard gradients are all_reduced over
  data (``GPT4D.reduce_gradients``).
- **T-layer** (``transposed=True``): X and Y swapped. An N-layer's output layout is a
  T-layer's input layout and vice versa, so N, T, N, T... needs no redistribution; with
  only X of degree > 1 that is Megatron-LM's column-parallel (N) and row-parallel (T)
  pair.

Shard gradients do not go through autograd: the reduce_scatter writes them into the
shard's ``.grad`` (with ORS, when ``finish_gradients`` waits for it), so a Z shard never
holds a full-size gradient. Every other parameter (biases, LayerNorm) is replicated
over the axis it is not split on and gets its gradient from autograd; those gradients
are partial over Z and data and are all_reduced there after the backward.

Where a parameter lives is a ``Split``: which axis splits its rows and its columns,
whether Z shards the flattened block, and a row permutation applied first (attention's
c_attn, so that rank x holds q, k and v of its heads). ``Split.local`` cuts a rank's
piece out of the serial tensor, ``Split.assemble`` puts the pieces back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.sharding import Split, split_of
from .comm import Pending, TensorComms

AXES = ("x", "y", "z", "data")


# -- where a parameter lives --------------------------------------------------------------

class SerialPart:
    """A serial tensor that is not in memory: its shape, and `read(index)` giving the
    rectangle `index` (a tuple of slices of the serial layout) of it, e.g. an init
    source's ``part(name, index)`` reading only that slice of a safetensors file. The
    layers take one wherever they take a serial tensor; they read only this rank's
    piece (``read_piece``)."""

    def __init__(self, shape, read: Callable[[tuple[slice, ...]], torch.Tensor]):
        self.shape = torch.Size(shape)
        self.read = read

    def dim(self) -> int:
        return len(self.shape)


def read_piece(full: SerialPart, split: Split, coords: dict[str, int],
               sizes: dict[str, int], name: str = "parameter") -> torch.Tensor:
    """``split.local(full_tensor, coords, sizes)`` reading only this rank's piece: the
    elements of its (x, y) block (rows permuted by ``split.perm``, the block's columns)
    that its Z chunk covers, as reads of whole rows in runs of consecutive serial rows
    and, where the chunk starts or ends inside a row, of that row's part. One piece is
    in memory at a time: a single read is the piece itself, several are concatenated
    once."""
    split.check(sizes, name)
    bs = split.block_shape(sizes)
    r0 = coords[split.rows] * bs[0] if split.rows else 0
    rows = list(range(r0, r0 + bs[0]))
    if split.perm is not None:
        rows = [split.perm[r] for r in rows]
    two_d = len(bs) == 2
    width = bs[1] if two_d else 1
    c0 = coords[split.cols] * bs[1] if two_d and split.cols else 0
    start, end = 0, bs[0] * width
    if split.z:
        n = end // sizes["z"]
        start, end = coords["z"] * n, (coords["z"] + 1) * n
    # (first row, last row + 1, first column, last column + 1) of each read, block-relative
    reads: list[list[int]] = []
    pos = start
    while pos < end:
        i, lo = divmod(pos, width)
        hi = min(width, lo + end - pos)
        whole = lo == 0 and hi == width
        last = reads[-1] if reads else None
        if (whole and last is not None and last[2:] == [0, width] and
                rows[last[1] - 1] + 1 == rows[i]):
            last[1] = i + 1                          # the run of whole rows goes on
        else:
            reads.append([i, i + 1, lo, hi])
        pos += hi - lo
    # a read of part of the columns may cost the reader whole rows: at most
    # READ_ROWS_BYTES of them at a time, each read copied into the piece and dropped
    row_bytes = full.shape[1] * 4 if two_d else 4
    step = max(1, READ_ROWS_BYTES // row_bytes) if two_d and width < full.shape[1] \
        else None
    chunks = []
    for i0, i1, lo, hi in reads:
        for j in range(i0, i1, step or (i1 - i0)):
            chunks.append((j, min(i1, j + (step or (i1 - i0))), lo, hi))
    piece = None
    at = 0
    for i0, i1, lo, hi in chunks:
        index = (slice(rows[i0], rows[i1 - 1] + 1),)
        if two_d:
            index += (slice(c0 + lo, c0 + hi),)
        part = full.read(index).reshape(-1)
        if len(chunks) == 1:
            piece = part
            break
        if piece is None:
            piece = torch.empty(end - start, dtype=part.dtype)
        piece[at:at + part.numel()] = part
        at += part.numel()
        del part
    if not split.z:
        piece = piece.view(bs)
    return piece.detach().contiguous()


#: read_piece reads at most this many bytes of whole rows at a time where it wants
#: part of their columns (with 1 MiB, the heap's holes took a rank's peak to 1.6x its
#: share on (2,2,1,1); with 256 KiB, 1.14x: tests/training/check_4d_llama.py)
READ_ROWS_BYTES = 1 << 18


def local_piece(full: torch.Tensor | SerialPart, split: Split, comms: TensorComms,
                name: str = "parameter") -> torch.Tensor:
    """This rank's piece of the serial tensor `full` (in memory, or a SerialPart read
    piecewise)."""
    if isinstance(full, SerialPart):
        return read_piece(full, split, comms.coords(), comms.sizes(), name)
    return split.local(full, comms.coords(), comms.sizes(), name)


def shard_parameter(full: torch.Tensor | SerialPart, split: Split, comms: TensorComms,
                    name: str = "parameter") -> nn.Parameter:
    """A parameter holding this rank's piece of `full`, tagged with its split and its
    logical (serial) shape: weight decay and checkpoints go by those, not by the piece.
    ValueError naming `name` where the grid does not divide it (Split.check)."""
    p = nn.Parameter(local_piece(full, split, comms, name))
    p.split = split
    p.logical_shape = tuple(split.shape)
    return p


def owns(p: nn.Parameter, comms: TensorComms) -> bool:
    """Whether this rank is the one that counts `p` in global sums (the gradient norm):
    coordinate 0 on every axis `p` is replicated over. Each piece is counted once."""
    split = split_of(p)
    split_axes = split.split_axes if split is not None else set()
    return all(comms.axis(a).rank == 0 for a in AXES if a not in split_axes)


# -- matmuls ----------------------------------------------------------------------------

def mm_forward(comms: TensorComms, inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """O = I W^T (I [t, k], W [n, k])."""
    if comms.kernels is not None:
        return comms.kernels.forward(inp, w)
    return inp @ w.t()


def mm_input_grad(comms: TensorComms, dout: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dI = dO W."""
    if comms.kernels is not None:
        return comms.kernels.input_grad(dout, w)
    return dout @ w


def mm_weight_grad(comms: TensorComms, dout: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """dW = dO^T I."""
    if comms.kernels is not None:
        return comms.kernels.weight_grad(dout, inp)
    return dout.t() @ inp


# -- Z-sharded weights -----------------------------------------------------------------------

class ShardedWeight(nn.Module):
    """Base of the layers whose weight is a Z shard: the all_gather of the block and the
    reduce_scatter of its gradient back into ``weight.grad``."""

    weight: nn.Parameter
    comms: TensorComms
    name: str

    def gather_weight(self, async_op: bool = False) -> Pending:
        """The block [rows, cols] gathered over Z (a Pending)."""
        shape = self.weight.split.block_shape(self.comms.sizes())
        z = self.comms.z
        if z.size == 1:
            return Pending(None, self.weight.detach().view(shape))
        p = z.all_gather(self.weight.detach(), async_op=async_op, tag=self.name)
        p.value = p.value.view(shape)  # the gathered chunks, in z order, are the block
        return p

    def weight_for_forward(self) -> torch.Tensor:
        if self.comms.z.size == 1:  # nothing to gather, nothing to schedule
            return self.gather_weight().wait()
        return self.comms.gathers.weight(self)

    def add_weight_grad(self, dw: torch.Tensor) -> None:
        """Reduce-scatter the block gradient `dw` over Z into ``weight.grad`` (async
        with ORS: then ``finish_gradients`` adds it)."""
        c = self.comms
        pending = c.z.reduce_scatter(dw.reshape(-1), async_op=c.overlap.ors and c.z.size > 1,
                                     tag=self.name)
        if pending.work is None:
            _accumulate(self.weight, pending.value)
        else:
            self._pending_grads.append(pending)

    def finish_gradients(self) -> None:
        """Wait for the Z reduce_scatters still in flight; their results into ``.grad``."""
        for pending in self._pending_grads:
            _accumulate(self.weight, pending.wait())
        self._pending_grads.clear()

    def _init_shard(self, full: torch.Tensor, split: Split, comms: TensorComms,
                    name: str) -> None:
        self.comms, self.name = comms, name
        self.weight = shard_parameter(full, split, comms, f"{name}.weight")
        self._pending_grads: list[Pending] = []


def _accumulate(p: nn.Parameter, g: torch.Tensor) -> None:
    g = g.view_as(p)
    if p.grad is None:
        p.grad = g.clone()
    else:
        p.grad.add_(g)


class _LinearFn(torch.autograd.Function):
    """The N- or T-layer's matmul and collectives (module docstring); the bias is added
    outside, by autograd. With `defer_x` the layer's collective over X (the T-layer's
    forward all_reduce, the N-layer's backward one) is left to the caller."""

    @staticmethod
    def forward(ctx, inp, shard, layer, defer_x):
        w = layer.weight_for_forward()
        shape = inp.shape
        x2 = inp.reshape(-1, shape[-1])
        layer.comms.recorder.mark(f"compute {layer.name}")
        out = mm_forward(layer.comms, x2, w)
        if not (defer_x and layer.in_comm is layer.comms.x):
            out = layer.in_comm.all_reduce(out, tag=f"{layer.name} output").wait()
        ctx.layer, ctx.shape, ctx.defer_x = layer, shape, defer_x
        ctx.w = w if layer.comms.keep_weights else None
        ctx.save_for_backward(x2)
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        layer = ctx.layer
        c = layer.comms
        (x2,) = ctx.saved_tensors
        w = ctx.w if ctx.w is not None else layer.gather_weight().wait()
        ctx.w = None
        d2 = dout.reshape(-1, dout.shape[-1])
        dinp = mm_input_grad(c, d2, w).contiguous()
        if ctx.defer_x and layer.out_comm is c.x:
            pending = Pending(None, dinp)
        else:
            pending = layer.out_comm.all_reduce(dinp, async_op=c.overlap.oar and
                                                layer.out_comm.size > 1,
                                                tag=f"{layer.name} input grad")
        c.recorder.mark(f"compute dW {layer.name}")
        dw = mm_weight_grad(c, d2, x2)
        dinp = pending.wait()
        layer.add_weight_grad(dw)
        return dinp.view(ctx.shape), None, None, None


class ParallelLinear(ShardedWeight):
    """A Linear of `in_features` -> `out_features` as an N-layer (``transposed=False``)
    or a T-layer, built from the serial `weight` [out, in] and `bias` [out] (None: no
    bias). `row_perm` permutes the out-features first (attention's q/k/v by head
    group). `name` tags its collectives in the recorder and the log."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comms: TensorComms, *,
                 transposed: bool = False, row_perm: tuple[int, ...] | None = None,
                 name: str = "linear"):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.transposed = transposed
        out_axis, in_axis = ("y", "x") if transposed else ("x", "y")
        self.out_comm, self.in_comm = comms.axis(out_axis), comms.axis(in_axis)
        for what, n, axis in (("out", self.out_features, out_axis),
                              ("in", self.in_features, in_axis)):
            if n % comms.axis(axis).size:
                raise ValueError(f"{name}: {what}-features {n} are not divisible by "
                                 f"G_{axis}={comms.axis(axis).size}")
        self._init_shard(weight, Split(tuple(weight.shape), out_axis, in_axis, True, row_perm),
                         comms, name)
        if bias is None:
            self.bias = None
        else:
            self.bias = shard_parameter(bias, Split(tuple(bias.shape), out_axis, None, False,
                                                    row_perm), comms, f"{name}.bias")

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        out = _LinearFn.apply(inp, self.weight, self, False)
        return out if self.bias is None else out + self.bias

    def partial(self, inp: torch.Tensor) -> torch.Tensor:
        """The layer without its collective over X and without the bias: a T-layer's
        output is then this rank's term of the sum over X, an N-layer's input gradient
        this rank's term. The caller reduces over X once for several layers (an MoE
        layer's local experts) and adds ``bias``."""
        return _LinearFn.apply(inp, self.weight, self, True)

    def extra_repr(self) -> str:
        return (f"{'T' if self.transposed else 'N'}-layer {self.in_features} -> "
                f"{self.out_features}, bias={self.bias is not None}")


class _EmbeddingFn(torch.autograd.Function):
    """Lookup in the Z-gathered [rows, cols/G_y] block; the backward scatters the rows'
    gradients into a dense block gradient and reduce-scatters it over Z."""

    @staticmethod
    def forward(ctx, idx, shard, layer):
        w = layer.weight_for_forward()
        layer.comms.recorder.mark(f"compute {layer.name}")
        ctx.layer, ctx.block = layer, w.shape
        ctx.save_for_backward(idx)
        return F.embedding(idx, w)

    @staticmethod
    def backward(ctx, dout):
        (idx,) = ctx.saved_tensors
        dw = torch.zeros(ctx.block, dtype=dout.dtype, device=dout.device)
        dw.index_add_(0, idx.reshape(-1), dout.reshape(-1, ctx.block[1]))
        ctx.layer.add_weight_grad(dw)
        return None, None, None


class ParallelEmbedding(ShardedWeight):
    """An embedding table [rows, dim]: columns split over Y, replicated over X, the
    block sharded over Z like a Linear weight. Output [..., dim/G_y]."""

    def __init__(self, weight: torch.Tensor, comms: TensorComms, name: str = "embedding"):
        super().__init__()
        if weight.shape[1] % comms.y.size:
            raise ValueError(f"{name}: width {weight.shape[1]} is not divisible by "
                             f"G_y={comms.y.size}")
        self._init_shard(weight, Split(tuple(weight.shape), None, "y", True), comms, name)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _EmbeddingFn.apply(idx, self.weight, self)


class _SumOverAxis(torch.autograd.Function):
    """All-reduce (SUM) whose result every rank uses differently: the backward sums the
    gradients over the axis too (the LayerNorm statistics)."""

    @staticmethod
    def forward(ctx, t, comm, tag):
        ctx.comm, ctx.tag = comm, tag
        return comm.all_reduce(t.contiguous().clone(), tag=tag).wait()

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        ctx.comm.all_reduce(g, tag=f"{ctx.tag} grad")
        return g, None, None


class ParallelLayerNorm(nn.Module):
    """LayerNorm over a hidden dimension split over Y, in two float32 passes as torch's
    layer_norm computes it: the per-token sum of the local columns all_reduced over Y
    gives the mean, then the sum of squared deviations from it the variance (two calls
    of one float32 per token; their gradients likewise in the backward). One pass,
    E[x^2] - mean^2, cancels when a token's mean is large against its spread: in bf16 it
    gave negative variances and NaN at a mean of 4 and a spread of 0.2. The output is
    rounded to the input's dtype once. With G_y = 1, torch's layer_norm."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comms: TensorComms,
                 eps: float = 1e-5, name: str = "ln"):
        super().__init__()
        self.comms, self.eps, self.name = comms, eps, name
        self.dim = weight.shape[0]
        if self.dim % comms.y.size:
            raise ValueError(f"{name}: width {self.dim} is not divisible by G_y={comms.y.size}")
        self.weight = shard_parameter(weight, Split(tuple(weight.shape), "y"), comms,
                                      f"{name}.weight")
        self.bias = (None if bias is None
                     else shard_parameter(bias, Split(tuple(bias.shape), "y"), comms,
                                          f"{name}.bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comms.y
        if y.size == 1:
            return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)
        xf = x.float()
        mean = _SumOverAxis.apply(xf.sum(-1), y, f"{self.name} mean") / self.dim
        d = xf - mean.unsqueeze(-1)
        var = _SumOverAxis.apply((d * d).sum(-1), y, f"{self.name} variance") / self.dim
        out = d * torch.rsqrt(var + self.eps).unsqueeze(-1) * self.weight.float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


class _GatherLastDim(torch.autograd.Function):
    """All-gather over an axis along the last dimension; every rank of the axis then
    computes the same thing from it, so the backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, t, comm, tag):
        ctx.comm = comm
        g = comm.all_gather(t, tag=tag).wait()           # [G, ..., n]
        ctx.n = t.shape[-1]
        return torch.movedim(g, 0, -2).reshape(*t.shape[:-1], comm.size * t.shape[-1])

    @staticmethod
    def backward(ctx, g):
        r, n = ctx.comm.rank, ctx.n
        return g[..., r * n:(r + 1) * n], None, None


def gather_last_dim(t: torch.Tensor, comm, tag: str = "gather") -> torch.Tensor:
    """`t` [..., n] of every rank of `comm`'s axis concatenated: [..., G n]."""
    if comm.size == 1:
        return t
    return _GatherLastDim.apply(t, comm, tag)


def qkv_head_permutation(n_embd: int, n_head: int, g_x: int) -> tuple[int, ...]:
    """The rows of c_attn ([q; k; v], each n_embd rows, head h at rows h*d..(h+1)*d)
    reordered so that X block x is [q, k, v] of heads x*H/G_x .. (x+1)*H/G_x - 1."""
    per = n_embd // g_x  # rows of q (or k, v) of one X rank's heads
    rows = []
    for x in range(g_x):
        for part in range(3):
            start = part * n_embd + x * per
            rows.extend(range(start, start + per))
    return tuple(rows)


Weights = Callable[[str], "torch.Tensor | SerialPart | None"]


def serial_weights(serial: nn.Module | Weights) -> Weights:
    """A layer's serial weights by parameter name (``"c_attn.weight"``; None for a
    parameter the serial module lacks, e.g. a bias), from the serial module itself or
    from a getter (tensors of a state_dict, SerialParts of an init source)."""
    if not isinstance(serial, nn.Module):
        return serial
    params = {n: p.data for n, p in serial.named_parameters()}
    return params.get


class ParallelSelfAttention(nn.Module):
    """Causal self-attention with its heads split over X: c_attn an N-layer (rows
    permuted, see qkv_head_permutation), the attention of this rank's heads local,
    c_proj a T-layer whose in-features (split over X) are those heads. `serial`: the
    serial attention module or its weights by name (serial_weights)."""

    def __init__(self, serial: nn.Module | Weights, n_head: int, comms: TensorComms,
                 name: str):
        super().__init__()
        get = serial_weights(serial)
        w = get("c_attn.weight")
        c = w.shape[1]
        if n_head % comms.x.size:
            raise ValueError(f"{name}: n_head={n_head} is not divisible by G_x={comms.x.size}")
        self.local_heads = n_head // comms.x.size
        self.head_dim = c // n_head
        perm = qkv_head_permutation(c, n_head, comms.x.size)
        self.c_attn = ParallelLinear(w, get("c_attn.bias"), comms, row_perm=perm,
                                     name=f"{name}.c_attn")
        self.c_proj = ParallelLinear(get("c_proj.weight"), get("c_proj.bias"), comms,
                                     transposed=True, name=f"{name}.c_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h, d = self.local_heads, self.head_dim
        q, k, v = self.c_attn(x).split(h * d, dim=2)
        q, k, v = (t.view(B, T, h, d).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, h * d))


class ParallelMLP(nn.Module):
    """The GPT MLP: c_fc an N-layer, c_proj a T-layer (Megatron-LM's column- and
    row-parallel pair where only X has degree > 1). `approximate`: F.gelu's (the
    config's activation); None takes the serial module's."""

    def __init__(self, serial: nn.Module | Weights, comms: TensorComms, prefix: str,
                 approximate: str | None = None):
        super().__init__()
        self.approximate = approximate or getattr(serial, "approximate", "none")
        get = serial_weights(serial)
        self.c_fc = ParallelLinear(get("c_fc.weight"), get("c_fc.bias"), comms,
                                   name=f"{prefix}.c_fc")
        self.c_proj = ParallelLinear(get("c_proj.weight"), get("c_proj.bias"), comms,
                                     transposed=True, name=f"{prefix}.c_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


# -- the Llama family (training/models/llama.py) -------------------------------------------

class ParallelRMSNorm(nn.Module):
    """RMSNorm over a hidden dimension split over Y: the per-token sum of squares of the
    local columns (float32) all_reduced over Y gives the mean square (one call of one
    float32 per token; its gradient likewise in the backward), then as the serial
    RMSNorm: normalized in float32, cast back to the input's dtype, times the weight.
    With G_y = 1, the serial formula."""

    def __init__(self, weight: torch.Tensor | SerialPart, comms: TensorComms,
                 eps: float = 1e-5, name: str = "norm"):
        super().__init__()
        self.comms, self.eps, self.name = comms, eps, name
        self.dim = weight.shape[0]
        if self.dim % comms.y.size:
            raise ValueError(f"{name}: width {self.dim} is not divisible by G_y={comms.y.size}")
        self.weight = shard_parameter(weight, Split(tuple(weight.shape), "y"), comms,
                                      f"{name}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comms.y
        h = x.float()
        if y.size == 1:
            ms = h.pow(2).mean(-1, keepdim=True)
        else:
            ms = (_SumOverAxis.apply(h.pow(2).sum(-1), y, f"{self.name} sumsq")
                  / self.dim).unsqueeze(-1)
        h = h * torch.rsqrt(ms + self.eps)
        return self.weight * h.to(x.dtype)


def check_kv_heads(n_head: int, n_kv_head: int, g_x: int) -> str | None:
    """The rule of grouped-query attention on X (None: it holds). Heads are split over X
    in contiguous groups, query and key/value heads alike: X rank x holds query heads
    x*H/G_x .. (x+1)*H/G_x - 1 and key/value heads x*K/G_x .. (x+1)*K/G_x - 1, which
    are exactly the key/value heads those query heads read (query head h reads
    key/value head h // (H/K)). So G_x must divide n_kv_head (and then n_head, a
    multiple of it); key/value heads are never replicated over X."""
    if n_kv_head % g_x:
        return (f"n_kv_head={n_kv_head} is not divisible by G_x={g_x}: key/value heads are "
                f"split over X with the query heads they serve (each X rank holds "
                f"n_kv_head/G_x of them); choose --G-x dividing --n-kv-head {n_kv_head}")
    if n_head % g_x:
        return f"n_head={n_head} is not divisible by G_x={g_x}"
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ParallelLlamaAttention(nn.Module):
    """Grouped-query attention with rotary embeddings (training/models/llama.py's
    Attention) with its heads split over X by check_kv_heads' rule: q_proj, k_proj and
    v_proj N-layers (their rows, heads, contiguous per X rank, so no permutation), the
    attention of this rank's heads local, o_proj a T-layer. `serial`: the serial
    attention module or its weights by name. `inv_freq`: the rotary inverse
    frequencies (float32; kept so whatever the model's dtype)."""

    def __init__(self, serial: nn.Module | Weights, n_head: int, n_kv_head: int,
                 head_dim: int, inv_freq: torch.Tensor, comms: TensorComms, name: str):
        super().__init__()
        problem = check_kv_heads(n_head, n_kv_head, comms.x.size)
        if problem:
            raise ValueError(f"{name}: {problem}")
        get = serial_weights(serial)
        g_x = comms.x.size
        self.local_heads, self.local_kv, self.head_dim = n_head // g_x, n_kv_head // g_x, head_dim
        self.inv_freq = inv_freq.float()
        for proj in ("q_proj", "k_proj", "v_proj"):
            setattr(self, proj, ParallelLinear(get(f"{proj}.weight"), None, comms,
                                               name=f"{name}.{proj}"))
        self.o_proj = ParallelLinear(get("o_proj.weight"), None, comms, transposed=True,
                                     name=f"{name}.o_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h, kv, d = self.local_heads, self.local_kv, self.head_dim
        q = self.q_proj(x).view(B, T, h, d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, kv, d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, kv, d).transpose(1, 2)
        pos = torch.arange(T, device=x.device, dtype=torch.float)
        angles = pos[:, None] * self.inv_freq.to(x.device)[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(h // kv, dim=1)
        v = v.repeat_interleave(h // kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, h * d))


class ParallelSwiGLU(nn.Module):
    """Llama's MLP, down(silu(gate(x)) * up(x)): gate_proj and up_proj N-layers split
    alike (rank x holds the same rows, intermediate features, of both, so the product
    is local), down_proj a T-layer over those features."""

    def __init__(self, serial: nn.Module | Weights, comms: TensorComms, prefix: str):
        super().__init__()
        get = serial_weights(serial)
        self.gate_proj = ParallelLinear(get("gate_proj.weight"), None, comms,
                                        name=f"{prefix}.gate_proj")
        self.up_proj = ParallelLinear(get("up_proj.weight"), None, comms,
                                      name=f"{prefix}.up_proj")
        self.down_proj = ParallelLinear(get("down_proj.weight"), None, comms, transposed=True,
                                        name=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def data_of(p):
    """A serial parameter's tensor (None for a missing bias)."""
    return None if p is None else p.data


def sharded_weights(module: nn.Module) -> list[ShardedWeight]:
    return [m for m in module.modules() if isinstance(m, ShardedWeight)]


__all__ = ["ParallelEmbedding", "ParallelLayerNorm", "ParallelLinear", "ParallelLlamaAttention",
           "ParallelMLP", "ParallelRMSNorm", "ParallelSelfAttention", "ParallelSwiGLU",
           "SerialPart", "ShardedWeight", "check_kv_heads", "data_of", "gather_last_dim",
           "local_piece", "owns", "qkv_head_permutation", "read_piece", "serial_weights",
           "shard_parameter", "sharded_weights"]
