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
- Mixtral gating (``gating="mixtral"``, Jiang et al. 2024; Hugging Face's
  MixtralSparseMoeBlock): the top_k experts by router probability, their gates the
  softmax over the selected logits (the top_k probabilities renormalized to sum to one,
  before any dropping); choice j queues behind every earlier choice of the group. Its
  auxiliary loss is HF's ``load_balancing_loss_func``: per group, ``E x sum_e f_e x
  P_e`` where f_e is the fraction of top_k selections and P_e the mean probability of
  expert e, both pooled over the MoE layers (not a sum of per-layer terms).
- Dropless (``capacity_factor=0``): the capacity of a layer call is the largest count of
  assignments to one expert in one group, so nothing is dropped; a parallel engine
  agrees on it over the ranks that exchange slots (``route``'s ``agree``). Routing,
  gates and outputs are then the same whatever the capacity.
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

GATINGS = ("gshard", "mixtral")


@dataclass(frozen=True)
class MoEConfig:
    """The MoE part of a model: which blocks have experts and how tokens are routed."""

    experts: int = 4
    top_k: int = 1
    capacity_factor: float = 1.25
    moe_every: int = 2          # block j (0-based) is MoE when (j + 1) % moe_every == 0
    router_group_tokens: int = 32
    aux_loss_coef: float = 0.01
    gating: str = "gshard"      # "gshard" (top-1 Switch, top-2 GShard) or "mixtral"

    def __post_init__(self):
        for name in ("experts", "moe_every", "router_group_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEConfig: '{name}' is {v!r}; expected a positive integer")
        if self.gating not in GATINGS:
            raise ValueError(f"MoEConfig: gating={self.gating!r}; expected one of "
                             f"{', '.join(GATINGS)}")
        if self.gating == "gshard" and self.top_k not in (1, 2):
            raise ValueError(f"MoEConfig: top_k={self.top_k}; expected 1 (Switch) or 2 (GShard)")
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"MoEConfig: top_k={self.top_k!r}; expected a positive integer")
        if self.top_k > self.experts:
            raise ValueError(f"MoEConfig: top_k={self.top_k} needs at least {self.top_k} experts")
        if not self.capacity_factor >= 0:
            raise ValueError(f"MoEConfig: capacity_factor={self.capacity_factor}; expected > 0 "
                             "(or 0: dropless)")
        self.capacity()  # capacity < 1 token is an error

    def is_moe(self, block: int) -> bool:
        """Whether block `block` (0-based) has an MoE FFN."""
        return (block + 1) % self.moe_every == 0

    @property
    def dropless(self) -> bool:
        return self.capacity_factor == 0

    def capacity(self) -> int | None:
        """Slots per expert per router group (the drop rule's capacity); None when
        dropless (each layer call sizes it to its largest expert load)."""
        if self.dropless:
            return None
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
    # gshard: scalar, the mean over groups of the load-balancing loss; mixtral: (G, 2, E),
    # per group the top_k selections and the summed probabilities of each expert, which
    # the model pools over its MoE layers (finish_aux)
    aux_loss: torch.Tensor
    kept: int                  # token-expert assignments kept (<= top_k x G x S)
    assigned: int              # top_k x G x S
    tokens: torch.Tensor       # (E,) long: assignments routed to each expert (all groups)
    kept_per_expert: torch.Tensor  # (E,) long: of those, kept (not dropped)

    @property
    def capacity(self) -> int:
        return self.slot_token.shape[-1]


def route(logits: torch.Tensor, top_k: int, capacity: int | None, gating: str = "gshard",
          agree: Callable[[int], int] | None = None) -> Routing:
    """Route the (G, S, E) router logits of G groups of S tokens (module docstring).
    `capacity` None: dropless, the largest count of assignments to one expert in one
    group, agreed by ``agree(count) -> count`` (a maximum over the ranks whose slots are
    exchanged) when given."""
    G, S, E = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    if gating == "mixtral":
        top_p, top_i = torch.topk(probs, top_k, dim=-1)           # (G, S, k)
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)           # before any dropping
        idxs = list(top_i.unbind(-1))
    else:
        idxs = [probs.argmax(dim=-1)]                              # (G, S)
        if top_k == 2:
            idxs.append(probs.masked_fill(F.one_hot(idxs[0], E).bool(), float("-inf"))
                        .argmax(dim=-1))
    masks = [F.one_hot(idx, E) for idx in idxs]                    # (G, S, E) each
    counts = sum(m.sum(dim=1) for m in masks)                      # (G, E) before dropping
    if capacity is None:
        need = int(counts.max())
        capacity = max(1, agree(need) if agree is not None else need)
    if gating == "mixtral":
        aux = torch.stack((counts.to(probs.dtype), probs.sum(dim=1)), dim=1)  # (G, 2, E)
    else:
        # load balancing on first choices before dropping (Switch eq. 4, GShard, DeepSpeed)
        aux = (probs.mean(dim=1) * masks[0].float().mean(dim=1)).sum(dim=-1).mean() * E
    choices, before = [], 0
    for idx, mask in zip(idxs, masks, strict=True):
        # choice j queues behind every earlier choice of the group (GShard's second choices)
        loc = mask.cumsum(dim=1) - 1 + before
        choices.append((idx, mask.bool() & (loc < capacity), loc))
        before = before + mask.sum(dim=1, keepdim=True)
    if gating == "mixtral":
        gates = [top_p[..., j] * keep.any(-1) for j, (_, keep, _) in enumerate(choices)]
    else:
        gates = [probs.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * keep.any(-1)
                 for idx, keep, _ in choices]                      # (G, S) each, 0 if dropped
        if top_k == 2:
            denom = (gates[0] + gates[1]).clamp(min=torch.finfo(probs.dtype).eps)
            gates = [g / denom for g in gates]
    slot_token = torch.full((G, E, capacity + 1), -1, dtype=torch.long, device=logits.device)
    slot_weight = torch.zeros((G, E, capacity + 1), dtype=probs.dtype, device=logits.device)
    tokens = torch.arange(S, device=logits.device).expand(G, S)
    groups = torch.arange(G, device=logits.device).unsqueeze(1).expand(G, S)
    kept = 0
    kept_per_expert = torch.zeros(E, dtype=torch.long, device=logits.device)
    for (idx, keep, loc), gate in zip(choices, gates, strict=True):
        kept_here = keep.any(-1)                                 # (G, S)
        pos = loc.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        # dropped assignments land in the spare slot `capacity`, cut off below
        pos = torch.where(kept_here, pos, torch.full_like(pos, capacity))
        slot_token[groups, idx, pos] = torch.where(kept_here, tokens, -1)
        slot_weight = slot_weight.index_put((groups, idx, pos), gate)
        kept += int(kept_here.sum())
        kept_per_expert += keep.sum(dim=(0, 1))
    # the spare slot may have received several writes; it is dropped here
    return Routing(slot_token[..., :capacity].contiguous(), slot_weight[..., :capacity],
                   aux, kept, top_k * G * S, counts.sum(dim=0), kept_per_expert)


def finish_aux(aux: torch.Tensor, moe: MoEConfig, moe_layers: int) -> torch.Tensor:
    """The model's aux loss from the sum over its MoE layers of their ``aux_loss``: the
    sum itself (gshard), or HF Mixtral's load_balancing_loss_func from the pooled counts
    and probabilities, per group, averaged over the groups (mixtral)."""
    if aux.dim() != 3:
        return aux
    rows = moe_layers * moe.router_group_tokens
    frac, prob = aux[:, 0] / rows, aux[:, 1] / rows                 # (G, E) each
    return (frac * prob).sum(dim=-1).mean() * moe.experts


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
    `with_experts=False` leaves the experts out (the parallel engine builds its own);
    `expert` builds one expert FFN from the config (GPT's MLP by default)."""

    def __init__(self, cfg, moe: MoEConfig, with_experts: bool = True,
                 expert: Callable[[object], nn.Module] = MLP):
        super().__init__()
        self.moe = moe
        self.capacity = moe.capacity()
        self.router = Router(cfg, moe)
        self.experts = nn.ModuleList(expert(cfg) for _ in range(moe.experts if with_experts
                                                                else 0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        xg = to_groups(x, self.moe.router_group_tokens)           # (G, S, C)
        r = route(self.router(xg), self.moe.top_k, self.capacity, self.moe.gating)
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

    routes = True  # forward returns (x, Routing): run_units' segments collect it

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
    if not any(p.is_meta for p in unit.parameters()):  # a template has nothing to draw
        init_moe_unit(unit, index, cfg, seed)
    return unit


@dataclass
class MoEStats:
    """What the MoE layers of one forward report: the aux loss, the kept and assigned
    token-expert assignments (their ratio is the kept fraction), and per MoE layer (in
    block order) the assignments routed to each expert and those kept (``load``: a list
    of ((E,), (E,)) long tensors)."""

    aux_loss: torch.Tensor
    kept: int = 0
    assigned: int = 0
    load: list = dataclasses.field(default_factory=list)

    def add(self, r: Routing) -> None:
        self.aux_loss = self.aux_loss + r.aux_loss
        self.kept += r.kept
        self.assigned += r.assigned
        self.load.append((r.tokens, r.kept_per_expert))

    @property
    def dropped_fraction(self) -> float:
        return 1.0 - self.kept / self.assigned if self.assigned else 0.0


class MoEGPT(nn.Module):
    """The serial MoE GPT: token ids in, (logits, MoEStats) out. Parameter names are the
    names every layout's checkpoints consolidate to (``units.2.moe.experts.3.c_fc.weight``).
    """

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, seed: int = 0,
                 activation_checkpointing: bool = False, *,
                 unit: Callable[..., nn.Module] | None = None):
        super().__init__()
        self.cfg, self.moe_cfg = cfg, moe
        make = make_moe_unit if unit is None else unit  # unit(cfg, moe, index, seed)
        self.units = nn.ModuleDict({str(i): make(cfg, moe, i, seed)
                                    for i in range(cfg.n_units)})
        self.activation_checkpointing = activation_checkpointing

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        recompute = None
        if self.activation_checkpointing and torch.is_grad_enabled():
            def recompute(segment, x, *blocks):
                return checkpoint(segment, x, *blocks, use_reentrant=False)
        return run_units(list(self.units.values()), idx, serial_segment, recompute,
                         self.moe_cfg)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def run_units(units: list[nn.Module], idx: torch.Tensor, segment: Callable,
              recompute: Callable | None = None,
              moe: MoEConfig | None = None) -> tuple[torch.Tensor, MoEStats]:
    """(logits, MoEStats) of an MoE model's units (embedding, blocks, head) on tokens
    `idx`: the blocks run in segments of ~sqrt(N) (checkpoint_interval), each by
    ``segment(x, *blocks)`` -> (x, summed aux loss, [(tokens, kept) per MoE layer]), or
    under activation checkpointing by ``recompute(segment, x, *blocks)``. `moe` finishes
    a Mixtral aux loss (finish_aux)."""
    x = units[0](idx)
    stats = MoEStats(torch.zeros((), device=x.device))
    blocks = units[1:-1]
    k = checkpoint_interval(len(blocks))
    for i in range(0, len(blocks), k):
        seg = blocks[i:i + k]
        run = segment if recompute is None else functools.partial(recompute, segment)
        x, aux, loads = run(x, *seg)
        stats.aux_loss = stats.aux_loss + aux
        for tokens, kept in loads:
            stats.load.append((tokens, kept))
            stats.kept += int(kept.sum())
            stats.assigned += int(tokens.sum())
    if moe is not None:
        stats.aux_loss = finish_aux(stats.aux_loss, moe, len(stats.load))
    return units[-1](x), stats


def serial_segment(x, *blocks):
    """Blocks in order: (x, summed aux loss, [(tokens, kept) per MoE layer])."""
    aux, loads = torch.zeros((), device=x.device), []
    for b in blocks:
        if getattr(b, "routes", False):
            x, r = b(x)
            aux = aux + r.aux_loss
            loads.append((r.tokens, r.kept_per_expert))
        else:
            x = b(x)
    return x, aux, loads


def moe_loss(logits: torch.Tensor, targets: torch.Tensor, stats: MoEStats,
             moe: MoEConfig, denominator: float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to minimize, the LM loss): next-token cross entropy in fp32 over the
    targets that are not -100 (ignored: Goldfish's dropped tokens, padding), divided by
    `denominator` (default: their count here, i.e. the mean), plus aux_loss_coef x the
    aux loss."""
    flat = targets.reshape(-1)
    ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), flat, reduction="sum")
    if denominator is None:
        denominator = max(1, int((flat != -100).sum()))
    lm = ce / denominator
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
