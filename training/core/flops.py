"""Model flop/s, the AxoNN paper's measure of training speed, and the peak it is a
fraction of (MFU).

**Model FLOPs per step** (Narayanan et al. 2021, "Efficient large-scale language model
training on GPU clusters", Eq. 3 without activation recomputation): for a GPT of L
blocks, width h, sequence s, vocabulary V and B sequences per step::

    72 B s L h^2 (1 + s / (6 h) + V / (12 L h))

that is, per token, 6 times the matmul weights (``12 L h^2`` in the blocks, ``V h`` in
the LM head) plus ``12 L s h`` for the attention scores and their use. Other families
(Llama: SwiGLU's three matrices, grouped-query attention's smaller k/v projections) take
the same form from their own shapes: 6 x the weights every token multiplies by (each
block's Linear layers and the LM head; not the embedding lookup, norms or biases) plus
``12 L s (n_head head_dim)``; for a GPT that is the formula above exactly. Recomputed
activations are not counted (model flop/s, not hardware flop/s).

**Peak**: ``--peak-flops`` when given; on a GPU the vendor's dense bf16 (Tensor Core)
peak of the known devices (``GPU_PEAKS``, datasheet figures); otherwise, and on CPUs, a
measured GEMM rate (the paper's "empirical peak": the best of a few square fp32
matmuls, ``measured_peak``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["GPU_PEAKS", "matmul_weights", "measured_peak", "model_flops_per_token",
           "peak_flops"]

#: Dense bf16 peak flop/s by a substring of torch.cuda.get_device_name (datasheets;
#: the first match wins, so the more specific names come first).
GPU_PEAKS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12), ("GH200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12),
    ("A100", 312e12), ("MI300X", 1307e12), ("MI250X", 383e12), ("MI250", 362e12),
    ("L40S", 362e12), ("A10", 125e12), ("V100", 125e12),
)


def matmul_weights(cfg: Any, moe: Any = None) -> tuple[int, int]:
    """(weights one token multiplies by in the blocks, in the LM head) of a GPT or Llama
    config (``n_layer``, ``n_embd``, ``vocab_size``; Llama also ``n_head``, ``n_kv_head``,
    ``head_dim``, ``intermediate_size``). With `moe` (an MoEConfig) a token of an MoE
    block passes through ``top_k`` experts' MLPs (the router's few weights aside)."""
    c, L = cfg.n_embd, cfg.n_layer
    if hasattr(cfg, "intermediate_size"):  # Llama family
        q = cfg.n_head * cfg.head_dim
        kv = cfg.n_kv_head * cfg.head_dim
        attention, mlp = c * q + 2 * c * kv + q * c, 3 * c * cfg.intermediate_size
    else:  # GPT: c_attn 3h^2, c_proj h^2, MLP 8h^2
        attention, mlp = 4 * c * c, 8 * c * c
    moe_blocks = 0 if moe is None else sum(1 for j in range(L) if (j + 1) % moe.moe_every == 0)
    mlps = L + moe_blocks * (moe.top_k - 1 if moe is not None else 0)
    return L * attention + mlps * mlp, cfg.vocab_size * c


def model_flops_per_token(cfg: Any, moe: Any = None) -> float:
    """Model FLOPs of one trained token (forward and backward; module docstring)."""
    blocks, head = matmul_weights(cfg, moe)
    width = cfg.n_head * getattr(cfg, "head_dim", cfg.n_embd // cfg.n_head)
    return 6 * (blocks + head) + 12 * cfg.n_layer * cfg.block_size * width


_measured: dict[str, float] = {}


def measured_peak(device: torch.device | str = "cpu", size: int = 1024,
                  seconds: float = 0.3, cached: bool = True) -> float:
    """Flop/s of the best of repeated ``size`` x ``size`` fp32 matmuls on `device` for
    about `seconds` (bf16 on a GPU), cached per device for the process (``cached``
    False: measured anew, and not kept)."""
    device = torch.device(device)
    key = str(device)
    if cached and key in _measured:
        return _measured[key]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up
    sync()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end or best == float("inf"):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    rate = 2 * size ** 3 / best
    if cached:
        _measured[key] = rate
    return rate


def peak_flops(device: torch.device | str, given: float | None = None) -> tuple[float, str]:
    """(peak flop/s per rank, where it comes from): `given` (``--peak-flops``), a known
    GPU's bf16 datasheet peak, else a measured GEMM rate."""
    if given is not None:
        return given, "--peak-flops"
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for part, peak in GPU_PEAKS:
            if part in name:
                return peak, f"{name} bf16 datasheet peak"
    return measured_peak(device), f"measured {device.type} GEMM rate"
