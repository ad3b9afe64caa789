"""A Llama-family decoder in the nanoGPT spirit, cut into the same units as the GPT.

Llama (Touvron et al. 2023; Llama 3, Grattafiori et al. 2024) differs from GPT-2 in four
places: RMSNorm instead of LayerNorm, rotary position embeddings instead of a position
table, a SwiGLU MLP, and grouped-query attention (``n_kv_head`` key/value heads, each
shared by ``n_head / n_kv_head`` query heads). No Linear has a bias.

Units as in training/models/gpt.py: unit 0 is the token embedding, units 1..n_layer the
blocks, unit n_layer+1 the head (final RMSNorm + LM head); parameter names carry the
global unit index and every unit draws its initial weights from a generator private to
(seed, unit index). With ``tie_embeddings`` the head reuses the embedding matrix, so a
stage holding one of units 0 and n_layer+1 must hold both.

Numerics follow Hugging Face's LlamaForCausalLM so that its checkpoints give the same
logits (training/models/hf.py converts the names):

- RMSNorm normalizes in float32 and casts back before the weight multiplies;
- rotary embedding pairs feature i with feature i + head_dim/2 of each head (HF's
  ``rotate_half`` layout, the layout of every HF Llama checkpoint), angles computed in
  float32 from ``rope_theta`` and, optionally, Llama 3.1's frequency scaling;
- key/value head j serves query heads j*g .. j*g+g-1 (g = n_head / n_kv_head).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .gpt import _run_segment, checkpoint_interval, lm_loss

__all__ = ["CONFIGS", "Llama", "LlamaConfig", "LlamaStage", "Llama3RopeScaling",
           "get_config", "lm_loss", "make_unit", "rope_frequencies"]


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's rotary frequency scaling (HF ``rope_type: "llama3"``): wavelengths
    longer than ``original_max_position / low_freq_factor`` are stretched by ``factor``,
    shorter than ``original_max_position / high_freq_factor`` kept, and those between
    interpolated smoothly."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    n_kv_head: int | None = None        # None: n_head (no grouping)
    intermediate_size: int | None = None  # SwiGLU width; None: 8/3 n_embd rounded up to 256
    head_dim: int | None = None          # None: n_embd / n_head
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0         # Llama 3's base; Llama 2 and TinyLlama use 10000
    rope_scaling: Llama3RopeScaling | None = None
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"LlamaConfig: '{name}' is {v!r}; expected a positive integer")
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"LlamaConfig: n_embd={self.n_embd} is not divisible by "
                                 f"n_head={self.n_head}; pick a head count that divides it "
                                 f"or give head_dim")
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size",
                               256 * math.ceil(8 * self.n_embd / 3 / 256))
        for name in ("n_kv_head", "head_dim", "intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"LlamaConfig: '{name}' is {v!r}; expected a positive integer")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig: n_head={self.n_head} is not a multiple of "
                             f"n_kv_head={self.n_kv_head}; each key/value head must serve "
                             f"the same number of query heads")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} is odd; rotary "
                             f"embeddings rotate pairs of features, so it must be even")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig: rms_norm_eps={self.rms_norm_eps} and "
                             f"rope_theta={self.rope_theta} must be positive")

    @property
    def n_units(self) -> int:
        return self.n_layer + 2

    def n_params(self) -> int:
        """Parameter count of the whole model (exact; a tied LM head counts once)."""
        c, v, d, f = self.n_embd, self.vocab_size, self.head_dim, self.intermediate_size
        attn = c * self.n_head * d * 2 + c * self.n_kv_head * d * 2
        block = 2 * c + attn + 3 * c * f
        return v * c + self.n_layer * block + c + (0 if self.tie_embeddings else c * v)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        """The config whose :meth:`as_dict` is ``d`` (a checkpoint manifest's)."""
        scaling = d.get("rope_scaling")
        return cls(**{**d, "rope_scaling": None if scaling is None
                      else Llama3RopeScaling(**scaling)})


# Sizes from tiny (tests, CPU) to the published Llama-family shapes: TinyLlama 1.1B
# (Zhang et al. 2024) and Llama 3.1 (Grattafiori et al. 2024, table 3; 128K context by
# the llama3 rotary scaling of an 8K original).
_LLAMA31 = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position=8192)
CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, block_size=32,
                        vocab_size=256, intermediate_size=96),
    "mini": LlamaConfig(n_layer=6, n_head=8, n_kv_head=2, n_embd=128, block_size=64,
                        vocab_size=256, intermediate_size=352),
    "tinyllama-1.1b": LlamaConfig(n_layer=22, n_head=32, n_kv_head=4, n_embd=2048,
                                  block_size=2048, vocab_size=32000, intermediate_size=5632,
                                  rope_theta=10000.0),
    "llama3-8b": LlamaConfig(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                             block_size=131072, vocab_size=128256, intermediate_size=14336,
                             rope_scaling=_LLAMA31),
    "llama3-70b": LlamaConfig(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192,
                              block_size=131072, vocab_size=128256, intermediate_size=28672,
                              rope_scaling=_LLAMA31),
    "llama3-405b": LlamaConfig(n_layer=126, n_head=128, n_kv_head=8, n_embd=16384,
                               block_size=131072, vocab_size=128256, intermediate_size=53248,
                               rope_scaling=_LLAMA31),
}


def get_config(name: str, **overrides) -> LlamaConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown Llama model {name!r}; expected one of {', '.join(CONFIGS)}")
    return replace(CONFIGS[name], **{k: v for k, v in overrides.items() if v is not None})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies (float32, head_dim/2 of them) of the rotary embedding."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) \
        / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)

    def rotary(self, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the angles (T, head_dim), computed in float32, cast to dtype."""
        pos = torch.arange(T, device=self.inv_freq.device, dtype=torch.float)
        angles = pos[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(T, x.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        group = self.n_head // self.n_kv_head
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(idx)


class Head(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


_RESIDUAL_PROJECTIONS = ("o_proj.weight", "down_proj.weight")


def _init_unit(unit: nn.Module, index: int, cfg: LlamaConfig, seed: int) -> None:
    """N(0, 0.02) for matrices, residual projections scaled by 1/sqrt(2 n_layer) (as
    the GPT), norms at one; drawn from a generator private to this unit."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    with torch.no_grad():
        for name, p in unit.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) \
                    if name.endswith(_RESIDUAL_PROJECTIONS) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)


def make_unit(cfg: LlamaConfig, index: int, seed: int) -> nn.Module:
    if not 0 <= index < cfg.n_units:
        raise ValueError(f"unit index {index} out of range 0..{cfg.n_units - 1}")
    if index == 0:
        unit = Embedding(cfg)
    elif index == cfg.n_units - 1:
        unit = Head(cfg)
    else:
        unit = Block(cfg)
    _init_unit(unit, index, cfg, seed)
    return unit


class LlamaStage(nn.Module):
    """Units ``first..last`` (inclusive) of a Llama; ``LlamaStage(cfg, 0, cfg.n_units - 1)``
    is the whole model: token ids in, logits out. Activation checkpointing as GPTStage:
    segments of ``checkpoint_interval(#blocks)`` consecutive blocks."""

    def __init__(self, cfg: LlamaConfig, first: int, last: int, seed: int = 0,
                 activation_checkpointing: bool = False):
        super().__init__()
        head = cfg.n_units - 1
        if not 0 <= first <= last < cfg.n_units:
            raise ValueError(f"LlamaStage: units {first}..{last} are not a range inside "
                             f"0..{head}")
        if cfg.tie_embeddings and (first == 0) != (last == head):
            raise ValueError(f"LlamaStage: units {first}..{last} hold one of the embedding "
                             f"(unit 0) and the head (unit {head}) but not both; with "
                             f"tie_embeddings they share one matrix, so keep them on one "
                             f"stage or untie them")
        self.cfg, self.first, self.last = cfg, first, last
        self.units = nn.ModuleDict({str(i): make_unit(cfg, i, seed)
                                    for i in range(first, last + 1)})
        if cfg.tie_embeddings and first == 0:
            self.units[str(head)].lm_head.weight = self.units["0"].embed_tokens.weight
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mods = list(self.units.values())
        blocks = [m for m in mods if isinstance(m, Block)]
        k = checkpoint_interval(len(blocks)) if blocks else 1
        segment: list[nn.Module] = []
        for m in mods:
            if isinstance(m, Block):
                segment.append(m)
                if len(segment) < k and m is not blocks[-1]:
                    continue
                x = self._run_blocks(x, segment)
                segment = []
            else:
                x = m(x)
        return x

    def _run_blocks(self, x: torch.Tensor, blocks: list[nn.Module]) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(_run_segment, x, *blocks, use_reentrant=False)
        return _run_segment(x, *blocks)


def Llama(cfg: LlamaConfig, seed: int = 0, activation_checkpointing: bool = False) -> LlamaStage:
    """The whole model (a stage holding every unit)."""
    return LlamaStage(cfg, 0, cfg.n_units - 1, seed, activation_checkpointing)
