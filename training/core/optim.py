"""Optimizers of the training package, with the data-parallel gradient all-reduce.

Two implementations of AdamW (decoupled weight decay; decay on matrices and embeddings,
none on biases and LayerNorm, as nanoGPT):

- ``DataParallelAdamW``: gradients flattened, all-reduced (AVG over the data-parallel
  group, backend "auto"), optionally clipped by the global norm (over the pipeline group
  too), then ``torch.optim.AdamW`` steps the parameters in place. The reference.
- ``OffloadedAdamW``: AxoNN's memory layout. The model keeps its parameters and
  gradients in the training dtype (bf16/fp16 on GPUs, fp32 or bf16 on CPU) in one flat
  buffer; fp32 master weights and both Adam moments live in host memory. The gradient
  is all-reduced in chunks of ``coarsening`` buckets, all posted at once on the "auto"
  backend's lane; the optimizer processes each bucket (copy the gradient to the host in
  fp32, AdamW on the master, copy the new weights back in the training dtype) as soon
  as its chunk has arrived, so the optimizer of chunk c overlaps the all-reduce of the
  chunks after it. Global-norm clipping and fp16 overflow checks need the whole
  gradient first; with either on, the chunks are checked as they arrive and the
  updates run after the last one.

Both give the same result to rounding (the parity tests compare them with a serial run).
``BucketedAdamW`` holds the bucketed, overlapped step that OffloadedAdamW shares with
SAMO's optimizer (``training/samo/optimizer.py``, the same step on compressed states).

An engine that reduces the gradients itself (the 4D engine: Z reduce-scatters, data
all-reduces, each shard counted once in the norm) passes no data group and gives
``step(sumsq=...)`` the squared global gradient norm; the optimizers then only clip and
update.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

import mcrdl

from .timers import NullTimers, PhaseTimers


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    decay_steps: int = 1000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0           # 0 disables
    bucket_mib: float = 4.0          # OffloadedAdamW bucket size
    coarsening: int = 2              # buckets per all-reduce chunk (k)

    def lr_at(self, step: int) -> float:
        """Linear warmup to lr, then cosine decay to min_lr at decay_steps (step is 0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if step >= self.decay_steps:
            return self.min_lr
        ratio = (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (self.lr - self.min_lr)


def decays(p: torch.Tensor) -> bool:
    """Whether AdamW decays `p`: matrices and embeddings do, vectors do not. A piece of
    a parameter split over ranks (training.parallel4d: a flattened Z shard, a bias slice)
    carries ``logical_shape``, the shape of the whole parameter, which decides."""
    return len(getattr(p, "logical_shape", p.shape)) >= 2


def param_groups(params, weight_decay: float) -> list[dict]:
    params = list(params)
    return [{"params": [p for p in params if decays(p)], "weight_decay": weight_decay},
            {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]


class LossScaler:
    """Dynamic loss scaling for fp16 (disabled: scale 1, never skips)."""

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 1000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale /= 2.0
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.good_steps, self.skipped = sd["scale"], sd["good_steps"], sd["skipped"]


def applied_lr(optimizer) -> float:
    """The learning rate of `optimizer`'s last applied update: its schedule follows the
    updates it applied (an fp16 step that overflowed applies none), not the steps taken.
    What a step's metrics report."""
    return optimizer.cfg.lr_at(max(optimizer.step_count - 1, 0))


class _GradientComm:
    """What every optimizer here shares: the data-parallel all-reduce and the global norm."""

    def __init__(self, cfg: OptimConfig, data_group, pipe_group, world_reduce: bool,
                 timers: PhaseTimers | None, world_group=None):
        self.cfg = cfg
        self.data_group, self.pipe_group = data_group, pipe_group
        # several ranks: overflow flags agree over the run's ranks, `world_group` (None:
        # the whole world; a group when runs share a launch, training/core/topology.py)
        self.world_reduce, self.world_group = world_reduce, world_group
        self.timers = timers or NullTimers()
        self.step_count = 0

    def _all_reduce(self, t: torch.Tensor, op, group, async_op=False):
        return mcrdl.all_reduce("auto", t, op=op, group=group, async_op=async_op)

    def global_sumsq(self, local: torch.Tensor) -> float:
        """Sum of squares over the pipeline group (the data group holds equal copies)."""
        if self.pipe_group is not None:
            with self.timers("collective"):
                self._all_reduce(local, mcrdl.ReduceOp.SUM, self.pipe_group)
        return float(local)

    def any_world(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        if self.world_reduce:
            with self.timers("collective"):
                self._all_reduce(t, mcrdl.ReduceOp.MAX, self.world_group)
        return bool(t.item())

    def clip_coef(self, sumsq: float) -> float:
        """torch.nn.utils.clip_grad_norm_'s factor (1 when clipping is off)."""
        if self.cfg.grad_clip <= 0:
            return 1.0
        norm = math.sqrt(sumsq)
        return min(1.0, self.cfg.grad_clip / (norm + 1e-6))


class DataParallelAdamW(_GradientComm):
    """All-reduce + clip + torch.optim.AdamW (parameters and states in the model dtype)."""

    def __init__(self, params, cfg: OptimConfig, data_group=None, pipe_group=None,
                 world_reduce: bool = False, timers: PhaseTimers | None = None,
                 world_group=None):
        super().__init__(cfg, data_group, pipe_group, world_reduce, timers, world_group)
        self.params = [p for p in params if p.requires_grad]
        self.opt = torch.optim.AdamW(param_groups(self.params, cfg.weight_decay), lr=cfg.lr,
                                     betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
        self.scaler = LossScaler(False)
        self.last_grad_norm = float("nan")

    def step(self, sumsq: float | None = None) -> bool:
        """One AdamW step. `sumsq`: the squared global gradient norm, when the caller
        has reduced the gradients and computed it (module docstring)."""
        lr = self.cfg.lr_at(self.step_count)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.data_group is not None:
            with self.timers("collective"):
                flat = torch._utils._flatten_dense_tensors(grads)
                self._all_reduce(flat, mcrdl.ReduceOp.AVG, self.data_group)
                for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads),
                                strict=True):
                    g.copy_(r)
        if sumsq is None:
            with self.timers("optimizer"):
                local = torch.zeros(1, dtype=torch.float64,
                                    device=grads[0].device if grads else None)
                for g in grads:
                    local += g.double().pow(2).sum()
            sumsq = self.global_sumsq(local) if self.cfg.grad_clip > 0 else 0.0
        self.last_grad_norm = math.sqrt(sumsq)
        with self.timers("optimizer"):
            coef = self.clip_coef(sumsq)
            for p, g in zip(self.params, grads, strict=True):
                if coef < 1.0:
                    g.mul_(coef)
                p.grad = g
            for group in self.opt.param_groups:
                group["lr"] = lr
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.step_count += 1
        return True

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {"kind": "adamw", "step_count": self.step_count, "torch": self.opt.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        _check_kind(sd, "adamw")
        self.step_count = sd["step_count"]
        self.opt.load_state_dict(sd["torch"])


def _check_kind(sd: dict, kind: str) -> None:
    if sd.get("kind") != kind:
        raise ValueError(f"optimizer state is of kind {sd.get('kind')!r}, this run uses {kind!r}"
                         "; resume with the same --offload-optimizer setting")


Bucket = tuple[int, int, list[tuple[int, int, float]]]


def make_buckets(spans: list[tuple[int, int, float]], limit: int) -> list[Bucket]:
    """Buckets of consecutive whole tensors, each closed once it holds `limit` elements or
    more: (start, end, runs) with runs = [(start, end, weight decay)], adjacent spans of
    equal decay merged. `spans` are the tensors' (start, end, weight decay) in a flat
    buffer, in order; empty spans are left out."""
    buckets, start, runs = [], None, []
    for a, end, wd in spans:
        if a == end:
            continue
        if start is None:
            start = a
        if runs and runs[-1][2] == wd and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], end, wd)
        else:
            runs.append((a, end, wd))
        if end - start >= limit:
            buckets.append((start, end, runs))
            start, runs = None, []
    if runs:
        buckets.append((start, runs[-1][1], runs))
    return buckets


class BucketedAdamW(_GradientComm):
    """AdamW over a flat gradient cut into buckets of whole tensors, all-reduced in chunks
    of ``coarsening`` buckets posted at once, each chunk's buckets updated as soon as it
    has arrived (the module doc's OffloadedAdamW). Subclasses hold ``flat_grad`` (the
    gradient in the training dtype, laid out like the buckets) and ``buckets``, and define
    ``_gather_grads`` (fill ``flat_grad`` from the backward pass) and ``_update`` (AdamW
    on one bucket with the all-reduced gradient times a factor)."""

    flat_grad: torch.Tensor
    buckets: list[Bucket]
    scaler: LossScaler
    last_grad_norm: float

    def chunks(self) -> list[list[int]]:
        k = max(1, self.cfg.coarsening)
        idx = list(range(len(self.buckets)))
        return [idx[i:i + k] for i in range(0, len(idx), k)]

    def _gather_grads(self) -> None:
        raise NotImplementedError

    def _update(self, bucket: Bucket, lr: float, grad_coef: float) -> None:
        raise NotImplementedError

    def _grad_sumsq(self, start: int, end: int) -> torch.Tensor:
        """Sum of squares of flat_grad[start:end], in float64."""
        return self.flat_grad[start:end].double().pow_(2).sum()

    def step(self, sumsq: float | None = None) -> bool:
        """One AdamW step; False when skipped (fp16 overflow). `sumsq`: the squared
        global norm of the (scaled) gradients, when the caller computed it (module
        docstring)."""
        with self.timers("optimizer"):
            self._gather_grads()
        chunks = self.chunks()
        spans = [(self.buckets[c[0]][0], self.buckets[c[-1]][1]) for c in chunks]
        works = []
        if self.data_group is not None:
            with self.timers("collective"):
                works = [self._all_reduce(self.flat_grad[a:b], mcrdl.ReduceOp.AVG,
                                          self.data_group, async_op=True) for a, b in spans]
        needs_whole = self.cfg.grad_clip > 0 or self.scaler.enabled or sumsq is not None
        lr = self.cfg.lr_at(self.step_count)
        if not needs_whole:
            for i, chunk in enumerate(chunks):
                if works:
                    with self.timers("collective"):
                        works[i].wait()
                with self.timers("optimizer"):
                    for b in chunk:
                        self._update(self.buckets[b], lr, 1.0 / self.scaler.scale)
            self.step_count += 1
            self.scaler.update(False)
            return True
        local = torch.zeros(1, dtype=torch.float64, device=self.flat_grad.device)
        for i, (a, b) in enumerate(spans):
            if works:
                with self.timers("collective"):
                    works[i].wait()
            if sumsq is None:
                with self.timers("optimizer"):
                    local += self._grad_sumsq(a, b)
        inv = 1.0 / self.scaler.scale
        sumsq = (self.global_sumsq(local) if sumsq is None else sumsq) * inv * inv
        found_inf = not math.isfinite(sumsq)
        if self.scaler.enabled:
            found_inf = self.any_world(found_inf)
        self.scaler.update(found_inf)
        if found_inf:
            return False
        self.last_grad_norm = math.sqrt(sumsq)
        coef = self.clip_coef(sumsq) * inv
        with self.timers("optimizer"):
            for bucket in self.buckets:
                self._update(bucket, lr, coef)
        self.step_count += 1
        return True


class OffloadedAdamW(BucketedAdamW):
    """fp32 master weights and moments in host memory, bucketed, overlapped (module doc)."""

    def __init__(self, params, cfg: OptimConfig, data_group=None, pipe_group=None,
                 world_reduce: bool = False, timers: PhaseTimers | None = None,
                 loss_scaling: bool = False, world_group=None):
        super().__init__(cfg, data_group, pipe_group, world_reduce, timers, world_group)
        given = [(i, p) for i, p in enumerate(params) if p.requires_grad]
        # decaying parameters first, so that a bucket holds at most two runs of equal decay
        given.sort(key=lambda item: not decays(item[1]))
        self.params = [p for _, p in given]
        #: each of `params`' position in the parameters given (state_dict's "order": what
        #: checkpoint.consolidate --masters maps the master weights back by)
        self.order = [i for i, _ in given]
        if not self.params:
            raise ValueError("OffloadedAdamW: no trainable parameters")
        dev, dtype = self.params[0].device, self.params[0].dtype
        if any(p.device != dev or p.dtype != dtype for p in self.params):
            raise ValueError("OffloadedAdamW: all parameters must share one device and dtype")
        n = sum(p.numel() for p in self.params)
        self.flat = torch.empty(n, dtype=dtype, device=dev)
        self.flat_grad = torch.zeros(n, dtype=dtype, device=dev)
        pin = dev.type == "cuda"
        self.master = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        self.exp_avg = torch.zeros(n, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32)
        self.offsets = []
        off = 0
        for p in self.params:
            k = p.numel()
            self.flat[off:off + k].copy_(p.detach().reshape(-1))
            self.master[off:off + k].copy_(p.detach().reshape(-1).float())
            p.data = self.flat[off:off + k].view_as(p)  # the model now lives in the flat buffer
            self.offsets.append(off)
            off += k
        spans = [(off, off + p.numel(), cfg.weight_decay if decays(p) else 0.0)
                 for p, off in zip(self.params, self.offsets, strict=True)]
        self.buckets = make_buckets(spans, max(1, int(cfg.bucket_mib * 2**20) // 4))
        self.scaler = LossScaler(loss_scaling)
        self.last_grad_norm = float("nan")

    def seed_masters(self, weights: Sequence[torch.Tensor]) -> None:
        """Master weights from `weights`, the fp32 values of the parameters given (in
        their order), which the model holds rounded to its dtype: a bf16/fp16 run
        started from fp32 weights (--init-from) keeps them whole."""
        for p, off, i in zip(self.params, self.offsets, self.order, strict=True):
            self.master[off:off + p.numel()].copy_(weights[i].reshape(-1))

    def _gather_grads(self) -> None:
        for p, off in zip(self.params, self.offsets, strict=True):
            dst = self.flat_grad[off:off + p.numel()]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(p.grad.reshape(-1))
                p.grad = None

    def _update(self, bucket, lr: float, grad_coef: float) -> None:
        """torch.optim.AdamW's single-tensor update, run by run, on the host in fp32."""
        c = self.cfg
        step = self.step_count + 1
        bias1 = 1 - c.beta1 ** step
        bias2_sqrt = math.sqrt(1 - c.beta2 ** step)
        step_size = lr / bias1
        start, end, runs = bucket
        g = self.flat_grad[start:end].to("cpu", torch.float32, copy=True)
        if grad_coef != 1.0:
            g.mul_(grad_coef)
        for a, b, wd in runs:
            gi = g[a - start:b - start]
            p, m, v = self.master[a:b], self.exp_avg[a:b], self.exp_avg_sq[a:b]
            p.mul_(1 - lr * wd)
            m.lerp_(gi, 1 - c.beta1)
            v.mul_(c.beta2).addcmul_(gi, gi, value=1 - c.beta2)
            denom = (v.sqrt() / bias2_sqrt).add_(c.eps)
            p.addcdiv_(m, denom, value=-step_size)
        self.flat[start:end].copy_(self.master[start:end], non_blocking=True)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        """Master weights and moments per parameter (by position in `params`; "order":
        their positions among the parameters given)."""
        out = {"kind": "offloaded-adamw", "step_count": self.step_count,
               "scaler": self.scaler.state_dict(), "order": list(self.order), "master": [],
               "exp_avg": [], "exp_avg_sq": []}
        for p, off in zip(self.params, self.offsets, strict=True):
            s = slice(off, off + p.numel())
            out["master"].append(self.master[s].clone())
            out["exp_avg"].append(self.exp_avg[s].clone())
            out["exp_avg_sq"].append(self.exp_avg_sq[s].clone())
        return out

    def load_state_dict(self, sd: dict) -> None:
        _check_kind(sd, "offloaded-adamw")
        if len(sd["master"]) != len(self.params):
            raise ValueError(f"optimizer state has {len(sd['master'])} parameters, this stage "
                             f"has {len(self.params)}")
        self.step_count = sd["step_count"]
        self.scaler.load_state_dict(sd["scaler"])
        for i, (p, off) in enumerate(zip(self.params, self.offsets, strict=True)):
            s = slice(off, off + p.numel())
            self.master[s].copy_(sd["master"][i])
            self.exp_avg[s].copy_(sd["exp_avg"][i])
            self.exp_avg_sq[s].copy_(sd["exp_avg_sq"][i])
        self.flat.copy_(self.master)


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind `tensors` (None: none), each storage counted once (the
    gradients of stacked experts' biases are views of one storage)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
