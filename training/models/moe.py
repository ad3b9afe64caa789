"""Mixture-of-Experts GPT: the router and the serial single-process reference.

The router is a function of the data and the seed only, never of the parallel layout:

- Tokens are routed in *router groups* of ``router_group_tokens`` consecutive tokens of
  the global batch (sequence after sequence). Capacity, dropping and the auxiliary loss
  are computed per group, so a data-parallel rank that holds whole groups routes them
  exactly as the serial run does. Each microbatch must therefore hold whole groups.
- Capacity per expert and group: ``ceil(capacity_factor x top_k x S / E)`` tokens (S =
  group tokens, E = experts); below one token is an error. Tokens beyond capacity are
  dropped in token order (Switch Transformer for top-1, GShard for top-2, whose second
  choices queue behind every first choice of the group). A dropped assignment
  contributes nothing; the residual connection carries the token on.
- Gates: top-1 keeps the softmax probability of the chosen expert (Switch); top-2
  renormalizes the two kept probabilities to sum to one after dropping (GShard).
- Auxiliary load-balancing loss per group: ``E x sum_e mean_s(p_se) x frac_s(first
  choice = e)`` (Switch eq. 4; first choices before dropping, as GShard/DeepSpeed). The
  model's aux loss is the mean over groups, summed over MoE layers; training minimizes
  ``lm_loss + aux_loss_coef x aux``.
- No noise: the router has no randomness at all, so every tensor-parallel rank computes
  the same routing from the same input (DeepSpeed-TED's requirement for DTD).

Routing is returned per slot: ``slot_token[g, e, c]`` is the token (index inside group g)
in slot c of expert e, or -1; ``slot_weight`` its gate. The serial reference
(:class:`MoEGPT`) runs every expert on its kept tokens with a plain loop; the parallel
engine (training/ted/model.py) moves the same slots through all-to-alls. Both draw every
expert's weights from a generator private to (seed, unit, expert), so any layout holds
exactly the serial experts' weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from fractions import Fraction

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .gpt import (
    CONFIGS,
    MLP,
    Block,
    CausalSelfAttention,
    Embedding,
    GPTConfig,
    Head,
    _init_unit,
    checkpoint_interval,
)


@dataclass(frozen=True)
class MoEConfig:
    """The MoE part of a model: which blocks have experts and how tokens are routed."""

    experts: int = 4
    top_k: int = 1
    capacity_factor: float = 1.25
    moe_every: int = 2          # block j (0-based) is MoE when (j + 1) % moe_every == 0
    router_group_tokens: int = 32
    aux_loss_coef: float = 0.01

    def __post_init__(self):
        for name in ("experts", "moe_every", "router_group_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEConfig: '{name}' is {v!r}; expected a positive integer")
        if self.top_k not in (1, 2):
            raise ValueError(f"MoEConfig: top_k={self.top_k}; expected 1 (Switch) or 2 (GShard)")
        if self.top_k > self.experts:
            raise ValueError(f"MoEConfig: top_k={self.top_k} needs at least {self.top_k} experts")
        if not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig: capacity_factor={self.capacity_factor}; expected > 0")
        self.capacity()  # capacity < 1 token is an error

    def is_moe(self, block: int) -> bool:
        """Whether block `block` (0-based) has an MoE FFN."""
        return (block + 1) % self.moe_every == 0

    def capacity(self) -> int:
        """Slots per expert per router group (the drop rule's capacity)."""
        return expert_capacity(self.router_group_tokens, self.experts, self.top_k,
                               self.capacity_factor)

    def as_dict(self) -> dict:
        return asdict(self)


def expert_capacity(group_tokens: int, experts: int, top_k: int, factor: float) -> int:
    """``ceil(factor x top_k x group_tokens / experts)``, computed exactly (the factor
    as its decimal fraction, so 1.1 x 40 / 4 is 11, not 12); ValueError below one token."""
    raw = Fraction(str(factor)) * top_k * group_tokens / experts
    if raw < 1:
        raise ValueError(
            f"expert capacity {float(raw):.3g} < 1 token: capacity_factor {factor} x top_k "
            f"{top_k} x router_group_tokens {group_tokens} / experts {experts}; raise "
            "--capacity-factor or --router-group-tokens, or use fewer experts")
    return math.ceil(raw)


@dataclass
class Routing:
    """One MoE layer's routing of n_groups router groups (shapes: G groups, E experts,
    C capacity, S tokens per group)."""

    slot_token: torch.Tensor   # (G, E, C) long: token index in its group, -1 when empty
    slot_weight: torch.Tensor  # (G, E, C): the gate of that token for that expert, 0 empty
    aux_loss: torch.Tensor     # scalar: mean over groups of the load-balancing loss
    kept: int                  # token-expert assignments kept (<= top_k x G x S)
    assigned: int              # top_k x G x S


def route(logits: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """Route the (G, S, E) router logits of G groups of S tokens (module docstring)."""
    G, S, E = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    idx1 = probs.argmax(dim=-1)                                  # (G, S)
    mask1 = F.one_hot(idx1, E)                                   # (G, S, E)
    # load balancing on first choices before dropping (Switch eq. 4, GShard, DeepSpeed)
    aux = (probs.mean(dim=1) * mask1.float().mean(dim=1)).sum(dim=-1).mean() * E
    loc1 = mask1.cumsum(dim=1) - 1                               # queue position per expert
    keep1 = mask1.bool() & (loc1 < capacity)
    choices = [(idx1, keep1, loc1)]
    if top_k == 2:
        idx2 = probs.masked_fill(mask1.bool(), float("-inf")).argmax(dim=-1)
        mask2 = F.one_hot(idx2, E)
        # second choices queue behind every first choice of the group (GShard)
        loc2 = mask2.cumsum(dim=1) - 1 + mask1.sum(dim=1, keepdim=True)
        keep2 = mask2.bool() & (loc2 < capacity)
        choices.append((idx2, keep2, loc2))
    gates = [probs.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * keep.any(-1)
             for idx, keep, _ in choices]                        # (G, S) each, 0 if dropped
    if top_k == 2:
        denom = (gates[0] + gates[1]).clamp(min=torch.finfo(probs.dtype).eps)
        gates = [g / denom for g in gates]
    slot_token = torch.full((G, E, capacity + 1), -1, dtype=torch.long, device=logits.device)
    slot_weight = torch.zeros((G, E, capacity + 1), dtype=probs.dtype, device=logits.device)
    tokens = torch.arange(S, device=logits.device).expand(G, S)
    groups = torch.arange(G, device=logits.device).unsqueeze(1).expand(G, S)
    kept = 0
    for (idx, keep, loc), gate in zip(choices, gates, strict=True):
        kept_here = keep.any(-1)                                 # (G, S)
        pos = loc.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        # dropped assignments land in the spare slot `capacity`, cut off below
        pos = torch.where(kept_here, pos, torch.full_like(pos, capacity))
        slot_token[groups, idx, pos] = torch.where(kept_here, tokens, -1)
        slot_weight = slot_weight.index_put((groups, idx, pos), gate)
        kept += int(kept_here.sum())
    # the spare slot may have received several writes; it is dropped here
    return Routing(slot_token[..., :capacity].contiguous(), slot_weight[..., :capacity],
                   aux, kept, top_k * G * S)


def to_groups(x: torch.Tensor, group_tokens: int) -> torch.Tensor:
    """(B, T, C) activations as (G, S, C) router groups; ValueError unless B x T is a
    multiple of S (every microbatch must hold whole router groups)."""
    B, T, C = x.shape
    if (B * T) % group_tokens:
        raise ValueError(f"a microbatch of {B} x {T} tokens does not hold whole router groups "
                         f"of {group_tokens} tokens; make --micro-batch-size x block_size a "
                         "multiple of --router-group-tokens")
    return x.reshape(B * T // group_tokens, group_tokens, C)


# --- initialization: every draw depends on (seed, unit) or (seed, unit, expert) only ----

def expert_generator(seed: int, unit: int, expert: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + unit) * 10_007 + expert + 1)


def init_expert(mlp: nn.Module, cfg: GPTConfig, seed: int, unit: int, expert: int) -> None:
    """GPT's MLP init for expert `expert` of unit `unit`, from its private generator."""
    g = expert_generator(seed, unit, expert)
    std_proj = 0.02 / math.sqrt(2 * cfg.n_layer)
    with torch.no_grad():
        mlp.c_fc.weight.copy_(torch.randn(mlp.c_fc.weight.shape, generator=g) * 0.02)
        mlp.c_proj.weight.copy_(torch.randn(mlp.c_proj.weight.shape, generator=g) * std_proj)
        for b in (mlp.c_fc.bias, mlp.c_proj.bias):
            if b is not None:
                b.zero_()


class Router(nn.Module):
    """The gate's linear map to one logit per expert (no bias, computed in fp32)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.experts, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class SerialMoE(nn.Module):
    """The reference MoE FFN: route, then run each expert on its kept tokens (a loop).
    `with_experts=False` leaves the experts out (the parallel engine builds its own)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, with_experts: bool = True):
        super().__init__()
        self.moe = moe
        self.capacity = moe.capacity()
        self.router = Router(cfg, moe)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(moe.experts if with_experts
                                                             else 0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        xg = to_groups(x, self.moe.router_group_tokens)           # (G, S, C)
        r = route(self.router(xg), self.moe.top_k, self.capacity)
        y = torch.zeros_like(xg)
        for g in range(xg.shape[0]):
            for e, expert in enumerate(self.experts):
                slots = r.slot_token[g, e] >= 0
                tok = r.slot_token[g, e][slots]
                if tok.numel():
                    out = expert(xg[g, tok]) * r.slot_weight[g, e][slots].unsqueeze(-1)
                    y[g] = y[g].index_add(0, tok, out.to(y.dtype))
        return y.view_as(x), r


class MoEBlock(nn.Module):
    """A transformer block whose FFN is a mixture of experts."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, with_experts: bool = True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.moe = SerialMoE(cfg, moe, with_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        x = x + self.attn(self.ln_1(x))
        y, r = self.moe(self.ln_2(x))
        return x + y, r


def init_moe_unit(unit: nn.Module, index: int, cfg: GPTConfig, seed: int) -> None:
    """GPT's unit init for the non-expert parameters (one generator per unit, drawn in
    parameter order, experts skipped), then each expert from its own generator."""
    experts = getattr(getattr(unit, "moe", None), "experts", None)
    if experts is None:
        _init_unit(unit, index, cfg, seed)
        return
    unit.moe.experts = nn.ModuleList()             # hide the experts from the unit's draws
    try:
        _init_unit(unit, index, cfg, seed)
    finally:
        unit.moe.experts = experts
    for e, mlp in enumerate(experts):
        init_expert(mlp, cfg, seed, index, e)


def make_moe_unit(cfg: GPTConfig, moe: MoEConfig, index: int, seed: int,
                  with_experts: bool = True) -> nn.Module:
    """Serial unit `index` (0 embedding, 1..n_layer blocks, n_layer + 1 head); an MoE
    block without its experts when not `with_experts` (the draws of the rest are the
    same: experts have their own generators)."""
    if index == 0:
        unit = Embedding(cfg)
    elif index == cfg.n_units - 1:
        unit = Head(cfg)
    elif moe.is_moe(index - 1):
        unit = MoEBlock(cfg, moe, with_experts)
    else:
        unit = Block(cfg)
    init_moe_unit(unit, index, cfg, seed)
    return unit


@dataclass
class MoEStats:
    """What the MoE layers of one forward report: the summed aux loss, and the kept and
    assigned token-expert assignments (their ratio is the kept fraction)."""

    aux_loss: torch.Tensor
    kept: int = 0
    assigned: int = 0

    def add(self, r: Routing) -> None:
        self.aux_loss = self.aux_loss + r.aux_loss
        self.kept += r.kept
        self.assigned += r.assigned

    @property
    def dropped_fraction(self) -> float:
        return 1.0 - self.kept / self.assigned if self.assigned else 0.0


class MoEGPT(nn.Module):
    """The serial MoE GPT: token ids in, (logits, MoEStats) out. Parameter names are the
    names every layout's checkpoints consolidate to (``units.2.moe.experts.3.c_fc.weight``).
    """

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, seed: int = 0,
                 activation_checkpointing: bool = False):
        super().__init__()
        self.cfg, self.moe_cfg = cfg, moe
        self.units = nn.ModuleDict({str(i): make_moe_unit(cfg, moe, i, seed)
                                    for i in range(cfg.n_units)})
        self.activation_checkpointing = activation_checkpointing

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        recompute = None
        if self.activation_checkpointing and torch.is_grad_enabled():
            def recompute(segment, x, *blocks):
                return checkpoint(segment, x, *blocks, use_reentrant=False)
        return run_units(list(self.units.values()), idx, _serial_segment, recompute)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def run_units(units: list[nn.Module], idx: torch.Tensor, segment: Callable,
              recompute: Callable | None = None) -> tuple[torch.Tensor, MoEStats]:
    """(logits, MoEStats) of an MoE GPT's units (embedding, blocks, head) on tokens
    `idx`: the blocks run in segments of ~sqrt(N) (checkpoint_interval), each by
    ``segment(x, *blocks)`` -> (x, aux loss, (kept, assigned)), or under activation
    checkpointing by ``recompute(segment, x, *blocks)``."""
    x = units[0](idx)
    stats = MoEStats(torch.zeros((), device=x.device))
    blocks = units[1:-1]
    k = checkpoint_interval(len(blocks))
    for i in range(0, len(blocks), k):
        seg = blocks[i:i + k]
        run = segment if recompute is None else functools.partial(recompute, segment)
        x, aux, counts = run(x, *seg)
        stats.aux_loss = stats.aux_loss + aux
        stats.kept += counts[0]
        stats.assigned += counts[1]
    return units[-1](x), stats


def _serial_segment(x, *blocks):
    aux, kept, assigned = torch.zeros((), device=x.device), 0, 0
    for b in blocks:
        if isinstance(b, MoEBlock):
            x, r = b(x)
            aux = aux + r.aux_loss
            kept, assigned = kept + r.kept, assigned + r.assigned
        else:
            x = b(x)
    return x, aux, (kept, assigned)


def moe_loss(logits: torch.Tensor, targets: torch.Tensor, stats: MoEStats,
             moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to minimize, the LM loss): mean next-token cross entropy in fp32 plus
    aux_loss_coef x the summed aux loss."""
    lm = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
    return lm + moe.aux_loss_coef * stats.aux_loss, lm


# Base shapes of the MoE runs: moe-tiny for tests and CPU runs; the others are the dense
# bases of DeepSpeed-TED's experiments (dissertation ch. 7: 1.3B, 2.7B and 6.7B GPT
# bases, 2048 tokens), for the memory model.
MOE_BASES: dict[str, GPTConfig] = {
    "moe-tiny": GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16),
    "moe-mini": GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=32),
    "moe-1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=2048,
                          vocab_size=50304),
    "moe-2.7b": GPTConfig(n_layer=32, n_head=32, n_embd=2560, block_size=2048,
                          vocab_size=50304),
    "moe-6.7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048,
                          vocab_size=50304),
}


def base_config(name: str, **overrides) -> GPTConfig:
    """A base shape by name (MOE_BASES, then the GPT CONFIGS), with overrides."""
    table = {**CONFIGS, **MOE_BASES}
    if name not in table:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(table)}")
    return dataclasses.replace(table[name],
                               **{k: v for k, v in overrides.items() if v is not None})
