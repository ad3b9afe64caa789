"""ZeRO stage 1 AdamW over parameter sets with their own data groups, and the tiled
optimizer of DeepSpeed-TED.

A :class:`ParamSet` is a list of parameters that share a data-parallel group: in TED the
non-expert parameters over the non-expert data group (G_data_nonexp ranks) and the expert
parameters over the expert-data group (G_data_exp ranks). For each set, on every step:

1. **Reduce the gradients** over the set's group (all_reduce of the flattened set):
   non-expert gradients AVG over G_data_nonexp; expert gradients SUM over G_data_exp,
   then x 1/G_data_nonexp. (Each expert already received, through the backward
   all_to_all, the gradient of every rank of its expert group; summing over the
   expert-data group adds the rest, and the loss is the mean over all G_data_nonexp
   batch shards. An AVG over the expert group would inflate expert gradients by
   G_expert.)
2. **Global gradient norm**: each rank adds the squares of *its shard* of each set (the
   shards partition the set over its data group), each element weighted 1/copies where
   a parameter is replicated over the tensor group (G_tensor identical copies), then one
   all_reduce (SUM, float64) over the world: every distinct gradient element counts
   exactly once. Clipping as torch.nn.utils.clip_grad_norm_.
3. **Update the shard** (ZeRO 1: Adam states, and fp32 masters when the parameters are
   bf16, exist only for this rank's 1/G_data of the set, element granularity: the set's
   flat index range split into ceil(n / G_data)-element shards, the last one shorter).
   torch.optim.AdamW's single-tensor arithmetic, element for element.
4. **All-gather** the updated shards over the set's group into every rank's parameters.

**Tiled optimizer.** With ``tile=T`` a set's update (the fp32 copy of the gradient,
scaled, and the Adam temporaries) runs T elements at a time through one reused fp32
buffer of T elements, so the temporary memory of the update is 4 x T bytes instead of 4
bytes x the shard (which for experts grows with experts x base size). Tiles cut at
element granularity, through parameters, so no parameter escapes the bound.
``peak_temp_bytes[set]`` accounts the buffer; ``state_bytes()`` counts the storage of the
optimizer states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import mcrdl

from ..core.optim import LossScaler, OptimConfig, decays
from ..core.sharding import split_of
from ..core.timers import NullTimers, PhaseTimers
from .autograd_collectives import Comm


@dataclass
class ParamSet:
    """Parameters sharing a data group (module docstring). `grad_op` is "avg" or "sum";
    `grad_scale` multiplies the reduced gradient; `tensor_copies` is G_tensor (the
    copies of a parameter not split over the tensor group); `tile`: elements per update
    tile (None: the whole shard at once)."""

    name: str
    params: list[torch.nn.Parameter]
    comm: Comm
    grad_op: str = "avg"
    grad_scale: float = 1.0
    tensor_copies: int = 1
    tile: int | None = None
    # filled by ZeroAdamW
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    shard: tuple[int, int] = (0, 0)


def tensor_split(p: torch.nn.Parameter) -> bool:
    """Whether `p` is cut over the tensor group (X of its training/parallel4d ``split``);
    a parameter without a split is whole on every tensor rank."""
    split = split_of(p)
    return split is not None and "x" in split.split_axes


def shard_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Elements [lo, hi) of shard `index` when n elements are cut in ceil(n/parts) pieces."""
    size = -(-n // parts)
    return min(n, index * size), min(n, (index + 1) * size)


class ZeroAdamW:
    """ZeRO-1 AdamW over `sets` (module docstring); `world` reduces the gradient norm."""

    def __init__(self, sets: list[ParamSet], cfg: OptimConfig, world: Comm,
                 timers: PhaseTimers | None = None):
        self.sets, self.cfg, self.world = sets, cfg, world
        self.timers = timers or NullTimers()
        self.step_count = 0
        self.scaler = LossScaler(False)
        self.last_grad_norm = float("nan")
        self.local_sumsq = 0.0  # this rank's part of the last step's squared norm
        self.peak_temp_bytes: dict[str, int] = {s.name: 0 for s in sets}  # per set
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for s in sets:
            if s.grad_op not in ("avg", "sum"):
                raise ValueError(f"ParamSet {s.name}: grad_op {s.grad_op!r}; expected avg or sum")
            if s.tile is not None and s.tile < 1:
                raise ValueError(f"--optimizer-tile {s.tile}: expected a positive element count")
            off = 0
            s.offsets = []
            for p in s.params:
                if not p.is_contiguous():
                    raise ValueError(f"ParamSet {s.name}: parameters must be contiguous")
                s.offsets.append(off)
                off += p.numel()
            s.numel = off
            s.shard = shard_range(off, s.comm.size, s.comm.rank)
            lo, hi = s.shard
            dev = s.params[0].device if s.params else None  # states live beside the weights
            st = {"exp_avg": torch.zeros(hi - lo, dtype=torch.float32, device=dev),
                  "exp_avg_sq": torch.zeros(hi - lo, dtype=torch.float32, device=dev)}
            if any(p.dtype != torch.float32 for p in s.params):  # bf16 model: fp32 masters
                st["master"] = torch.empty(hi - lo, dtype=torch.float32, device=dev)
                self._fill_master(s, st["master"], lambda p: p.detach())
            self.state[s.name] = st

    def seed_masters(self, weights: dict[torch.nn.Parameter, torch.Tensor]) -> None:
        """fp32 masters from `weights` (parameter -> its fp32 value), which the model
        holds rounded to its dtype: a bf16 run started from fp32 weights (--init-from)
        keeps them whole. Sets without masters (fp32 parameters) are left alone."""
        for s in self.sets:
            master = self.state[s.name].get("master")
            if master is not None:
                self._fill_master(s, master, weights.__getitem__)

    # --- bookkeeping --------------------------------------------------------------------
    @classmethod
    def _fill_master(cls, s: ParamSet, master: torch.Tensor, value_of) -> None:
        """The set's master shard from ``value_of(param)``, each parameter's values."""
        lo, hi = s.shard
        for p, a, b, off in cls._pieces(s, lo, hi):
            master[a - lo:b - lo].copy_(value_of(p).reshape(-1)[a - off:b - off])

    @staticmethod
    def _pieces(s: ParamSet, lo: int, hi: int):
        """(param, a, b, param offset) for each parameter overlapping [lo, hi) of the set's
        flat index space, clipped to it."""
        for p, off in zip(s.params, s.offsets, strict=True):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                yield p, a, b, off

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer-state storage per set (Adam moments, fp32 masters)."""
        return {name: sum(t.untyped_storage().nbytes() for t in st.values())
                for name, st in self.state.items()}

    # --- the step -----------------------------------------------------------------------
    def _flat_grad(self, s: ParamSet) -> torch.Tensor:
        """The set's gradients in one flat tensor, each parameter's freed as it is copied
        in (a concatenation would hold every gradient twice at its peak)."""
        with self.timers("optimizer"):
            if not s.params:
                flat = torch.zeros(0)
            else:
                first = s.params[0]
                flat = torch.empty(sum(p.numel() for p in s.params), dtype=first.dtype,
                                   device=first.device)
                for p, off in zip(s.params, s.offsets, strict=True):
                    piece = flat[off:off + p.numel()]
                    if p.grad is None:
                        piece.zero_()
                    else:
                        piece.copy_(p.grad.reshape(-1))
                        p.grad = None
        if s.comm.active:
            with self.timers("collective"):
                s.comm.all_reduce(flat, mcrdl.ReduceOp.AVG if s.grad_op == "avg"
                                  else mcrdl.ReduceOp.SUM)
        if s.grad_scale != 1.0:
            flat.mul_(s.grad_scale)
        return flat

    def _sumsq(self, s: ParamSet, flat: torch.Tensor) -> torch.Tensor:
        """Squares of this rank's shard, each parameter weighted 1/its tensor copies."""
        total = torch.zeros((), dtype=torch.float64, device=flat.device)
        lo, hi = s.shard
        if s.tensor_copies == 1:  # every element weighs 1: the shard at once
            shard = flat[lo:hi].double()
            return total + torch.dot(shard, shard)
        for p, a, b, _ in self._pieces(s, lo, hi):
            sq = flat[a:b].double().pow(2).sum()
            if s.tensor_copies > 1 and not tensor_split(p):
                sq = sq / s.tensor_copies
            total += sq
        return total

    def step(self, defer_norm: bool = False) -> bool:
        """One update. `defer_norm` (only without clipping, which needs the norm before
        the update): leave the world's sum of the squares to the caller, who reduces
        this rank's ``local_sumsq`` with its own values and calls ``set_norm``: one
        collective fewer per step."""
        lr = self.cfg.lr_at(self.step_count)
        flats = {}
        for s in self.sets:
            flats[s.name] = self._flat_grad(s)  # times its all_reduce as "collective"
            for p in s.params:
                p.grad = None
        with self.timers("optimizer"):
            local = torch.zeros(1, dtype=torch.float64,
                                device=next(iter(flats.values())).device if flats else None)
            for s in self.sets:
                local += self._sumsq(s, flats[s.name])
        if defer_norm and self.cfg.grad_clip > 0:
            raise ValueError("ZeroAdamW.step(defer_norm=True) with grad_clip "
                             f"{self.cfg.grad_clip}: clipping needs the norm before the "
                             "update; defer it only with --grad-clip 0")
        self.local_sumsq = float(local)
        if not defer_norm:
            if self.world.active:
                with self.timers("collective"):
                    self.world.all_reduce(local)
            self.set_norm(float(local))
        coef = 1.0
        if self.cfg.grad_clip > 0:
            coef = min(1.0, self.cfg.grad_clip / (self.last_grad_norm + 1e-6))
        with self.timers("optimizer"):
            for s in self.sets:
                self._update(s, flats[s.name], coef, lr)
        for s in self.sets:
            self._gather(s)
        self.step_count += 1
        return True

    def set_norm(self, sumsq: float) -> None:
        """The global gradient norm from the world's sum of squares."""
        self.last_grad_norm = math.sqrt(sumsq)

    def _update(self, s: ParamSet, flat: torch.Tensor, coef: float, lr: float) -> None:
        """AdamW on this rank's shard of `s`, tile by tile through one buffer."""
        c = self.cfg
        lo, hi = s.shard
        if hi <= lo:
            return
        tile = min(s.tile or (hi - lo), hi - lo)
        buf = torch.empty(tile, dtype=torch.float32, device=flat.device)
        self.peak_temp_bytes[s.name] = max(self.peak_temp_bytes[s.name],
                                           buf.untyped_storage().nbytes())
        step = self.step_count + 1
        bias1, bias2_sqrt = 1 - c.beta1 ** step, math.sqrt(1 - c.beta2 ** step)
        step_size = lr / bias1
        st = self.state[s.name]
        m_all, v_all, master = st["exp_avg"], st["exp_avg_sq"], st.get("master")
        with torch.no_grad():
            for t0 in range(lo, hi, tile):
                t1 = min(t0 + tile, hi)
                g_tile = buf[:t1 - t0]
                g_tile.copy_(flat[t0:t1])                   # the fp32 up-cast, in the tile
                if coef != 1.0:
                    g_tile.mul_(coef)
                for p, a, b, off in self._pieces(s, t0, t1):
                    g = g_tile[a - t0:b - t0]
                    w = (master[a - lo:b - lo] if master is not None
                         else p.data.view(-1)[a - off:b - off])
                    m, v = m_all[a - lo:b - lo], v_all[a - lo:b - lo]
                    wd = c.weight_decay if decays(p) else 0.0
                    w.mul_(1 - lr * wd)
                    m.lerp_(g, 1 - c.beta1)
                    v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
                    denom = torch.sqrt(v, out=g)             # the gradient is spent: reuse
                    denom.div_(bias2_sqrt).add_(c.eps)
                    w.addcdiv_(m, denom, value=-step_size)
                    if master is not None:
                        p.data.view(-1)[a - off:b - off].copy_(w)

    def _gather(self, s: ParamSet) -> None:
        """Every rank's updated shard into every rank's parameters (all_gather)."""
        if not s.comm.active or not s.params:
            return
        lo, hi = s.shard
        size = -(-s.numel // s.comm.size)
        dtype = s.params[0].dtype
        mine = torch.zeros(size, dtype=dtype, device=s.params[0].device)
        for p, a, b, off in self._pieces(s, lo, hi):
            mine[a - lo:b - lo].copy_(p.data.view(-1)[a - off:b - off])
        with self.timers("collective"):
            everyone = s.comm.all_gather(mine)
        with torch.no_grad():
            for p, off in zip(s.params, s.offsets, strict=True):
                p.data.view(-1).copy_(everyone[off:off + p.numel()])

    def zero_grad(self) -> None:
        for s in self.sets:
            for p in s.params:
                p.grad = None

    # --- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"kind": "zero1-adamw", "step_count": self.step_count,
                "shards": {s.name: s.shard for s in self.sets},
                "state": {n: {k: v.clone() for k, v in st.items()}
                          for n, st in self.state.items()}}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "zero1-adamw":
            raise ValueError(f"optimizer state is of kind {sd.get('kind')!r}, expected "
                             "'zero1-adamw'")
        for s in self.sets:
            if tuple(sd["shards"][s.name]) != tuple(s.shard):
                raise ValueError(f"optimizer shard of {s.name} is {sd['shards'][s.name]}, this "
                                 f"rank's is {s.shard}: resume with the same layout")
        self.step_count = sd["step_count"]
        for n, st in self.state.items():
            for k, v in st.items():
                v.copy_(sd["state"][n][k])
