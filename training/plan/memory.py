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
``C``, ``b`` 1 with biases)::

    M_s = (w + w) P_s + optimizer(P_s) + A_s

**4D** (G_x, G_y, G_z, G_data). A rank holds each weight's [rows/G_x, cols/G_y] block
sharded over Z (``perf_model.step.weight_blocks`` / G_z), the LayerNorms and biases
split over X or Y (``grid_params``, exact), and, with the weights kept
from forward to backward, every Linear layer's Z-gathered block (``k n / (G_x G_y)``
elements per layer, when G_z > 1)::

    M = (w + w) P_rank + optimizer(P_rank) + w * gathered + A

**Activations** A (Korthikanti et al. 2022, "Reducing activation recomputation", Eq. 1,
no recomputation, 16-bit; scaled by w / 2): one block keeps ``s b h (34 + 5 a s / h)``
bytes for a micro-batch of ``b`` sequences of ``s`` tokens, width ``h``, ``a`` heads;
the head keeps the logits ``s b V`` in the training dtype and in fp32 for the loss.
Pipeline stage s keeps the micro-batches in flight on it (at most the engine's limit,
2 G_inter at stage 0, and the step's M) for its own blocks. 4D splits each saved tensor
over X or Y (divided by min(G_x, G_y): an upper bound) and the attention scores over the
heads (G_x); tokens over Z are already in ``b`` (the rank's sequences). TED: Megatron's
tensor-parallel form ``s b h (10 + 24 / t + 5 a s / (h t))``; the expert FFNs'
activations counted as a dense FFN's (capacity factor ~1).
"""

from __future__ import annotations

import math

from ..models.gpt import GPTConfig
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


def unit_params(cfg: GPTConfig, index: int) -> int:
    """Parameter elements of unit ``index`` (0 embedding, 1..n_layer blocks, then head),
    as ``training.models.gpt.make_unit`` builds it."""
    c, v, t = cfg.n_embd, cfg.vocab_size, cfg.block_size
    b = 1 if cfg.bias else 0
    ln = 2 * c if cfg.bias else c
    if index == 0:
        return v * c + t * c
    if index == cfg.n_units - 1:
        return ln + c * v
    return 2 * ln + 12 * c * c + b * (3 * c + c + 4 * c + c)


def stage_params(cfg: GPTConfig, g_inter: int) -> list[int]:
    """Parameter elements of each pipeline stage (the engine's default even split)."""
    return [sum(unit_params(cfg, u) for u in range(first, last + 1))
            for first, last in partition(cfg.n_layer, g_inter)]


def block_activations(cfg: GPTConfig, sequences: int, w: int) -> float:
    """Bytes one transformer block keeps for the backward (Korthikanti et al., no
    recomputation), for ``sequences`` sequences."""
    s, h, a = cfg.block_size, cfg.n_embd, cfg.n_head
    return s * sequences * h * (34 + 5 * a * s / h) * w / 2


def head_activations(cfg: GPTConfig, sequences: int, w: int, vocab_split: int = 1) -> float:
    return cfg.block_size * sequences * cfg.vocab_size / vocab_split * (w + 4)


def _states(params: int, w: int) -> dict[str, int]:
    return {"params": w * params, "grads": w * params, "optimizer": DEVICE_STATES[w] * params}


def _total(out: dict) -> dict:
    out["total"] = sum(v for k, v in out.items() if k != "host")
    return out


def pipeline_memory(cfg: GPTConfig, g_inter: int, micro_batch: int, n_micro: int,
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


def grid_params(cfg: GPTConfig, grid: Grid4D) -> int:
    """Parameter elements of one 4D rank, exactly as the engine splits them: weights'
    [rows/G_x, cols/G_y] blocks (embeddings: columns over Y) sharded over Z; LayerNorms
    and the biases of the T-layers (attn.c_proj, mlp.c_proj) over Y; the biases of the
    N-layers (c_attn, c_fc) over X."""
    c, x, y = cfg.n_embd, grid.x, grid.y
    b = 1 if cfg.bias else 0
    ln = 2 * c if cfg.bias else c
    blocks = weight_blocks(cfg, grid)
    per_block = sum(blocks[f"{layer.name}.weight"] for layer in linear_layers(cfg)
                    if layer.per_block)
    weights = sum(blocks.values()) + (cfg.n_layer - 1) * per_block
    small = cfg.n_layer * (2 * ln // y + b * (3 * c // x + c // y + 4 * c // x + c // y))
    return weights // grid.z + small + ln // y


def grid_memory(cfg: GPTConfig, grid: Grid4D, micro_batch: int, w: int,
                keep_weights: bool = True) -> dict[str, float]:
    """Bytes on one 4D rank (see the module docstring)."""
    params = grid_params(cfg, grid)
    gathered = 0
    if keep_weights and grid.z > 1:
        gathered = sum(layer.k * layer.n // (grid.x * grid.y)
                       * (cfg.n_layer if layer.per_block else 1)
                       for layer in linear_layers(cfg))
    s, h, a = cfg.block_size, cfg.n_embd, cfg.n_head
    act = cfg.n_layer * s * micro_batch * h * (34 / min(grid.x, grid.y)
                                               + 5 * a * s / (h * grid.x)) * w / 2
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
    s, h, a, t = cfg.block_size, cfg.n_embd, cfg.n_head, layout.g_tensor
    out["activations"] = (cfg.n_layer * s * micro_batch * h * (10 + 24 / t + 5 * a * s / (h * t))
                          * w / 2 + head_activations(cfg, micro_batch, w))
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
