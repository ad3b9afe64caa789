"""The GPT of training/models/gpt.py, or the Llama of training/models/llama.py, on
AxoNN's 4D grid, built from the serial model.

``GPT4D(cfg, comms, seed)`` makes each unit of the serial model in turn (the family's
per-unit generators, so the same initial weights as ``GPT(cfg, seed)`` or
``Llama(cfg, seed)``), keeps this rank's pieces and drops the rest;
``GPT4D.from_state_dict`` does the same from a serial ``state_dict``, and
``GPT4D(cfg, comms, source=...)`` from an init source (a .pt file or a Hugging Face
directory), each rank reading only its pieces. Parameter names are the serial ones
(``units.1.attn.c_attn.weight``, ``units.1.self_attn.q_proj.weight``), and
``serial_state_dict`` (collective) / ``assemble_state_dict`` (from every rank's pieces)
give the serial ``state_dict`` back.

Llama: RMSNorm as LayerNorm (weight over Y, its sum of squares all_reduced over Y);
q_proj, k_proj, v_proj N-layers, o_proj T; gate_proj and up_proj N, down_proj T; heads
split over X by tensor_parallel.layers.check_kv_heads' rule: G_x divides n_kv_head
(key/value heads are split with the query heads they serve, never replicated). Tied
embeddings are refused (the embedding and the LM head are split differently).

GPT layouts: the residual stream is [b, T, C/G_y] replicated over X; tokens are whole
sequences sharded over (z, data). c_attn N, attn.c_proj T, c_fc N, mlp.c_proj T,
lm_head N; the logits [b, T, V/G_x] are all-gathered over X before the cross-entropy.
The loss each rank backpropagates is its local mean divided by G_z * G_data (and the
number of micro-batches), so that SUM reductions of the gradients over Z and data give
the gradient of the global mean.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.sharding import Split
from ..models import llama as llama_model
from ..models.families import family_of
from ..models.gpt import ACTIVATIONS, GPTConfig, lm_loss
from ..models.llama import LlamaConfig
from ..tensor_parallel.comm import TensorComms
from ..tensor_parallel.layers import (
    ParallelEmbedding,
    ParallelLayerNorm,
    ParallelLinear,
    ParallelLlamaAttention,
    ParallelMLP,
    ParallelRMSNorm,
    ParallelSelfAttention,
    ParallelSwiGLU,
    SerialPart,
    Weights,
    check_kv_heads,
    gather_last_dim,
    owns,
    sharded_weights,
)


def _scoped(get: Weights, prefix: str) -> Weights:
    return lambda name: get(f"{prefix}.{name}")


class Embedding4D(nn.Module):
    def __init__(self, get: Weights, comms: TensorComms, prefix: str):
        super().__init__()
        self.wte = ParallelEmbedding(get("wte.weight"), comms, f"{prefix}.wte")
        self.wpe = ParallelEmbedding(get("wpe.weight"), comms, f"{prefix}.wpe")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Block4D(nn.Module):
    def __init__(self, get: Weights, cfg: GPTConfig, comms: TensorComms, prefix: str):
        super().__init__()
        self.ln_1 = ParallelLayerNorm(get("ln_1.weight"), get("ln_1.bias"), comms,
                                      name=f"{prefix}.ln_1")
        self.attn = ParallelSelfAttention(_scoped(get, "attn"), cfg.n_head, comms,
                                          f"{prefix}.attn")
        self.ln_2 = ParallelLayerNorm(get("ln_2.weight"), get("ln_2.bias"), comms,
                                      name=f"{prefix}.ln_2")
        self.mlp = ParallelMLP(_scoped(get, "mlp"), comms, f"{prefix}.mlp",
                               approximate=ACTIVATIONS[cfg.activation])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head4D(nn.Module):
    def __init__(self, get: Weights, comms: TensorComms, prefix: str):
        super().__init__()
        self.comms = comms
        self.ln_f = ParallelLayerNorm(get("ln_f.weight"), get("ln_f.bias"), comms,
                                      name=f"{prefix}.ln_f")
        self.lm_head = ParallelLinear(get("lm_head.weight"), None, comms,
                                      name=f"{prefix}.lm_head")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))            # [b, T, V/G_x], replicated over Y
        return gather_last_dim(logits, self.comms.x, tag="logits")


class LlamaEmbedding4D(nn.Module):
    def __init__(self, get: Weights, comms: TensorComms, prefix: str):
        super().__init__()
        self.embed_tokens = ParallelEmbedding(get("embed_tokens.weight"), comms,
                                              f"{prefix}.embed_tokens")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(idx)


class LlamaBlock4D(nn.Module):
    def __init__(self, get: Weights, cfg: LlamaConfig, comms: TensorComms, prefix: str):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = ParallelRMSNorm(get("input_layernorm.weight"), comms, eps,
                                               f"{prefix}.input_layernorm")
        self.self_attn = ParallelLlamaAttention(
            _scoped(get, "self_attn"), cfg.n_head, cfg.n_kv_head, cfg.head_dim,
            llama_model.rope_frequencies(cfg), comms, f"{prefix}.self_attn")
        self.post_attention_layernorm = ParallelRMSNorm(
            get("post_attention_layernorm.weight"), comms, eps,
            f"{prefix}.post_attention_layernorm")
        self.mlp = ParallelSwiGLU(_scoped(get, "mlp"), comms, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaHead4D(nn.Module):
    def __init__(self, get: Weights, cfg: LlamaConfig, comms: TensorComms, prefix: str):
        super().__init__()
        self.comms = comms
        self.norm = ParallelRMSNorm(get("norm.weight"), comms, cfg.rms_norm_eps,
                                    f"{prefix}.norm")
        self.lm_head = ParallelLinear(get("lm_head.weight"), None, comms,
                                      name=f"{prefix}.lm_head")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(x))            # [b, T, V/G_x], replicated over Y
        return gather_last_dim(logits, self.comms.x, tag="logits")


#: targets not in the loss (F.cross_entropy's default ignore_index)
IGNORE_INDEX = -100


def check_shapes(cfg: GPTConfig | LlamaConfig, sizes: dict[str, int]) -> list[str]:
    """What keeps `cfg` (either family) from running on degrees `sizes` (empty: it
    fits)."""
    gx, gy = sizes["x"], sizes["y"]
    out = []
    if isinstance(cfg, LlamaConfig):
        problem = check_kv_heads(cfg.n_head, cfg.n_kv_head, gx)
        if problem:
            out.append(problem)
        if cfg.intermediate_size % gx:
            out.append(f"intermediate_size={cfg.intermediate_size} is not divisible by "
                       f"G_x={gx} (gate_proj and up_proj's rows are split over X)")
        if cfg.tie_embeddings:
            out.append("tie_embeddings: the 4D engine splits the embedding (columns over "
                       "Y) and the LM head (rows over X, columns over Y) differently, so "
                       "they cannot share one matrix; untie them (tie_word_embeddings false)")
    elif cfg.n_head % gx:
        out.append(f"n_head={cfg.n_head} is not divisible by G_x={gx} (heads are split "
                   "over X)")
    if cfg.n_embd % gy:
        out.append(f"n_embd={cfg.n_embd} is not divisible by G_y={gy} (the hidden "
                   "dimension is split over Y)")
    if cfg.vocab_size % gx:
        out.append(f"vocab_size={cfg.vocab_size} is not divisible by G_x={gx} (the LM "
                   "head's rows are split over X)")
    return out


def unit_weights(cfg, index: int, seed: int, state_dict: dict[str, torch.Tensor] | None,
                 source) -> Weights:
    """Unit `index`'s serial weights by name (within the unit): SerialParts of `source`
    (an init source: each layer reads only its piece), else the tensors of the serial
    unit (the family's make_unit, the serial model's initial weights) with
    `state_dict`'s entries loaded over them."""
    prefix = f"units.{index}."
    if source is not None:
        names = set(source.names())

        def part(name: str) -> SerialPart | None:
            full = prefix + name
            if full not in names:
                return None
            return SerialPart(source.shape(full), lambda index: source.part(full, index))
        return part
    serial = family_of(cfg).make_unit(cfg, index, seed)
    if state_dict is not None:
        serial.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items()
                                if k.startswith(prefix)})
    params = {n: p.data for n, p in serial.named_parameters()}
    return params.get


class GPT4D(nn.Module):
    """The whole model (a GPT or a Llama: training/models/families.py) on this rank's
    share of the 4D grid (module docstring): token ids [b, T] of this rank's (z, data)
    shard in, full logits [b, T, V] out (replicated over X and Y). Weights: the serial
    model's initial ones for `seed`, or `state_dict`'s, or an init source's
    (training/models/init_source.py: each rank reads only its pieces)."""

    def __init__(self, cfg: GPTConfig | LlamaConfig, comms: TensorComms, seed: int = 0,
                 state_dict: dict[str, torch.Tensor] | None = None, source=None):
        super().__init__()
        problems = check_shapes(cfg, comms.sizes())
        if problems:
            raise ValueError("GPT4D: " + "; ".join(problems))
        self.cfg, self.comms = cfg, comms
        llama = isinstance(cfg, LlamaConfig)
        units = {}
        for i in range(cfg.n_units):
            get, prefix = unit_weights(cfg, i, seed, state_dict, source), f"units.{i}"
            if i == 0:
                units[str(i)] = (LlamaEmbedding4D if llama else Embedding4D)(get, comms, prefix)
            elif i == cfg.n_units - 1:
                units[str(i)] = (LlamaHead4D(get, cfg, comms, prefix) if llama
                                 else Head4D(get, comms, prefix))
            else:
                units[str(i)] = (LlamaBlock4D if llama else Block4D)(get, cfg, comms, prefix)
            del get
        self.units = nn.ModuleDict(units)
        self.sharded = sharded_weights(self)
        shard_ids = {id(m.weight) for m in self.sharded}
        self.replicated = [p for p in self.parameters() if id(p) not in shard_ids]

    @classmethod
    def from_state_dict(cls, cfg: GPTConfig | LlamaConfig, comms: TensorComms,
                        state_dict: dict[str, torch.Tensor]) -> GPT4D:
        """This rank's pieces of a serial ``state_dict`` (any grid)."""
        return cls(cfg, comms, state_dict=state_dict)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        gathers = self.comms.gathers
        gathers.begin_forward(self)
        completed = False
        try:
            x = idx
            for unit in self.units.values():
                x = unit(x)
            completed = True
        finally:
            gathers.end_forward(completed)
        return x

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over this rank's targets other than -100 (ignored: not in
        the loss), the same on every X and Y rank."""
        return lm_loss(self(idx), targets)

    def loss_sum(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(sum of the cross-entropies of this rank's targets other than -100, float64;
        how many there are)."""
        logits = self(idx).float()
        total = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="sum")
        return total.double(), int((targets != IGNORE_INDEX).sum())

    # -- gradients -------------------------------------------------------------------------
    def reduce_gradients(self, bucket_elements: int | None = None) -> None:
        """After the last backward of a step: wait for the Z reduce_scatters still in
        flight (ORS); all_reduce the replicated parameters' gradients (biases,
        LayerNorm) over Z; then all_reduce every gradient (shards, then replicated) over
        data. SUM: the loss was divided by G_z * G_data. Each reduction is fused: the
        gradients are packed into one flat buffer, reduced in buckets of
        `bucket_elements` (None: one call), and unpacked, so that a step pays one
        latency per axis and bucket, not one per tensor."""
        c = self.comms
        for m in self.sharded:
            m.finish_gradients()
        for p in self.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        replicated = [p.grad for p in self.replicated]
        all_reduce_flat(c.z, replicated, bucket_elements, "replicated grads")
        all_reduce_flat(c.data, [m.weight.grad for m in self.sharded] + replicated,
                        bucket_elements, "grads")

    def owned_grad_sumsq(self) -> torch.Tensor:
        """Sum of squares (float64) of the gradients this rank owns: summed over the
        world it is the squared global norm with each piece counted once."""
        total = torch.zeros((), dtype=torch.float64, device=next(self.parameters()).device)
        for p in self.parameters():
            if p.grad is not None and owns(p, self.comms):
                total += p.grad.double().pow(2).sum()
        return total

    # -- the serial state_dict ----------------------------------------------------------------
    def splits(self) -> dict[str, Split]:
        return {n: p.split for n, p in self.named_parameters()}

    def local_pieces(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.named_parameters()}


def all_reduce_flat(comm, tensors: list[torch.Tensor], bucket_elements: int | None,
                    tag: str) -> None:
    """Sum `tensors` in place over `comm`'s axis: packed into one flat buffer, reduced
    in consecutive buckets of `bucket_elements` (all issued, then waited), unpacked."""
    if comm.size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    step = flat.numel() if not bucket_elements else bucket_elements
    pending = [comm.all_reduce(flat[i:i + step], async_op=True, tag=tag)
               for i in range(0, flat.numel(), step)]
    for p in pending:
        p.wait()
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def assemble_state_dict(cfg: GPTConfig | LlamaConfig, splits: dict[str, Split],
                        sizes: dict[str, int],
                        pieces: list[tuple[dict[str, int], dict[str, torch.Tensor]]]
                        ) -> dict[str, torch.Tensor]:
    """The serial ``state_dict`` (serial names and order) from the pieces of the
    ranks of one data replica: `pieces` is [(coords, {name: piece})]."""
    out = {}
    for name, split in splits.items():
        by_coord = {(c["x"], c["y"], c["z"]): d[name] for c, d in pieces}
        out[name] = split.assemble(by_coord, sizes)
    return out


def serial_state_dict(model: GPT4D, group=None) -> dict[str, torch.Tensor] | None:
    """Collective over `group` (the run's ranks; None: the world): the serial
    ``state_dict`` on its rank 0 (None on the others), from data replica 0's pieces."""
    import mcrdl

    c = model.comms
    mine = (c.coords(), model.local_pieces()) if c.data.rank == 0 else None
    gathered = mcrdl.all_gather_object(mine, group=group)
    if mcrdl.get_rank(group=group) != 0:
        return None
    return assemble_state_dict(model.cfg, model.splits(), c.sizes(),
                               [g for g in gathered if g is not None])
