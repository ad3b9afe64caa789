"""A GPT in the nanoGPT spirit, cut into pipeline-friendly units.

The model is a sequence of *units*: unit 0 is the embedding (token + position), units
1..n_layer are transformer blocks, unit n_layer+1 is the head (final LayerNorm + LM
head, no weight tying so that the head may live on another pipeline stage than the
embedding). A pipeline stage holds a contiguous range of units; the whole model is the
stage holding all of them. Parameter names carry the global unit index
(``units.3.attn.c_attn.weight``) so that the shards of every stage merge into the
state_dict of the whole model without renaming.

Every unit is initialized from its own generator seeded by (seed, unit index), so a
stage holding units 3..5 has exactly the weights those units have in the whole model,
without ever building the whole model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

#: GPTConfig.activation -> F.gelu's ``approximate``.
ACTIVATIONS = {"gelu": "none", "gelu_tanh": "tanh"}


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int = 256
    bias: bool = True
    # the MLP's GELU: "gelu" exact (erf), "gelu_tanh" the tanh approximation that GPT-2
    # was trained with (Hugging Face's "gelu_new")
    activation: str = "gelu"

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"GPTConfig: activation {self.activation!r}; expected one of "
                             f"{', '.join(ACTIVATIONS)}")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GPTConfig: '{name}' is {v!r}; expected a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by "
                             f"n_head={self.n_head}; pick a head count that divides it")

    @property
    def n_units(self) -> int:
        return self.n_layer + 2

    def n_params(self) -> int:
        """Parameter count of the whole model (exact, from the shapes below)."""
        c, v, t, L = self.n_embd, self.vocab_size, self.block_size, self.n_layer
        b = 1 if self.bias else 0
        ln = 2 * c
        block = 2 * ln + (3 * c * c + b * 3 * c) + (c * c + b * c) \
            + (4 * c * c + b * 4 * c) + (4 * c * c + b * c)
        return v * c + t * c + L * block + ln + (c * v)

    def as_dict(self) -> dict:
        return asdict(self)


# Sizes from tiny (tests, CPU) to GPT-3 shapes (Brown et al. 2020, table 2.1). The byte-
# level corpus sets vocab_size=256; token memmaps set it from --vocab-size.
CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=32),
    "mini": GPTConfig(n_layer=6, n_head=4, n_embd=128, block_size=64),
    "small": GPTConfig(n_layer=8, n_head=8, n_embd=256, block_size=128),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600, block_size=1024),
    "gpt3-2.7b": GPTConfig(n_layer=32, n_head=32, n_embd=2560, block_size=2048),
    "gpt3-6.7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048),
    "gpt3-13b": GPTConfig(n_layer=40, n_head=40, n_embd=5120, block_size=2048),
    "gpt3-175b": GPTConfig(n_layer=96, n_head=96, n_embd=12288, block_size=2048),
    # The GPT shapes of AxoNN's 4D-parallelism papers (Singh et al.; table in
    # github.com/axonn-ai/Megatron-AxoNN, model-table.md), sequence length 2048, GPT-2's
    # BPE vocabulary padded from 50257 to 50304 (a multiple of 128, as Megatron-LM pads it)
    # so that the LM head's rows split evenly over tensor-parallel ranks.
    "gpt-5b": GPTConfig(n_layer=24, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304),
    "gpt-10b": GPTConfig(n_layer=32, n_head=40, n_embd=5120, block_size=2048, vocab_size=50304),
    "gpt-20b": GPTConfig(n_layer=32, n_head=56, n_embd=7168, block_size=2048, vocab_size=50304),
    "gpt-40b": GPTConfig(n_layer=38, n_head=72, n_embd=9216, block_size=2048, vocab_size=50304),
    "gpt-60b": GPTConfig(n_layer=56, n_head=72, n_embd=9216, block_size=2048, vocab_size=50304),
    "gpt-80b": GPTConfig(n_layer=42, n_head=96, n_embd=12288, block_size=2048, vocab_size=50304),
    "gpt-160b": GPTConfig(n_layer=84, n_head=96, n_embd=12288, block_size=2048, vocab_size=50304),
    "gpt-320b": GPTConfig(n_layer=96, n_head=128, n_embd=16384, block_size=2048, vocab_size=50304),
    "gpt-640b": GPTConfig(n_layer=192, n_head=128, n_embd=16384, block_size=2048, vocab_size=50304),
}


def get_config(name: str, **overrides) -> GPTConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(CONFIGS)}")
    return replace(CONFIGS[name], **{k: v for k, v in overrides.items() if v is not None})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.approximate = ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def _init_unit(unit: nn.Module, index: int, cfg: GPTConfig, seed: int) -> None:
    """nanoGPT's init (N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)),
    drawn from a generator private to this unit."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    with torch.no_grad():
        for name, p in unit.named_parameters():
            if name.endswith("c_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * (0.02 / math.sqrt(2 * cfg.n_layer)))
            elif p.dim() >= 2:  # Linear and Embedding weights
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif ".ln_" in f".{name}" or name.startswith("ln_"):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:  # biases
                p.zero_()


def make_unit(cfg: GPTConfig, index: int, seed: int) -> nn.Module:
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


def checkpoint_interval(n_blocks: int) -> int:
    """AxoNN's rule: checkpoint activations every ~sqrt(N) layers (N blocks on the stage)."""
    return max(1, round(math.sqrt(n_blocks)))


class GPTStage(nn.Module):
    """Units ``first..last`` (inclusive) of a GPT. ``GPTStage(cfg, 0, cfg.n_units - 1)``
    is the whole model: token ids in, logits out.

    ``activation_checkpointing=True`` stores only the inputs of segments of
    ``checkpoint_interval(#blocks)`` consecutive blocks and recomputes the rest in the
    backward pass.
    """

    def __init__(self, cfg: GPTConfig, first: int, last: int, seed: int = 0,
                 activation_checkpointing: bool = False):
        super().__init__()
        if not 0 <= first <= last < cfg.n_units:
            raise ValueError(f"GPTStage: units {first}..{last} are not a range inside "
                             f"0..{cfg.n_units - 1}")
        self.cfg, self.first, self.last = cfg, first, last
        self.units = nn.ModuleDict({str(i): make_unit(cfg, i, seed)
                                    for i in range(first, last + 1)})
        self.activation_checkpointing = activation_checkpointing

    def segments(self) -> list[list[nn.Module]]:
        """Units grouped as they run: blocks in checkpoint segments, others alone."""
        mods = list(self.units.values())
        blocks = [m for m in mods if isinstance(m, Block)]
        k = checkpoint_interval(len(blocks)) if blocks else 1
        out, run = [], []
        for m in mods:
            if isinstance(m, Block):
                run.append(m)
                if len(run) == k:
                    out.append(run)
                    run = []
            else:
                if run:
                    out.append(run)
                    run = []
                out.append([m])
        if run:
            out.append(run)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for seg in self.segments():
            if self.activation_checkpointing and isinstance(seg[0], Block) \
                    and torch.is_grad_enabled():
                x = checkpoint(_run_segment, x, *seg, use_reentrant=False)
            else:
                x = _run_segment(x, *seg)
        return x


def _run_segment(x, *mods):
    for m in mods:
        x = m(x)
    return x


def GPT(cfg: GPTConfig, seed: int = 0, activation_checkpointing: bool = False) -> GPTStage:
    """The whole model (a stage holding every unit)."""
    return GPTStage(cfg, 0, cfg.n_units - 1, seed, activation_checkpointing)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in float32."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
