"""Mixtral: the Llama decoder (training/models/llama.py) whose FFNs are sparse mixtures of
SwiGLU experts (Jiang et al. 2024, "Mixtral of Experts").

Attention, RMSNorm, rotary embeddings and grouped-query attention are Llama's modules,
unchanged. Block j (0-based) has an MoE FFN when the MoEConfig says so (``moe_every=1``:
every block, as Mixtral); the others keep Llama's SwiGLU MLP. The MoE FFN is
training/models/moe.py's SerialMoE with Llama's MLP as the expert and, for Mixtral's own
numerics, ``gating="mixtral"``: the top_k experts by router probability with the softmax
over the selected logits as their gates, and HF's load-balancing loss pooled over the MoE
layers. Hugging Face's MixtralForCausalLM routes without a capacity, so it is this model
with ``capacity_factor=0`` (dropless) and one router group holding the whole batch
(the aux loss is per group; routing and logits do not depend on the group size when
dropless).

Units and initialization as the GPT and Llama: unit 0 the embedding, 1..n_layer the
blocks, n_layer+1 the head; each unit draws from a generator private to (seed, unit),
the experts from one private to (seed, unit, expert) (moe.expert_generator), so that a
parallel engine holding some experts draws exactly the serial model's weights.
Parameter names: ``units.3.self_attn.q_proj.weight``, ``units.3.moe.router.weight``,
``units.3.moe.experts.5.gate_proj.weight``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn as nn

from . import llama
from .llama import RMSNorm
from .moe import MoEConfig, MoEGPT, SerialMoE, expert_generator

__all__ = ["CONFIGS", "Mixtral", "MixtralBlock", "MixtralConfig", "get_config",
           "init_expert", "make_unit"]


class MixtralConfig(llama.LlamaConfig):
    """A Llama shape whose blocks carry experts (the experts' count, routing and capacity
    are the run's MoEConfig); ``intermediate_size`` is each expert's SwiGLU width.
    ``from_dict`` (LlamaConfig's) reads a manifest's fields back as a MixtralConfig."""


# Shapes: moe-tiny/moe-mini (tests and CPU runs; the names train_moe's --model defaults
# to) and Mixtral 8x7B's decoder (Jiang et al. 2024, table 1; 8 experts, top-2).
CONFIGS: dict[str, MixtralConfig] = {
    "moe-tiny": MixtralConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16,
                              vocab_size=256, intermediate_size=64, rope_theta=1e6),
    "moe-mini": MixtralConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=64, block_size=32,
                              vocab_size=256, intermediate_size=128, rope_theta=1e6),
    "mixtral-8x7b": MixtralConfig(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                                  block_size=32768, vocab_size=32000,
                                  intermediate_size=14336, rope_theta=1e6),
}


def get_config(name: str, **overrides) -> MixtralConfig:
    """Shape `name` with `overrides` (None: keep); ValueError naming the shapes."""
    if name not in CONFIGS:
        raise ValueError(f"unknown mixtral model {name!r}; expected one of "
                         f"{', '.join(CONFIGS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if {"n_embd", "n_head"} & given.keys():
        given.setdefault("head_dim", None)  # derived again from the new width
    return replace(CONFIGS[name], **given)


class MixtralBlock(nn.Module):
    """Llama's block with the MoE FFN: forward returns (x, Routing)."""

    routes = True

    def __init__(self, cfg: MixtralConfig, moe: MoEConfig, with_experts: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.self_attn = llama.Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.moe = SerialMoE(cfg, moe, with_experts, expert=llama.MLP)

    def forward(self, x: torch.Tensor):
        x = x + self.self_attn(self.input_layernorm(x))
        y, r = self.moe(self.post_attention_layernorm(x))
        return x + y, r


def init_expert(mlp: nn.Module, cfg: MixtralConfig, seed: int, unit: int,
                expert: int) -> None:
    """Llama's init for expert `expert` of unit `unit` (gate and up N(0, 0.02), down
    scaled by 1/sqrt(2 n_layer)), from the expert's private generator."""
    g = expert_generator(seed, unit, expert)
    std_down = 0.02 / math.sqrt(2 * cfg.n_layer)
    with torch.no_grad():
        for w, std in ((mlp.gate_proj.weight, 0.02), (mlp.up_proj.weight, 0.02),
                       (mlp.down_proj.weight, std_down)):
            w.copy_(torch.randn(w.shape, generator=g) * std)


def make_unit(cfg: MixtralConfig, moe: MoEConfig, index: int, seed: int,
              with_experts: bool = True) -> nn.Module:
    """Serial unit `index` (0 embedding, 1..n_layer blocks, n_layer + 1 head); an MoE
    block without its experts when not `with_experts` (the other draws are the same)."""
    if not 0 <= index < cfg.n_units:
        raise ValueError(f"unit index {index} out of range 0..{cfg.n_units - 1}")
    if index == 0:
        unit = llama.Embedding(cfg)
    elif index == cfg.n_units - 1:
        unit = llama.Head(cfg)
    elif moe.is_moe(index - 1):
        unit = MixtralBlock(cfg, moe, with_experts)
    else:
        unit = llama.Block(cfg)
    if any(p.is_meta for p in unit.parameters()):
        return unit  # a template (no storage): nothing to draw
    experts = getattr(getattr(unit, "moe", None), "experts", None)
    if experts is None:
        llama._init_unit(unit, index, cfg, seed)
        return unit
    unit.moe.experts = nn.ModuleList()             # hide the experts from the unit's draws
    try:
        llama._init_unit(unit, index, cfg, seed)
    finally:
        unit.moe.experts = experts
    for e, mlp in enumerate(experts):
        init_expert(mlp, cfg, seed, index, e)
    return unit


class Mixtral(MoEGPT):
    """The serial Mixtral: token ids in, (logits, MoEStats) out; MoEGPT's forward over
    Mixtral's units."""

    def __init__(self, cfg: MixtralConfig, moe: MoEConfig, seed: int = 0,
                 activation_checkpointing: bool = False):
        if cfg.tie_embeddings:
            raise ValueError("Mixtral: tie_embeddings is not supported (Mixtral's LM head "
                             "is its own matrix)")
        super().__init__(cfg, moe, seed, activation_checkpointing, unit=make_unit)
