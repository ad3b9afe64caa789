"""Megatron-LM tensor parallelism (Shoeybi et al. 2019) for the TED engine: a
column-parallel linear layer followed by a row-parallel one, with one all_reduce over
the tensor group in the forward pass (Megatron's g, after the row-parallel layer) and
one in the backward pass (f, before the column-parallel layer).

Every layer is built from the serial module it shards (training/models/gpt.py), so a
tensor-parallel rank holds exactly its slice of the serial weights, whatever the layout:

- column-parallel (``c_attn``, ``c_fc``): rows of the weight and of the bias; ``c_attn``
  is three matrices (q, k, v) stacked, each split by heads (``chunks=3``).
- row-parallel (``c_proj``): columns of the weight; the bias is replicated and added
  once, after the all_reduce.

Each sharded parameter carries ``tensor_dim`` and ``tensor_chunks`` (how the serial
tensor is cut: ``torch.cat`` of the ranks' slices of each chunk along that dim rebuilds
it); replicated parameters carry ``tensor_dim = None``. Layers take their group as a
:class:`~training.collectives.Comm`, which also names the backend of each collective.

This module is the minimal Megatron pair the TED engine needs; the 4D engine's N/T
layers (whose X-only case is this) can replace it behind the same constructor
arguments (the serial module and the Comm).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .collectives import Comm, copy_to, reduce_from
from .models.gpt import MLP, CausalSelfAttention


def tensor_share(t: torch.Tensor, comm: Comm, dim: int, chunks: int = 1) -> torch.Tensor:
    """This tensor rank's slice of the serial tensor `t`: `t` cut into `chunks` equal
    parts along `dim`, each split into comm.size blocks, block comm.rank of each part."""
    parts = t.chunk(chunks, dim=dim)
    return torch.cat([comm.share(p, dim) for p in parts], dim=dim).clone()


def _param(t: torch.Tensor, dim: int | None, chunks: int = 1) -> nn.Parameter:
    p = nn.Parameter(t.detach().clone())
    p.tensor_dim, p.tensor_chunks = dim, chunks
    return p


def mark_replicated(module: nn.Module) -> None:
    """Mark every parameter of `module` not yet marked as replicated over the tensor
    group (embeddings, LayerNorms, the router, the head)."""
    for p in module.parameters():
        if not hasattr(p, "tensor_dim"):
            p.tensor_dim, p.tensor_chunks = None, 1


class ColumnParallelLinear(nn.Module):
    """Rows `comm.rank` of the serial Linear (per chunk); input replicated, output split."""

    def __init__(self, serial: nn.Linear, comm: Comm, chunks: int = 1):
        super().__init__()
        self.weight = _param(tensor_share(serial.weight, comm, 0, chunks), 0, chunks)
        self.bias = (None if serial.bias is None
                     else _param(tensor_share(serial.bias, comm, 0, chunks), 0, chunks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Columns `comm.rank` of the serial Linear; input split, output a partial sum.
    ``partial`` is the rank's term (no bias); ``forward`` all-reduces it and adds the
    (replicated) bias."""

    def __init__(self, serial: nn.Linear, comm: Comm):
        super().__init__()
        self.comm = comm
        self.weight = _param(tensor_share(serial.weight, comm, 1), 1)
        self.bias = None if serial.bias is None else _param(serial.bias, None)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_bias(reduce_from(self.partial(x), self.comm))


def check_tensor_split(n_head: int, n_embd: int, g_tensor: int) -> None:
    """ValueError naming the constraint when heads or widths do not split over G_tensor."""
    if n_head % g_tensor:
        raise ValueError(f"n_head={n_head} is not divisible by G_tensor={g_tensor}: tensor "
                         "parallelism splits attention by heads; pick --G-tensor dividing "
                         "the head count")
    if (4 * n_embd) % g_tensor or n_embd % g_tensor:
        raise ValueError(f"n_embd={n_embd} (FFN width {4 * n_embd}) is not divisible by "
                         f"G_tensor={g_tensor}; pick --G-tensor dividing the width")


class ParallelAttention(nn.Module):
    """Causal self-attention with the heads split over the tensor group."""

    def __init__(self, serial: CausalSelfAttention, comm: Comm):
        super().__init__()
        self.comm = comm
        self.n_head = serial.n_head // comm.size
        self.c_attn = ColumnParallelLinear(serial.c_attn, comm, chunks=3)
        self.c_proj = RowParallelLinear(serial.c_proj, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.c_attn(copy_to(x, self.comm)).chunk(3, dim=2)
        c = q.shape[-1]
        q, k, v = (t.view(B, T, self.n_head, c // self.n_head).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, c))


class ParallelMLP(nn.Module):
    """GPT's MLP, column-parallel c_fc then row-parallel c_proj. ``partial`` is the
    rank's output term before the all_reduce and the bias (the MoE layer reduces the
    terms of all its local experts in one call)."""

    def __init__(self, serial: MLP, comm: Comm):
        super().__init__()
        self.comm = comm
        self.c_fc = ColumnParallelLinear(serial.c_fc, comm)
        self.c_proj = RowParallelLinear(serial.c_proj, comm)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj.partial(F.gelu(self.c_fc(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from(self.partial(copy_to(x, self.comm)), self.comm)
        return self.c_proj.add_bias(y)
