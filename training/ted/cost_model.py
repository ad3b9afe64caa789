"""The memory and communication model of DeepSpeed-TED (dissertation ch. 7, Eq. 7.2-7.4),
exact for this package's MoE GPT, and a command that lists every feasible layout.

    python -m training.ted.cost_model --model moe-6.7b --experts 32 --ranks 128 --gpu-gib 80
    python -m training.ted.cost_model --model moe-tiny --experts 4 --ranks 8 --dtype fp32 \
        --router-group-tokens 16

**Memory (Eq. 7.2).** A rank holds NP_gpu_nonexp non-expert and NP_gpu_exp expert
parameters; with mixed precision (bf16 parameters and gradients, fp32 master weights and
Adam moments sharded by ZeRO-1 over each set's data group)::

    M_gpu >= (4 + 12 / G_data_nonexp) NP_gpu_nonexp + (4 + 12 / G_data_exp) NP_gpu_exp

and with fp32 training (the parameters are the masters) ``(8 + 8 / G_data)`` per set.
The shards are ceil(NP / G_data) elements (the last one shorter), so the exact bytes of
rank r use its shard length; :func:`memory_per_rank` gives them, and the tests compare
them with the storage of the model's and the optimizer's tensors.

**Parameters (Eq. 7.3-7.4).** Exact counts per rank from the shapes (:func:`rank_params`);
the dissertation's approximations for a base of NP_base parameters with MoE every other
block are NP_exp = (E/3) NP_base and NP_nonexp = (2/3) NP_base, divided by G_tensor
(non-expert) and G_tensor x G_expert (expert) per rank (:func:`paper_params`).

**Communication** per rank and step (:func:`step_comm`): the model's collectives
(Megatron all_reduces, the MoE all_to_alls, DTD's all_gathers, forward and backward, and
the recomputation's when activation checkpointing runs without CAC), then ZeRO-1's
gradient all_reduce and parameter all_gather per set. Bytes follow mcrdl's logger
(all_reduce and all_to_all: the buffer; all_gather: the gathered output).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from ..core.arguments import dtype, positive_float, positive_int
from ..core.dtypes import BYTES, dtype_name
from ..models.gpt import GPTConfig
from ..models.llama import LlamaConfig
from ..models.moe import MoEConfig, base_config
from .model import TEDLayout, buffer_capacity
from .zero import shard_range

#: The precisions train_moe trains in (it has no fp16 loss scaling).
DTYPES = ("fp32", "bf16")


def rank_params(cfg: GPTConfig, moe: MoEConfig, layout: TEDLayout) -> dict[str, int]:
    """Exact parameter elements of one rank: {"nonexpert": ..., "expert": ...} (a GPT,
    or a Llama-shaped Mixtral: no biases, no position table, SwiGLU FFNs)."""
    if isinstance(cfg, LlamaConfig):
        return _llama_rank_params(cfg, moe, layout)
    c, v, t, g = cfg.n_embd, cfg.vocab_size, cfg.block_size, layout.g_tensor
    b = 1 if cfg.bias else 0
    ln = 2 * c if cfg.bias else c
    attn = (3 * c * c + b * 3 * c) // g + c * c // g + b * c
    ffn = (4 * c * c + b * 4 * c) // g + 4 * c * c // g + b * c  # one FFN's tensor slice
    nonexp = v * c + t * c + ln + c * v                           # embeddings, head
    exp = 0
    for block in range(cfg.n_layer):
        nonexp += 2 * ln + attn
        if moe.is_moe(block):
            nonexp += moe.experts * c                             # the router
            exp += moe.experts // layout.g_expert * ffn
        else:
            nonexp += ffn
    return {"nonexpert": nonexp, "expert": exp}


def _llama_rank_params(cfg: LlamaConfig, moe: MoEConfig, layout: TEDLayout) -> dict[str, int]:
    c, v, g, d = cfg.n_embd, cfg.vocab_size, layout.g_tensor, cfg.head_dim
    attn = (2 * cfg.n_head * d * c + 2 * cfg.n_kv_head * d * c) // g
    ffn = 3 * c * cfg.intermediate_size // g                      # gate, up, down slices
    nonexp = v * c + c + (0 if cfg.tie_embeddings else c * v)     # embedding, head
    exp = 0
    for block in range(cfg.n_layer):
        nonexp += 2 * c + attn
        if moe.is_moe(block):
            nonexp += moe.experts * c                             # the router
            exp += moe.experts // layout.g_expert * ffn
        else:
            nonexp += ffn
    return {"nonexpert": nonexp, "expert": exp}


def paper_params(cfg: GPTConfig, moe: MoEConfig, layout: TEDLayout) -> dict[str, float]:
    """Eq. 7.3-7.4's per-rank approximation (MoE every other block; NP_base ~ 12 L C^2)."""
    np_base = 12 * cfg.n_layer * cfg.n_embd ** 2
    return {"nonexpert": 2 / 3 * np_base / layout.g_tensor,
            "expert": moe.experts / 3 * np_base / (layout.g_tensor * layout.g_expert)}


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter element: parameter, gradient, optimizer state (ZeRO-sharded)."""

    param: int
    grad: int
    state: int

    @classmethod
    def of(cls, dtype: str) -> Precision:
        dtype = dtype_name(dtype)
        if dtype == "fp32":
            return cls(4, 4, 8)       # Adam moments; the fp32 parameters are the masters
        if dtype == "bf16":
            return cls(2, 2, 12)      # fp32 master + moments (Eq. 7.2)
        raise ValueError(f"dtype {dtype!r}: expected fp32 or bf16")


def memory_per_rank(cfg: GPTConfig, moe: MoEConfig, layout: TEDLayout, dtype: str = "bf16",
                    data_nonexp_rank: int = 0, data_exp_rank: int = 0) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states on a rank (exact: its shard
    lengths from its data ranks), and their total."""
    n = rank_params(cfg, moe, layout)
    p = Precision.of(dtype)
    lo, hi = shard_range(n["nonexpert"], layout.g_data, data_nonexp_rank)
    elo, ehi = shard_range(n["expert"], layout.g_data_exp, data_exp_rank)
    total_params = n["nonexpert"] + n["expert"]
    out = {"params": p.param * total_params, "grads": p.grad * total_params,
           "optimizer": p.state * ((hi - lo) + (ehi - elo))}
    out["total"] = sum(out.values())
    return out


def eq72_bytes(cfg: GPTConfig, moe: MoEConfig, layout: TEDLayout, dtype: str = "bf16") -> float:
    """Eq. 7.2's right-hand side with this model's exact per-rank counts."""
    n, p = rank_params(cfg, moe, layout), Precision.of(dtype)
    return ((p.param + p.grad + p.state / layout.g_data) * n["nonexpert"]
            + (p.param + p.grad + p.state / layout.g_data_exp) * n["expert"])


def step_comm(cfg: GPTConfig, moe: MoEConfig, layout: TEDLayout, *, micro_batch: int,
              n_micro: int = 1, dtd: bool = False, recompute: bool = False,
              dtype: str = "fp32", optimizer: bool = True) -> dict[str, dict[str, int]]:
    """Calls and bytes per collective kind on one rank for one step: {"all_reduce":
    {"calls": .., "bytes": ..}, "all_to_all_single": .., "all_gather": ..}.
    `recompute`: activation checkpointing without CAC repeats every forward collective
    of the blocks (torch's checkpoint with early_stop=False); with CAC pass False.
    `optimizer`: include ZeRO-1's gradient all_reduce and parameter all_gather (not the
    step's small all_reduce of the loss sums and expert loads, which also carries the
    gradient norm's squares without clipping, nor the norm's own one with clipping)."""
    w = BYTES[dtype_name(dtype)]
    g_t, g_e = layout.g_tensor, layout.g_expert
    tokens = micro_batch * cfg.block_size
    if tokens % moe.router_group_tokens:
        raise ValueError("a microbatch must hold whole router groups")
    n_groups = tokens // moe.router_group_tokens
    if moe.dropless:
        raise ValueError("capacity_factor 0 (dropless): the buffers' size follows each "
                         "step's routing, so the bytes are not fixed in advance; model a "
                         "capacity factor bounding the load instead")
    c_buf = buffer_capacity(moe.capacity(), g_t)
    slots = moe.experts * n_groups * c_buf * cfg.n_embd * w      # a full dispatch buffer
    out = {k: {"calls": 0, "bytes": 0} for k in ("all_reduce", "all_to_all_single",
                                                 "all_gather")}

    def add(kind: str, nbytes: int, calls: int = 1) -> None:
        out[kind]["calls"] += calls
        out[kind]["bytes"] += calls * nbytes

    passes = 3 if recompute else 2  # forward, backward (and the recomputed forward)
    for block in range(cfg.n_layer):
        if g_t > 1:
            add("all_reduce", tokens * cfg.n_embd * w, passes * n_micro)       # attention
            if moe.is_moe(block):
                add("all_reduce", slots, passes * n_micro)        # all local experts
            else:
                add("all_reduce", tokens * cfg.n_embd * w, passes * n_micro)   # dense FFN
        if moe.is_moe(block):
            # DTD runs where an all_to_all carries duplicates (ParallelMoE's rule): over
            # expert ranks (G_expert > 1) of tensor-parallel experts (G_tensor > 1)
            deduped = dtd and g_t > 1 and g_e > 1
            if g_e > 1:
                add("all_to_all_single", slots // g_t if deduped else slots,
                    2 * passes * n_micro)
            if deduped:
                add("all_gather", slots, 2 * passes * n_micro)
    if optimizer:
        n = rank_params(cfg, moe, layout)
        for count, group in ((n["nonexpert"], layout.g_data), (n["expert"], layout.g_data_exp)):
            if group > 1 and count:
                add("all_reduce", count * w)
                add("all_gather", math.ceil(count / group) * group * w)
    return out


def feasible_layouts(cfg: GPTConfig, moe: MoEConfig, ranks: int):
    """Every (G_tensor, G_expert, G_data_nonexp) of `ranks` ranks that the model allows."""
    for g_t in range(1, ranks + 1):
        if ranks % g_t:
            continue
        g_d = ranks // g_t
        for g_e in range(1, g_d + 1):
            layout = TEDLayout(g_t, g_e, g_d)
            try:
                layout.check(cfg, moe, ranks)
            except ValueError:
                continue
            yield layout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.ted.cost_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="moe-6.7b", help="base shape (MOE_BASES or CONFIGS)")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--moe-every", type=int, default=2)
    ap.add_argument("--router-group-tokens", type=int, default=2048)
    ap.add_argument("--ranks", type=positive_int, default=128, help="GPUs (ranks) of the machine")
    ap.add_argument("--gpu-gib", type=positive_float, default=80.0, help="memory per GPU in GiB")
    ap.add_argument("--micro-batch-size", type=positive_int, default=1)
    ap.add_argument("--dtype", type=dtype, default="bf16", choices=DTYPES,
                    help="fp32 or bf16 (or float32, bfloat16)")
    ap.add_argument("--dtd", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--all", action="store_true", help="list infeasible layouts too")
    a = ap.parse_args(argv)
    try:
        return _table(a)
    except ValueError as e:  # the model's constraints (e.g. whole router groups)
        print(f"error: {e}", file=sys.stderr)
        return 2


def _table(a) -> int:
    """Print the layouts of the parsed arguments `a`; ValueError for an impossible model."""
    cfg = base_config(a.model, vocab_size=a.vocab_size)
    moe = MoEConfig(experts=a.experts, top_k=a.top_k, capacity_factor=a.capacity_factor,
                    moe_every=a.moe_every, router_group_tokens=a.router_group_tokens)
    budget = a.gpu_gib * 2**30
    print(f"# {a.model} ({cfg.n_layer} layers, width {cfg.n_embd}) with {moe.experts} experts "
          f"every {moe.moe_every} blocks, top-{moe.top_k}, {a.ranks} ranks of "
          f"{a.gpu_gib:g} GiB, {a.dtype}, micro-batch {a.micro_batch_size}, DTD "
          f"{'on' if a.dtd else 'off'}")
    print("# memory: params + grads + ZeRO-1 optimizer states on data rank 0 (Eq. 7.2, exact "
          "counts); comm: bytes per rank per step")
    print(f"{'G_tensor':>8} {'G_expert':>8} {'G_data':>6} {'G_data_exp':>10} "
          f"{'NP_nonexp':>12} {'NP_exp':>12} {'memory GiB':>10} {'a2a MiB':>9} "
          f"{'allreduce MiB':>13} {'allgather MiB':>13}  fits")
    rows = 0
    for layout in feasible_layouts(cfg, moe, a.ranks):
        n = rank_params(cfg, moe, layout)
        mem = memory_per_rank(cfg, moe, layout, a.dtype)["total"]
        fits = mem <= budget
        if not fits and not a.all:
            continue
        comm = step_comm(cfg, moe, layout, micro_batch=a.micro_batch_size, dtd=a.dtd,
                         dtype=a.dtype)
        mib = {k: v["bytes"] / 2**20 for k, v in comm.items()}
        print(f"{layout.g_tensor:>8} {layout.g_expert:>8} {layout.g_data:>6} "
              f"{layout.g_data_exp:>10} {n['nonexpert']:>12,} {n['expert']:>12,} "
              f"{mem / 2**30:>10.2f} {mib['all_to_all_single']:>9.1f} "
              f"{mib['all_reduce']:>13.1f} {mib['all_gather']:>13.1f}  "
              f"{'yes' if fits else 'no'}")
        rows += 1
    if not rows:
        print("(no layout fits: more ranks, more memory per GPU, or fewer experts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
