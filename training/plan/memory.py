"""Bytes per GPU of each engine's layouts: parameters, gradients, optimizer states and
activations, as functions of the layout.

Element width ``w`` (4 for fp32, 2 for bf16). Optimizer states: the pipeline and 4D
engines step fp32 training with ``DataParallelAdamW`` (two fp32 Adam moments on the
device, 8 bytes per parameter) and bf16 training with ``OffloadedAdamW`` (fp32 master
and moments in host memory, 12 bytes per parameter, none on the device); TED shards its
states with ZeRO-1 on the device (Eq. 7.2, ``training.ted.cost_model.memory_per_rank``).

**Pipeline** (G_inter stages x G_data replicas; the blocks split by the engine's
``partition``). Stage s holds the parameters P_s of its units (embedding ``V C + T C``;
block ``2 LN + 12 C^2 + 13 C b``; head ``LN + C V``, with ``LN = 2C`` with biases, else
``C``, ``b`` 1 with biases; a Llama: embedding ``V C``, block ``2 C + 2 C Q + 2 C K +
3 C I`` (Q, K: the query and key/value widths, I: intermediate_size), head ``C + C V``,
``C`` when tied)::

    M_s = (w + w) P_s + optimizer(P_s) + A_s

**4D** (G_x, G_y, G_z, G_data). A rank holds each weight's [rows/G_x, cols/G_y] block
sharded over Z (``perf_model.step.weight_blocks`` / G_z), the LayerNorms and biases
split over X or Y (``grid_params``, exact), and, with the weights kept
from forward to backward, every Linear layer's Z-gathered block (``k n / (G_x G_y)``
elements per layer, when G_z > 1)::

    M = (w + w) P_rank + optimizer(P_rank) + w * gathered + A

**Activations** A: what autograd saves, counted as Korthikanti et al. 2022 ("Reducing
activation recomputation", Eq. 1, no recomputation) count it, for the models as they
are: fused attention (no s x s scores), no dropout (``block_activations``: per token,
GPT ``(16 h + 4) w + 4 a`` bytes, Llama per its SwiGLU and grouped-query widths; exact,
measured by tests/test_plan.py); the head keeps the logits ``s b V`` in the training
dtype and in fp32 for the loss. Pipeline stage s keeps the micro-batches in flight on
it (at most the engine's limit, 2 G_inter at stage 0, and the step's M) for its own
blocks. 4D splits each saved tensor over X or Y (divided by min(G_x, G_y): an upper
bound); tokens over Z are already in ``b`` (the rank's sequences). TED: Megatron's
tensor-parallel proportion, ``(10 + 24 / t) / 34`` of a block's bytes; the expert
FFNs' activations counted as a dense FFN's (capacity factor ~1).
"""

from __future__ import annotations

import math

from ..models.gpt import GPTConfig
from ..models.llama import LlamaConfig
from ..models.moe import MoEConfig
from ..parallel4d.perf_model import Grid4D, linear_layers
from ..parallel4d.perf_model.step import weight_blocks
from ..pipeline.engine import partition
from ..ted.cost_model import memory_per_rank
from ..ted.model import TEDLayout

#: Bytes per parameter of the optimizer states on the device (pipeline, 4D engines).
DEVICE_STATES = {4: 8, 2: 0}
#: ... and in host memory (bf16: OffloadedAdamW's fp32 master and moments).
HOST_STATES = {4: 0, 2: 12}


def unit_params(cfg: GPTConfig | LlamaConfig, index: int) -> int:
    """Parameter elements of unit ``index`` (0 embedding, 1..n_layer blocks, then head),
    as the family's ``make_unit`` builds it (a GPT: training/models/gpt.py; a Llama:
    training/models/llama.py, no biases, RMSNorm weights, no position table, the head
    without its matrix when it is tied to the embedding)."""
    c, v = cfg.n_embd, cfg.vocab_size
    if isinstance(cfg, LlamaConfig):
        q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        if index == 0:
            return v * c
        if index == cfg.n_layer + 1:
            return c + (0 if cfg.tie_embeddings else c * v)
        return 2 * c + c * q + 2 * c * kv + q * c + 3 * c * cfg.intermediate_size
    t = cfg.block_size
    b = 1 if cfg.bias else 0
    ln = 2 * c if cfg.bias else c
    if index == 0:
        return v * c + t * c
    if index == cfg.n_units - 1:
        return ln + c * v
    return 2 * ln + 12 * c * c + b * (3 * c + c + 4 * c + c)


def stage_params(cfg: GPTConfig | LlamaConfig, g_inter: int) -> list[int]:
    """Parameter elements of each pipeline stage (the engine's default even split)."""
    return [sum(unit_params(cfg, u) for u in range(first, last + 1))
            for first, last in partition(cfg.n_layer, g_inter)]


def block_activations(cfg: GPTConfig | LlamaConfig, sequences: int, w: int) -> float:
    """Bytes one transformer block saves for its backward (no recomputation), for
    ``sequences`` sequences of ``s`` tokens in elements of ``w`` bytes: exactly the
    tensors autograd keeps (tests/test_plan.py measures them with saved-tensor hooks).
    Attention is torch's fused scaled_dot_product_attention, which keeps its output and
    an fp32 log-sum-exp per head and token, never the s x s scores (Korthikanti et al.'s
    ``5 a s / h`` term), and the models have no dropout (their 2 mask bytes), so:

    - GPT: ``(16 h + 4) w + 4 a`` bytes per token: Korthikanti's 34 h bytes less the masks
      (two LayerNorms' inputs, c_attn's input, q, k, v, the attention output, c_fc's
      input, its output, GELU's output; each LayerNorm's mean and rstd).
    - Llama: per RMSNorm its fp32 input, its rsqrt and two w-wide copies (``4 h + 4 + 2 w
      h``); q, and k, v repeated to the query heads, and the attention output (``4 q w``,
      q = n_head head_dim); gate, silu(gate), up and their product (``4 I w``); and per
      position the rotary cos and sin (``2 head_dim w``)."""
    s, h, a = cfg.block_size, cfg.n_embd, cfg.n_head
    tokens = s * sequences
    if isinstance(cfg, LlamaConfig):
        q = cfg.n_head * cfg.head_dim
        per_token = 2 * (4 * h + 4 + 2 * w * h) + 4 * q * w + 4 * a \
            + 4 * cfg.intermediate_size * w
        return tokens * per_token + 2 * s * cfg.head_dim * w
    return tokens * ((16 * h + 4) * w + 4 * a)


def head_activations(cfg: GPTConfig | LlamaConfig, sequences: int, w: int,
                     vocab_split: int = 1) -> float:
    return cfg.block_size * sequences * cfg.vocab_size / vocab_split * (w + 4)


def _states(params: int, w: int) -> dict[str, int]:
    return {"params": w * params, "grads": w * params, "optimizer": DEVICE_STATES[w] * params}


def _total(out: dict) -> dict:
    out["total"] = sum(v for k, v in out.items() if k != "host")
    return out


def pipeline_memory(cfg: GPTConfig | LlamaConfig, g_inter: int, micro_batch: int, n_micro: int,
                    w: int) -> dict[str, float]:
    """Bytes on the fullest stage of G_inter (see the module docstring); ``host``: the
    offloaded optimizer states, not device memory."""
    best: dict[str, float] = {}
    in_flight = min(n_micro, 2 * g_inter)
    for s, ((first, last), params) in enumerate(zip(partition(cfg.n_layer, g_inter),
                                                    stage_params(cfg, g_inter), strict=True)):
        blocks = sum(1 for u in range(first, last + 1) if 0 < u < cfg.n_units - 1)
        flight = max(1, in_flight - s)
        act = flight * blocks * block_activations(cfg, micro_batch, w)
        if last == cfg.n_units - 1:
            act += flight * head_activations(cfg, micro_batch, w)
        out = _total({**_states(params, w), "activations": act})
        out["host"] = HOST_STATES[w] * params
        if out["total"] > best.get("total", -1):
            best = out
    return best


def grid_params(cfg: GPTConfig | LlamaConfig, grid: Grid4D) -> int:
    """Parameter elements of one 4D rank, exactly as the engine splits them: weights'
    [rows/G_x, cols/G_y] blocks (embeddings: columns over Y) sharded over Z; LayerNorms
    (a Llama's RMSNorms) and the biases of the T-layers (attn.c_proj, mlp.c_proj) over Y;
    the biases of the N-layers (c_attn, c_fc) over X. A Llama has no biases."""
    c, x, y = cfg.n_embd, grid.x, grid.y
    bias = getattr(cfg, "bias", False)
    b = 1 if bias else 0
    ln = 2 * c if bias else c
    blocks = weight_blocks(cfg, grid)
    per_block = sum(blocks[f"{layer.name}.weight"] for layer in linear_layers(cfg)
                    if layer.per_block)
    weights = sum(blocks.values()) + (cfg.n_layer - 1) * per_block
    small = cfg.n_layer * (2 * ln // y + b * (3 * c // x + c // y + 4 * c // x + c // y))
    return weights // grid.z + small + ln // y


def grid_memory(cfg: GPTConfig | LlamaConfig, grid: Grid4D, micro_batch: int, w: int,
                keep_weights: bool = True) -> dict[str, float]:
    """Bytes on one 4D rank (see the module docstring)."""
    params = grid_params(cfg, grid)
    gathered = 0
    if keep_weights and grid.z > 1:
        gathered = sum(layer.k * layer.n // (grid.x * grid.y)
                       * (cfg.n_layer if layer.per_block else 1)
                       for layer in linear_layers(cfg))
    act = cfg.n_layer * block_activations(cfg, micro_batch, w) / min(grid.x, grid.y)
    act += head_activations(cfg, micro_batch, w, grid.x)
    out = _total({**_states(params, w), "gathered weights": w * gathered, "activations": act})
    out["host"] = HOST_STATES[w] * params
    return out


def ted_memory(cfg: GPTConfig, moe: MoEConfig, layout: TEDLayout, micro_batch: int,
               dtype: str) -> dict[str, float]:
    """Bytes on a TED rank: Eq. 7.2 exactly (``memory_per_rank``) plus activations."""
    w = 2 if dtype == "bf16" else 4
    out = dict(memory_per_rank(cfg, moe, layout, dtype))
    del out["total"]
    t = layout.g_tensor
    out["activations"] = (cfg.n_layer * block_activations(cfg, micro_batch, w)
                          * (10 + 24 / t) / 34 + head_activations(cfg, micro_batch, w))
    out["host"] = 0
    return _total(out)


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f}"


def parse_bytes(text: str) -> float:
    """``64GiB``, ``40GB``, ``512MiB``, ``1.5TiB`` or a number of bytes."""
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10, "tb": 1e12, "gb": 1e9,
             "mb": 1e6, "kb": 1e3, "b": 1}
    t = text.strip().lower()
    for unit, factor in units.items():
        if t.endswith(unit):
            t, scale = t[:-len(unit)], factor
            break
    else:
        scale = 1
    try:
        value = float(t) * scale
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ValueError(f"memory {text!r}: expected a positive size such as 64GiB, 40GB, "
                         "512MiB or a number of bytes")
    return value
