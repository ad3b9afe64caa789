"""The GPT of training/models/gpt.py on AxoNN's 4D grid, built from the serial model.

``GPT4D(cfg, comms, seed)`` makes each unit of the serial GPT in turn (the same
per-unit generators, so the same initial weights as ``GPT(cfg, seed)``), keeps this
rank's pieces and drops the rest; ``GPT4D.from_state_dict`` does the same from a serial
``state_dict``. Parameter names are the serial ones (``units.1.attn.c_attn.weight``), and
``serial_state_dict`` (collective) / ``assemble_state_dict`` (from every rank's pieces)
give the serial ``state_dict`` back.

Layouts: the residual stream is [b, T, C/G_y] replicated over X; tokens are whole
sequences sharded over (z, data). c_attn N, attn.c_proj T, c_fc N, mlp.c_proj T,
lm_head N; the logits [b, T, V/G_x] are all-gathered over X before the cross-entropy.
The loss each rank backpropagates is its local mean divided by G_z * G_data (and the
number of micro-batches), so that SUM reductions of the gradients over Z and data give
the gradient of the global mean.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..core.sharding import Split
from ..models.gpt import GPTConfig, lm_loss, make_unit
from ..tensor_parallel.comm import TensorComms
from ..tensor_parallel.layers import (
    ParallelEmbedding,
    ParallelLayerNorm,
    ParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    data_of,
    gather_last_dim,
    owns,
    sharded_weights,
)


class Embedding4D(nn.Module):
    def __init__(self, serial, comms: TensorComms, prefix: str):
        super().__init__()
        self.wte = ParallelEmbedding(serial.wte.weight.data, comms, f"{prefix}.wte")
        self.wpe = ParallelEmbedding(serial.wpe.weight.data, comms, f"{prefix}.wpe")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Block4D(nn.Module):
    def __init__(self, serial, cfg: GPTConfig, comms: TensorComms, prefix: str):
        super().__init__()
        self.ln_1 = ParallelLayerNorm(serial.ln_1.weight.data, data_of(serial.ln_1.bias), comms,
                                      name=f"{prefix}.ln_1")
        self.attn = ParallelSelfAttention(serial.attn, cfg.n_head, comms, f"{prefix}.attn")
        self.ln_2 = ParallelLayerNorm(serial.ln_2.weight.data, data_of(serial.ln_2.bias), comms,
                                      name=f"{prefix}.ln_2")
        self.mlp = ParallelMLP(serial.mlp, comms, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head4D(nn.Module):
    def __init__(self, serial, comms: TensorComms, prefix: str):
        super().__init__()
        self.comms = comms
        self.ln_f = ParallelLayerNorm(serial.ln_f.weight.data, data_of(serial.ln_f.bias), comms,
                                      name=f"{prefix}.ln_f")
        self.lm_head = ParallelLinear(serial.lm_head.weight.data, None, comms,
                                      name=f"{prefix}.lm_head")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))            # [b, T, V/G_x], replicated over Y
        return gather_last_dim(logits, self.comms.x, tag="logits")


def check_shapes(cfg: GPTConfig, sizes: dict[str, int]) -> list[str]:
    """What keeps `cfg` from running on degrees `sizes` (empty: it fits)."""
    gx, gy = sizes["x"], sizes["y"]
    out = []
    if cfg.n_head % gx:
        out.append(f"n_head={cfg.n_head} is not divisible by G_x={gx} (heads are split "
                   "over X)")
    if cfg.n_embd % gy:
        out.append(f"n_embd={cfg.n_embd} is not divisible by G_y={gy} (the hidden "
                   "dimension is split over Y)")
    if cfg.vocab_size % gx:
        out.append(f"vocab_size={cfg.vocab_size} is not divisible by G_x={gx} (the LM "
                   "head's rows are split over X)")
    return out


class GPT4D(nn.Module):
    """The whole GPT on this rank's share of the 4D grid (module docstring): token ids
    [b, T] of this rank's (z, data) shard in, full logits [b, T, V] out (replicated over
    X and Y)."""

    def __init__(self, cfg: GPTConfig, comms: TensorComms, seed: int = 0,
                 state_dict: dict[str, torch.Tensor] | None = None):
        super().__init__()
        problems = check_shapes(cfg, comms.sizes())
        if problems:
            raise ValueError("GPT4D: " + "; ".join(problems))
        self.cfg, self.comms = cfg, comms
        units = {}
        for i in range(cfg.n_units):
            serial = make_unit(cfg, i, seed)
            if state_dict is not None:
                prefix = f"units.{i}."
                serial.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items()
                                        if k.startswith(prefix)})
            prefix = f"units.{i}"
            if i == 0:
                units[str(i)] = Embedding4D(serial, comms, prefix)
            elif i == cfg.n_units - 1:
                units[str(i)] = Head4D(serial, comms, prefix)
            else:
                units[str(i)] = Block4D(serial, cfg, comms, prefix)
            del serial
        self.units = nn.ModuleDict(units)
        self.sharded = sharded_weights(self)
        shard_ids = {id(m.weight) for m in self.sharded}
        self.replicated = [p for p in self.parameters() if id(p) not in shard_ids]

    @classmethod
    def from_state_dict(cls, cfg: GPTConfig, comms: TensorComms,
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
        """Mean cross-entropy over this rank's tokens (the same on every X and Y rank)."""
        return lm_loss(self(idx), targets)

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


def assemble_state_dict(cfg: GPTConfig, splits: dict[str, Split], sizes: dict[str, int],
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
