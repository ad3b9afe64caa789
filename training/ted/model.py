"""DeepSpeed-TED (dissertation ch. 7): an MoE GPT trained with tensor x expert x data
parallelism, duplicate token dropping (DTD) and communication-aware checkpointing (CAC).

**Groups (Eq. 7.1).** ``G = G_tensor x G_data_nonexp = G_tensor x G_expert x
G_data_exp``. Ranks are laid out tensor-fastest: ``rank = t + G_tensor x (e + G_expert x
d)`` with t the tensor, e the expert and d the expert-data coordinate.

- tensor group (t varies): Megatron tensor parallelism of attention, dense FFNs and
  every expert FFN; the same groups for expert and non-expert blocks;
- non-expert data group (e and d vary, G_data_nonexp ranks): data parallelism of the
  non-expert parameters (embeddings, attention, LayerNorms, routers, dense FFNs, head);
- expert group (e varies): experts spread over it, tokens exchanged by all_to_all;
- expert-data group (d varies, G_data_exp = G_data_nonexp / G_expert ranks): data
  parallelism of the expert parameters.

Each non-expert data rank trains on its own 1/G_data_nonexp of the global batch; the
tensor ranks of one data rank hold the same tokens.

**MoE layer**, per router group (training/models/moe.py routes): the slots of every expert
(dispatch buffer ``(E, groups, C_buf, C)``) go by all_to_all over the expert group to
the rank holding the expert, the local experts run (tensor-parallel FFNs, one
all_reduce for all of them) on the filled slots only (``run_occupied``: the empty ones
are zero rows, with capacity factor c about 1 - 1/c of the buffer), and the reverse
all_to_all brings the results back to be combined with the gates (the filled slots
only). Per MoE layer: 2 all_to_alls and 2 all_reduces (attention, experts) forward,
the same backward; no all_to_all when G_expert = 1.

**DTD.** After a tensor-parallel block every tensor rank holds the same dispatch buffer,
so without DTD each token crosses the all_to_all G_tensor times. With DTD each tensor
rank keeps only its 1/G_tensor share of the capacity dimension before each all_to_all
(``drop_share``) and an all_gather over the tensor group rebuilds the full buffer after
it (``gather_share``); backward the roles swap. All-to-all bytes shrink by exactly
G_tensor. The capacity dimension of the buffers is the drop rule's capacity rounded up
to a multiple of G_tensor (``C_buf``; the extra slots stay empty, so routing does not
depend on the layout); DTD rejects a buffer whose capacity does not divide. Routing has
no randomness, so the buffers agree across tensor ranks; ``debug_checks=True`` verifies
it on every MoE call, recomputations included (an all_gather over the tensor group, then
an all_reduce over the world so that every rank raises when any group differs).

**Mixtral** (``--arch mixtral``, a MixtralConfig): Llama's blocks (training/models/
mixtral.py) with the same groups: q_proj, k_proj and v_proj N-layers split by heads over
the tensor group (key/value heads too: n_kv_head must divide by G_tensor), o_proj a
T-layer; SwiGLU FFNs and experts with gate_proj and up_proj N-layers and down_proj a
T-layer; RMSNorms, routers, embedding and head replicated.

**Dropless** (``capacity_factor=0``): each MoE call sizes its capacity to the largest
load of one expert in one router group, agreed by an all_reduce (MAX) over the expert
group (the ranks whose buffers the all_to_all exchanges; through CAC's stash, so a
recomputation replays it). Nothing is dropped, so the result does not depend on it.

**CAC.** With activation checkpointing, blocks run in segments of ~sqrt(N) under
``cac.checkpointed``; with ``cac=True`` the recomputation replays the forward
collectives' stashed outputs instead of communicating again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import mcrdl
from mcrdl.launch import launch_command

from ..core.backends import KINDS, Backends
from ..core.cac import checkpointed, through_stash
from ..core.checkpoint import load_serial_part
from ..core.sharding import Split, split_of
from ..core.topology import Axis, ProcessGrid
from ..models import llama
from ..models import mixtral as mixtral_model
from ..models.gpt import ACTIVATIONS, MLP, Block, Embedding, GPTConfig, Head
from ..models.init_source import SerialSource
from ..models.moe import (
    MoEBlock,
    MoEConfig,
    MoEStats,
    Routing,
    init_expert,
    make_moe_unit,
    route,
    run_units,
)
from ..models.moe import to_groups as _to_groups
from ..tensor_parallel.comm import AxisComm, TensorComms
from ..tensor_parallel.layers import ParallelLinear, ParallelMLP, ParallelSelfAttention
from .autograd_collectives import (
    Comm,
    all_to_all,
    copy_to,
    drop_share,
    gather_share,
    reduce_from,
)


@dataclass(frozen=True)
class TEDLayout:
    """(G_tensor, G_expert, G_data_nonexp) on a world of G_tensor x G_data_nonexp ranks."""

    g_tensor: int = 1
    g_expert: int = 1
    g_data: int = 1  # G_data_nonexp

    @property
    def world_size(self) -> int:
        return self.g_tensor * self.g_data

    @property
    def g_data_exp(self) -> int:
        return self.g_data // self.g_expert

    def check(self, model: GPTConfig | None = None, moe: MoEConfig | None = None,
              world_size: int | None = None) -> None:
        """ValueError naming the violated constraint."""
        for name in ("g_tensor", "g_expert", "g_data"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('g_', 'G-')} is {v!r}; expected a positive "
                                 "integer")
        if self.g_data % self.g_expert:
            raise ValueError(f"G_data_nonexp={self.g_data} is not divisible by G_expert="
                             f"{self.g_expert}: the expert groups decompose the non-expert data "
                             "group (G_data_exp = G_data_nonexp / G_expert, Eq. 7.1)")
        if world_size is not None and world_size != self.world_size:
            raise ValueError(f"G_tensor={self.g_tensor} x G_data_nonexp={self.g_data} = "
                             f"{self.world_size} ranks, but the world has {world_size}; launch "
                             f"with {launch_command(self.world_size)} or change --G-tensor/"
                             "--G-data")
        if moe is not None and moe.experts % self.g_expert:
            raise ValueError(f"experts={moe.experts} is not divisible by G_expert="
                             f"{self.g_expert}: every expert rank holds experts/G_expert "
                             "experts; pick --G-expert dividing --experts")
        if isinstance(model, llama.LlamaConfig):
            check_llama_split(model, self.g_tensor)
        elif model is not None:
            check_tensor_split(model.n_head, model.n_embd, self.g_tensor)
        if model is not None and moe is not None and \
                not any(moe.is_moe(j) for j in range(model.n_layer)):
            raise ValueError(f"--moe-every={moe.moe_every} with --n-layer={model.n_layer}: no "
                             "block has experts (block j has them when (j + 1) % moe_every "
                             "== 0); set --moe-every <= --n-layer")

    def describe(self) -> str:
        return (f"G_tensor={self.g_tensor} x G_expert={self.g_expert} x G_data_exp="
                f"{self.g_data_exp} (G_data_nonexp={self.g_data})")


class TEDGroups:
    """This rank's groups of a layout (collective over the world: every rank builds it
    with the same layout). Comms: ``tensor``, ``expert``, ``data_exp``, ``data_nonexp``,
    and ``world``."""

    def __init__(self, layout: TEDLayout, backends: Backends | None = None, *,
                 world_size: int | None = None, rank: int | None = None):
        layout.check(world_size=world_size)
        self.layout, self.backends = layout, backends or Backends()
        self.grid = ProcessGrid({Axis.TENSOR: layout.g_tensor, Axis.EXPERT: layout.g_expert,
                                 Axis.DATA: layout.g_data_exp},
                                order=[Axis.TENSOR, Axis.EXPERT, Axis.DATA],
                                world_size=world_size, rank=rank)
        b = self.backends
        self.tensor = Comm(self.grid.group(Axis.TENSOR), b, "tensor")
        self.expert = Comm(self.grid.group(Axis.EXPERT), b, "expert")
        self.data_exp = Comm(self.grid.group(Axis.DATA), b, "data_exp")
        self.data_nonexp = Comm(self.grid.plane_group([Axis.EXPERT, Axis.DATA]), b,
                                "data_nonexp")
        self.world = Comm.world(b, self.grid.world_size, self.grid.rank)
        # Megatron's tensor parallelism is the 4D engine's N/T layers with X alone
        by_op = {KINDS[k]: b.of(k) for k in KINDS}
        self.tensor_comms = TensorComms(AxisComm("x", self.tensor.group, by_op),
                                        *(AxisComm(a, None) for a in ("y", "z", "data")))
        self.rank = self.grid.rank
        self.tensor_rank = self.grid.coord(Axis.TENSOR)
        self.expert_rank = self.grid.coord(Axis.EXPERT)
        self.data_rank = self.data_nonexp.rank  # the batch shard: e + G_expert x d

    def local_experts(self, experts: int) -> list[int]:
        """The global indices of the experts this rank holds."""
        per = experts // self.layout.g_expert
        return list(range(self.expert_rank * per, (self.expert_rank + 1) * per))


def check_tensor_split(n_head: int, n_embd: int, g_tensor: int) -> None:
    """ValueError naming the constraint when heads or widths do not split over G_tensor."""
    if n_head % g_tensor:
        raise ValueError(f"n_head={n_head} is not divisible by G_tensor={g_tensor}: tensor "
                         "parallelism splits attention by heads; pick --G-tensor dividing "
                         "the head count")
    if (4 * n_embd) % g_tensor or n_embd % g_tensor:
        raise ValueError(f"n_embd={n_embd} (FFN width {4 * n_embd}) is not divisible by "
                         f"G_tensor={g_tensor}; pick --G-tensor dividing the width")


def check_llama_split(cfg: llama.LlamaConfig, g_tensor: int) -> None:
    """ValueError naming the constraint when a Llama/Mixtral's query heads, key/value
    heads or SwiGLU width do not split over G_tensor."""
    for name, n, what in (("n_head", cfg.n_head, "attention by query heads"),
                          ("n_kv_head", cfg.n_kv_head, "grouped-query attention's key/value "
                           "heads with their query heads"),
                          ("intermediate_size", cfg.intermediate_size,
                           "the SwiGLU FFNs and experts by width")):
        if n % g_tensor:
            raise ValueError(f"{name}={n} is not divisible by G_tensor={g_tensor}: tensor "
                             f"parallelism splits {what}; pick --G-tensor dividing {n}")


def mark_replicated(module: nn.Module) -> None:
    """Give every parameter of `module` without a ``split`` the whole-tensor one: held
    entire by every tensor rank (embeddings, LayerNorms, routers, the head)."""
    for p in module.parameters():
        if split_of(p) is None:
            p.split = Split(tuple(p.shape))


def local_weight(layer: ParallelLinear) -> torch.Tensor:
    """`layer`'s block [out, in] on this rank, a view of its parameter (gradients reach
    it through torch's autograd). An expert's ``partial`` is its local matmuls: TED's
    tensor comms have X only (TEDGroups), so no Y or Z collective and no weight to
    gather, and ``partial`` leaves X's to the MoE layer (ParallelLinear.partial)."""
    return layer.weight.view(layer.weight.split.block_shape(layer.comms.sizes()))


class ExpertFFN(ParallelMLP):
    """One expert's FFN on this tensor rank (c_fc an N-layer, c_proj a T-layer over the
    tensor group: Megatron's column/row pair), run by ``partial``: the MoE layer reduces
    the terms of all its local experts over the tensor group at once, one ``copy_to``
    before and one ``reduce_from`` after, and adds c_proj's bias itself."""

    def partial(self, h: torch.Tensor) -> torch.Tensor:
        a = F.linear(h, local_weight(self.c_fc), self.c_fc.bias)
        return F.linear(F.gelu(a, approximate=self.approximate), local_weight(self.c_proj))

    @property
    def out_bias(self) -> torch.Tensor | None:
        return self.c_proj.bias

    def input_grad_at_zero(self, g: torch.Tensor) -> torch.Tensor:
        """This rank's term of the gradient of ``partial`` at zero input rows, for the
        output gradient rows `g`: the FFN's Jacobian at 0 is c_proj's weight times
        gelu'(c_fc's bias) times c_fc's weight (run_occupied)."""
        w1, w2 = (local_weight(layer).detach() for layer in (self.c_fc, self.c_proj))
        b = (self.c_fc.bias.detach().clone() if self.c_fc.bias is not None
             else w1.new_zeros(w1.shape[0])).reshape(-1)
        with torch.enable_grad():
            b.requires_grad_(True)
            slope, = torch.autograd.grad(F.gelu(b, approximate=self.approximate).sum(), b)
        return ((g @ w2) * slope) @ w1


class ParallelSwiGLU(nn.Module):
    """Llama's SwiGLU FFN on this tensor rank: gate_proj and up_proj N-layers, down_proj
    a T-layer over the tensor group. ``partial`` as ExpertFFN's (an expert)."""

    out_bias = None

    def __init__(self, serial: nn.Module, comms, prefix: str):
        super().__init__()
        for n, transposed in (("gate_proj", False), ("up_proj", False), ("down_proj", True)):
            setattr(self, n, ParallelLinear(getattr(serial, n).weight.data, None, comms,
                                            transposed=transposed, name=f"{prefix}.{n}"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def partial(self, h: torch.Tensor) -> torch.Tensor:
        gate, up, down = (local_weight(getattr(self, n))
                          for n in ("gate_proj", "up_proj", "down_proj"))
        return F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)

    def input_grad_at_zero(self, g: torch.Tensor) -> torch.Tensor:
        """Zero (run_occupied): without biases silu(gate x) * (up x) and its derivative
        silu'(gate x) (gate dx) (up x) + silu(gate x) (up dx) vanish at x = 0."""
        return g.new_zeros(g.shape[0], self.gate_proj.in_features)


class ParallelLlamaAttention(nn.Module):
    """Llama's attention with its query heads and key/value heads split over the tensor
    group (q_proj, k_proj, v_proj N-layers; o_proj a T-layer): rank t holds query heads
    t*H/G..(t+1)*H/G-1 and the key/value heads serving them."""

    def __init__(self, serial: llama.Attention, cfg: llama.LlamaConfig, comms, name: str):
        super().__init__()
        g = comms.x.size
        self.local_heads, self.local_kv = serial.n_head // g, serial.n_kv_head // g
        self.head_dim = serial.head_dim
        # computed here: the serial module may be a template without storage
        self.register_buffer("inv_freq", llama.rope_frequencies(cfg), persistent=False)
        for n, transposed in (("q_proj", False), ("k_proj", False), ("v_proj", False),
                              ("o_proj", True)):
            setattr(self, n, ParallelLinear(getattr(serial, n).weight.data, None, comms,
                                            transposed=transposed, name=f"{name}.{n}"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h, kv, d = self.local_heads, self.local_kv, self.head_dim
        q = self.q_proj(x).view(B, T, h, d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, kv, d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, kv, d).transpose(1, 2)
        cos, sin = llama.Attention.rotary(self, T, x.dtype)  # from this module's inv_freq
        q = q * cos + llama._rotate_half(q) * sin
        k = k * cos + llama._rotate_half(k) * sin
        k = k.repeat_interleave(h // kv, dim=1)
        v = v.repeat_interleave(h // kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, h * d))


def buffer_capacity(capacity: int, g_tensor: int) -> int:
    """The capacity dimension of the dispatch buffers: the drop rule's capacity rounded
    up to a multiple of G_tensor (DTD splits it over the tensor ranks)."""
    return -(-capacity // g_tensor) * g_tensor


class ParallelMoE(nn.Module):
    """The MoE FFN of one block on one rank: the router (replicated), this rank's
    experts (tensor-parallel FFNs), dispatch and combine (module docstring)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, serial_router: nn.Module,
                 experts: dict[int, nn.Module], groups: TEDGroups, *, dtd: bool = False,
                 debug_checks: bool = False, prefix: str = "moe"):
        super().__init__()
        self.moe, self.groups = moe, groups
        self.capacity = moe.capacity()  # None: dropless, sized per call
        g_t = groups.layout.g_tensor
        self.capacity_buf = None if self.capacity is None else \
            buffer_capacity(self.capacity, g_t)
        # DTD only pays where an all_to_all carries duplicates
        self.dtd = dtd and groups.tensor.active and groups.expert.active
        if self.dtd and self.capacity_buf is not None and self.capacity_buf % g_t:
            raise ValueError(f"DTD: expert capacity {self.capacity_buf} is not a multiple of "
                             f"G_tensor={g_t}")  # by construction; kept as the rule
        self.debug_checks = debug_checks
        self.router = serial_router
        comms = groups.tensor_comms
        self.experts = nn.ModuleDict({
            str(e): (ParallelSwiGLU(mlp, comms, f"{prefix}.experts.{e}")
                     if isinstance(mlp, llama.MLP)
                     else ExpertFFN(mlp, comms, f"{prefix}.experts.{e}",
                                    approximate=ACTIVATIONS[cfg.activation]))
            for e, mlp in experts.items()})
        for p in self.experts.parameters():
            p.expert = True

    def _check_replicated(self, buf: torch.Tensor, what: str) -> None:
        """Debug: `buf` is bitwise the same on every tensor rank (DTD's premise)."""
        tensor = self.groups.tensor
        if not tensor.active:
            return
        everyone = tensor.all_gather(buf.detach().contiguous().unsqueeze(0))
        differs = next((r for r in range(tensor.size)
                        if not torch.equal(everyone[r], everyone[0])), None)
        # every rank learns of a mismatch in any tensor group and raises here: the others
        # would wait in the next all_to_all for ranks that raised, and report a timeout
        seen = torch.tensor([-1.0 if differs is None else float(self.groups.rank)],
                            dtype=torch.float64, device=buf.device)
        self.groups.world.all_reduce(seen, op=mcrdl.ReduceOp.MAX)
        rule = ("DTD needs identical buffers (routing must not depend on the tensor "
                "coordinate)")
        if differs is not None:
            raise RuntimeError(f"TED debug check: the {what} differs between tensor ranks "
                               f"0 and {differs} of world rank {self.groups.rank}'s tensor "
                               f"group; {rule}")
        if seen.item() >= 0:
            raise RuntimeError(f"TED debug check: the {what} differs between the tensor ranks "
                               f"of world rank {int(seen.item())}'s tensor group (this rank's "
                               f"group agrees); {rule}")

    def _agree(self, count: int) -> int:
        """Dropless: the largest of `count` over the expert group (tensor ranks route
        alike, so they agree already)."""
        expert = self.groups.expert
        if not expert.active:
            return count
        t = torch.tensor([float(count)], dtype=torch.float64,
                         device=self.router.weight.device)
        out = through_stash("all_reduce", lambda: expert.all_reduce(t, op=mcrdl.ReduceOp.MAX))
        return int(out.item())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        E, d = self.moe.experts, x.shape[-1]
        xg = _to_groups(x, self.moe.router_group_tokens)            # (G, S, d)
        n_groups, S, _ = xg.shape
        r = route(self.router(xg), self.moe.top_k, self.capacity, self.moe.gating,
                  agree=self._agree)
        C = buffer_capacity(r.capacity, self.groups.layout.g_tensor)
        pad = C - r.capacity
        slot_token = F.pad(r.slot_token, (0, pad), value=-1)         # (G, E, C)
        slot_weight = F.pad(r.slot_weight, (0, pad))
        # token S of each group is a zero row: the empty slots read it
        flat = (torch.arange(n_groups, device=x.device).view(-1, 1, 1) * (S + 1)
                + torch.where(slot_token >= 0, slot_token, S)).view(-1)
        xpad = F.pad(xg, (0, 0, 0, 1)).view(-1, d)
        disp = xpad.index_select(0, flat.view(n_groups, E, C).transpose(0, 1).reshape(-1))
        disp = disp.view(E, n_groups, C, d)                          # (E, G, C, d)
        if self.debug_checks:
            self._check_replicated(disp, "dispatch buffer")
        h = self._experts(self._exchange(disp, dim=2), n_groups)     # (E, G, C, d)
        # combine the filled slots only, in (group, expert, slot) order
        g_i, e_i, c_i = (slot_token >= 0).nonzero(as_tuple=True)
        out = h.reshape(-1, d).index_select(0, (e_i * n_groups + g_i) * C + c_i)
        out = out * slot_weight[g_i, e_i, c_i].unsqueeze(-1).to(h.dtype)
        y = torch.zeros(n_groups * S, d, dtype=x.dtype, device=x.device)
        y = y.index_add(0, g_i * S + slot_token[g_i, e_i, c_i], out.to(x.dtype))
        return y.view(x.shape), r

    def _exchange(self, buf: torch.Tensor, dim: int) -> torch.Tensor:
        """`buf` (experts or blocks of experts first) through the all_to_all over the
        expert group, with DTD's drop before and all_gather after it."""
        g = self.groups
        if self.dtd:
            buf = drop_share(buf, dim, g.tensor)
        buf = all_to_all(buf, g.expert)
        if self.dtd:
            buf = gather_share(buf, dim, g.tensor)
        return buf

    def _experts(self, recv: torch.Tensor, n_groups: int) -> torch.Tensor:
        """Run the local experts on the received slots (G_expert sources x local experts
        first), send the results back; returns (E, G, C, d) in the dispatch order."""
        g = self.groups
        g_e, n_local = g.layout.g_expert, len(self.experts)
        C, d = recv.shape[2], recv.shape[3]
        h = copy_to(recv.view(g_e, n_local, n_groups * C, d), g.tensor)
        experts = list(self.experts.values())
        y = reduce_from(run_occupied(experts, h), g.tensor)          # one all_reduce for all
        if experts[0].out_bias is not None:
            y = y + torch.stack([ex.out_bias for ex in experts]).view(1, n_local, 1, d)
        return self._exchange(y.view(g_e * n_local, n_groups, C, d), dim=2)


def run_occupied(experts: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """``experts[i].partial`` of the slot rows ``x[:, i]`` ((sources, local experts,
    slots, d), the all_to_all's order, kept for the results), run on the rows that are
    not all zeros only. The empty slots of a dispatch buffer are zero rows (with
    capacity factor c, about 1 - 1/c of the slots), and every zero row of an expert has
    the same output, the expert's at 0: it is computed once, on one zero row put first,
    and read by every zero row. Forward values and parameter gradients are those of the
    whole buffer (the zero rows' output gradients sum into that one row); the input
    gradient of a zero row is the expert's Jacobian at 0 applied to its output gradient
    (``input_grad_at_zero``), nonzero only for a token whose row is all zeros (an empty
    slot's output gradient is zero: its gate is 0). Communication is unchanged."""
    sources, n_local, slots, d = x.shape
    flat = x.reshape(-1, d)
    zero = flat.eq(0).all(dim=-1)                                   # (rows,)
    ids = torch.arange(flat.shape[0], device=x.device).view(sources, n_local, slots)
    filled = ~zero.view(sources, n_local, slots)
    where = torch.empty(flat.shape[0], dtype=torch.long, device=x.device)
    outs, offset = [], 0
    for i, expert in enumerate(experts):
        mine, full = ids[:, i].reshape(-1), filled[:, i].reshape(-1)
        compact = torch.cat([flat.new_zeros(1, d), flat.index_select(0, mine[full])])
        outs.append(expert.partial(compact))
        where[mine] = offset + torch.cumsum(full, 0) * full          # offset: its zero row
        offset += compact.shape[0]
    y = torch.cat(outs).index_select(0, where)
    if x.requires_grad:
        y = _ZeroRowsInputGrad.apply(y, flat, zero, experts, n_local * slots, slots)
    return y.view(x.shape)


class _ZeroRowsInputGrad(torch.autograd.Function):
    """Identity on `y`; backward, the input gradient of the zero rows of `x` that have
    an output gradient (run_occupied): row r belongs to expert (r mod per_source) //
    slots."""

    @staticmethod
    def forward(ctx, y, x, zero, experts, per_source, slots):
        ctx.save_for_backward(zero)
        ctx.experts, ctx.per_source, ctx.slots = experts, per_source, slots
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        (zero,) = ctx.saved_tensors
        rows = (zero & g.ne(0).any(dim=-1)).nonzero().squeeze(1)
        gx = None
        if rows.numel():
            gx = torch.zeros(ctx.x_shape, dtype=ctx.x_dtype, device=g.device)
            owner = rows % ctx.per_source // ctx.slots
            for i, expert in enumerate(ctx.experts):
                r = rows[owner == i]
                if r.numel():
                    gx[r] = expert.input_grad_at_zero(g[r]).to(ctx.x_dtype)
        return g, gx, None, None, None, None


class ParallelBlock(nn.Module):
    """A transformer block with tensor-parallel attention and a tensor-parallel dense FFN
    (``mlp``) or MoE FFN (``moe``)."""

    def __init__(self, serial: nn.Module, cfg: GPTConfig, moe: MoEConfig, groups: TEDGroups,
                 experts: dict[int, nn.Module] | None, dtd: bool, debug_checks: bool,
                 prefix: str):
        super().__init__()
        comms = groups.tensor_comms
        self.ln_1, self.ln_2 = serial.ln_1, serial.ln_2
        self.attn = ParallelSelfAttention(serial.attn, cfg.n_head, comms, f"{prefix}.attn")
        if isinstance(serial, MoEBlock):
            self.moe = ParallelMoE(cfg, moe, serial.moe.router, experts, groups, dtd=dtd,
                                   debug_checks=debug_checks, prefix=f"{prefix}.moe")
        else:
            self.mlp = ParallelMLP(serial.mlp, comms, f"{prefix}.mlp",
                                   approximate=ACTIVATIONS[cfg.activation])

    def norms(self):
        return self.ln_1, self.ln_2

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing | None]:
        norm_1, norm_2 = self.norms()
        x = x + self.attn(norm_1(x))
        if hasattr(self, "moe"):
            y, r = self.moe(norm_2(x))
            return x + y, r
        return x + self.mlp(norm_2(x)), None


class ParallelLlamaBlock(ParallelBlock):
    """A Llama/Mixtral block: tensor-parallel attention (ParallelLlamaAttention) and a
    SwiGLU FFN (``mlp``) or MoE FFN of SwiGLU experts (``moe``); serial parameter names."""

    def __init__(self, serial: nn.Module, cfg: llama.LlamaConfig, moe: MoEConfig,
                 groups: TEDGroups, experts: dict[int, nn.Module] | None, dtd: bool,
                 debug_checks: bool, prefix: str):
        nn.Module.__init__(self)
        comms = groups.tensor_comms
        self.input_layernorm = serial.input_layernorm
        self.post_attention_layernorm = serial.post_attention_layernorm
        self.self_attn = ParallelLlamaAttention(serial.self_attn, cfg, comms,
                                                f"{prefix}.self_attn")
        if isinstance(serial, mixtral_model.MixtralBlock):
            self.moe = ParallelMoE(cfg, moe, serial.moe.router, experts, groups, dtd=dtd,
                                   debug_checks=debug_checks, prefix=f"{prefix}.moe")
        else:
            self.mlp = ParallelSwiGLU(serial.mlp, comms, f"{prefix}.mlp")

    @property
    def attn(self):
        return self.self_attn

    def norms(self):
        return self.input_layernorm, self.post_attention_layernorm


class TEDGPT(nn.Module):
    """This rank's share of the MoE GPT (training/models/moe.py's MoEGPT) under a TED layout.
    Parameter names are the serial model's; each parameter carries its ``split``
    (training/tensor_parallel/layers.py: X is the tensor group) and expert parameters
    ``expert = True``.

    ``state_dict``: start from the serial model's weights (any layout's, consolidated:
    a dict, or a training/models/init_source.py SerialSource) instead of `seed`'s
    draws; every rank takes its pieces (from a SerialSource it reads only the experts
    it holds).

    ``activation_checkpointing`` runs the blocks in segments of checkpoint_interval(N)
    blocks; ``cac`` stashes their forward collectives for the recomputation;
    ``early_stop=False`` makes torch recompute whole segments (call-count baselines)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, groups: TEDGroups, seed: int = 0, *,
                 dtd: bool = False, cac: bool = False, activation_checkpointing: bool = False,
                 early_stop: bool = True, debug_checks: bool = False,
                 state_dict: dict[str, torch.Tensor] | SerialSource | None = None):
        super().__init__()
        groups.layout.check(cfg, moe)
        self.cfg, self.moe_cfg, self.groups = cfg, moe, groups
        self.dtd, self.cac = dtd, cac
        self.activation_checkpointing, self.early_stop = activation_checkpointing, early_stop
        local = groups.local_experts(moe.experts)
        is_llama = isinstance(cfg, llama.LlamaConfig)
        if is_llama:
            make, expert, draw = (mixtral_model.make_unit, llama.MLP,
                                  mixtral_model.init_expert)
            block = ParallelLlamaBlock
        else:
            make, expert, draw, block = make_moe_unit, MLP, init_expert, ParallelBlock
        # a SerialSource (--init-from): every parameter read as this rank's piece, after
        # the block is built; a dict (a consolidated state_dict in memory): the serial
        # unit and experts loaded whole, then cut
        pieces = isinstance(state_dict, SerialSource)
        whole = None if pieces else state_dict
        units = {}
        for i in range(cfg.n_units):
            # the serial unit without its experts; this rank's experts drawn on their own
            # (reading pieces: built without storage, which only the pieces get)
            with torch.device("meta") if pieces else contextlib.nullcontext():
                serial = make(cfg, moe, i, seed, with_experts=False)
            if whole is not None:
                load_serial_part(serial, whole, f"units.{i}.")
            if isinstance(serial, (Embedding, Head, llama.Embedding, llama.Head)):
                units[str(i)] = serial
                if pieces:
                    materialize(serial)
                    state_dict.load_into(serial, f"units.{i}.")
                continue
            experts = None
            if getattr(serial, "routes", False):
                experts = {}
                for e in local:
                    if pieces:  # no weights until this rank's pieces are read
                        with torch.device("meta"):
                            experts[e] = expert(cfg)
                        continue
                    experts[e] = expert(cfg)
                    draw(experts[e], cfg, seed, i, e)
                    if whole is not None:
                        load_serial_part(experts[e], whole, f"units.{i}.moe.experts.{e}.")
            assert isinstance(serial, (Block, MoEBlock, llama.Block, mixtral_model.MixtralBlock))
            units[str(i)] = block(serial, cfg, moe, groups, experts, dtd, debug_checks,
                                  f"units.{i}")
            del serial, experts
            if pieces:
                materialize(units[str(i)])
                load_pieces(units[str(i)], state_dict, f"units.{i}.", groups.tensor_comms)
        self.units = nn.ModuleDict(units)
        mark_replicated(self)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        recompute = None
        if self.activation_checkpointing and torch.is_grad_enabled():
            def recompute(segment, x, *blocks):
                return checkpointed(segment, x, *blocks, cac=self.cac,
                                    early_stop=self.early_stop)
        return run_units(list(self.units.values()), idx, _segment, recompute, self.moe_cfg)

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if getattr(p, "expert", False)]

    def nonexpert_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if not getattr(p, "expert", False)]


def piece_index(split: Split | None, coords: dict[str, int],
                sizes: dict[str, int]) -> tuple[slice, ...] | None:
    """The index of this rank's piece of a parameter in the serial tensor: rows and
    columns as its ``split`` cuts them (the tensor group's X; None: the whole tensor, or
    a split the slices cannot express: a row permutation, a Z shard)."""
    if split is None or not split.split_axes or split.perm is not None or \
            (split.z and sizes["z"] > 1):
        return None
    bs = split.block_shape(sizes)
    index = [slice(None)] * len(split.shape)
    for dim, axis in enumerate((split.rows, split.cols)):
        if axis:
            c = coords[axis]
            index[dim] = slice(c * bs[dim], (c + 1) * bs[dim])
    return tuple(index)


def materialize(module: nn.Module) -> None:
    """Storage (uninitialized, on the CPU) for the parameters of `module` built on the meta
    device, keeping each parameter's attributes (``split``, ``expert``)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                new = nn.Parameter(torch.empty_like(p, device="cpu"),
                                   requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                m._parameters[name] = new


def load_pieces(module: nn.Module, source: SerialSource, prefix: str, comms) -> None:
    """Every parameter of `module` (a parallel block, its experts included) from
    `source`'s tensor ``prefix + name``, reading only this rank's piece of it."""
    coords, sizes = comms.coords(), comms.sizes()
    with torch.no_grad():
        for name, p in module.named_parameters():
            split = split_of(p)
            index = piece_index(split, coords, sizes)
            t = source.part(prefix + name, index)
            if index is None and split is not None and split.split_axes:
                t = split.local(t, coords, sizes, prefix + name)  # read whole, then cut
            p.copy_(t.reshape(p.shape))


def _segment(x, *blocks):
    aux, loads = torch.zeros((), device=x.device), []
    for b in blocks:
        x, r = b(x)
        if r is not None:
            aux = aux + r.aux_loss
            loads.append((r.tokens, r.kept_per_expert))
    return x, aux, loads


def count_parameters(model: nn.Module) -> dict[str, int]:
    """This rank's parameter elements: expert and non-expert."""
    out = {"expert": 0, "nonexpert": 0}
    for p in model.parameters():
        out["expert" if getattr(p, "expert", False) else "nonexpert"] += p.numel()
    return out
