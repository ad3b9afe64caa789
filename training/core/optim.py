"""Optimizers of the training package, with the data-parallel gradient all-reduce.

Two implementations of AdamW (decoupled weight decay; decay on matrices and embeddings,
none on biases and LayerNorm, as nanoGPT):

- ``DataParallelAdamW``: gradients kept as views of flat buckets (reverse parameter
  order), each bucket all-reduced (AVG over the data-parallel group, backend "auto",
  async) from the backward as soon as its gradients are final, optionally clipped by
  the global norm (over the pipeline group too), then ``torch.optim.AdamW`` steps the
  parameters in place. The reference.
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

import functools
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
    # gradient bucket size in MiB; None: DataParallelAdamW's from the model's size, the
    # bucketed optimizers' UPDATE_BUCKET_MIB (bucket_bytes, BucketedAdamW)
    bucket_mib: float | None = None
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

    def begin_step(self, accumulations: int) -> None:
        """Before a step's backward passes, in which each gradient accumulates
        `accumulations` times (one per microbatch this rank runs): an optimizer that
        reduces from the backward (DataParallelAdamW) counts on it; the others need not."""

    def clip_coef(self, sumsq: float) -> float:
        """torch.nn.utils.clip_grad_norm_'s factor (1 when clipping is off)."""
        if self.cfg.grad_clip <= 0:
            return 1.0
        norm = math.sqrt(sumsq)
        return min(1.0, self.cfg.grad_clip / (norm + 1e-6))


#: Devices of torch.optim.AdamW's fused kernel that DataParallelAdamW uses.
FUSED_DEVICES = ("cpu", "cuda")
#: The first bucket's bound in bytes (DDP's first bucket, torch.distributed's
#: _DEFAULT_FIRST_BUCKET_BYTES): the backward's last gradients start their all-reduce
#: early; later buckets are larger, fewer latencies.
FIRST_BUCKET_BYTES = 2**20
#: The bound of later buckets for large models (DDP's bucket_cap_mb).
MAX_BUCKET_BYTES = 25 * 2**20
#: The least bound of later buckets from the size: below it a call's latency outweighs
#: what an earlier start saves.
MIN_BUCKET_BYTES = 64 * 2**10
#: OffloadedAdamW's and SAMO's buckets without --bucket-mib.
UPDATE_BUCKET_MIB = 4.0


def update_bucket_elements(cfg: OptimConfig) -> int:
    """Elements of fp32 state per bucket of the bucketed optimizers (OffloadedAdamW,
    SAMO's): --bucket-mib, else UPDATE_BUCKET_MIB."""
    mib = UPDATE_BUCKET_MIB if cfg.bucket_mib is None else cfg.bucket_mib
    return max(1, int(mib * 2**20) // 4)


def bucket_bytes(total_bytes: int, bucket_mib: float | None) -> tuple[int, int]:
    """(first, later) bucket bounds in bytes of DataParallelAdamW's gradient buckets for
    a stage of `total_bytes` gradient bytes. `bucket_mib` given: every bucket holds up to
    that many MiB, the first at most FIRST_BUCKET_BYTES (DDP's rule). None: from the
    size: later buckets half the stage (at least MIN_BUCKET_BYTES, at most 25 MiB, DDP's
    cap), the first a quarter of a later one (at most 1 MiB, DDP's): a small model
    still splits into three buckets, the first of which starts its all-reduce while
    the backward runs the rest. (Five buckets of a quarter each measured no faster on
    the mini GPT at 2 ranks: each call's latency ate the earlier start.)"""
    if bucket_mib is not None:
        later = max(1, int(bucket_mib * 2**20))
    else:
        later = min(MAX_BUCKET_BYTES, max(MIN_BUCKET_BYTES, total_bytes // 2))
    first = min(later, FIRST_BUCKET_BYTES, later // 4 if bucket_mib is None else later)
    return max(1, first), later


#: Entries per row of flat_sumsq's norms.
NORM_ROW = 8192


def flat_sumsq(flat: torch.Tensor) -> torch.Tensor:
    """The sum of squares of the 1-D `flat` in float64: the norms of its rows of NORM_ROW
    entries in one reduction (a short sum each: a whole bucket's fp32 norm drifts by
    ~1e-5 relative at 1e6 entries, a row's by ~1e-7), squared and summed in float64.
    Within 1e-8 relative of the float64 sum of squares, at the cost of one pass over
    the fp32 data instead of a float64 copy."""
    n = flat.numel() // NORM_ROW * NORM_ROW
    total = torch.linalg.vector_norm(flat[:n].view(-1, NORM_ROW), dim=1).double().square().sum()
    if n < flat.numel():
        total += torch.linalg.vector_norm(flat[n:]).double().square()
    return total


class _GradBucket:
    """Consecutive gradients (backward order) as views of one flat tensor."""

    __slots__ = ("flat", "params", "pending", "work")

    def __init__(self, flat: torch.Tensor, params: list[int]):
        self.flat, self.params = flat, params
        self.pending = len(params)  # gradients not yet final in this step
        self.work = None            # the all-reduce in flight


class DataParallelAdamW(_GradientComm):
    """All-reduce + clip + torch.optim.AdamW (parameters and states in the model dtype).

    With a data group, every gradient is a view of a persistent flat bucket (DDP's
    gradient_as_bucket_view): buckets hold whole tensors in reverse parameter order (the
    backward's), sized by ``bucket_bytes`` (--bucket-mib); autograd accumulates into
    them in place, and nothing is flattened, copied back or allocated per step. After
    ``begin_step(n)`` (n: the accumulations each gradient gets this step, one per
    microbatch the rank runs), a post-accumulate-grad hook counts each gradient's
    accumulations, and a bucket's all-reduce (AVG, async, backend "auto") is posted from
    the backward as soon as its gradients are final, strictly in bucket order (a bucket
    posts once it and every earlier one are ready), so that every replica posts the same
    collectives in the same order. ``step`` posts what the backward did not (gradients
    that got no accumulation this step count as zero), waits for every bucket, and
    takes the global norm from the buckets (one fused reduction each). The hooks are
    registered at the first ``begin_step``, after those the caller registered at
    construction (the pruning's masking), which thus run first."""

    def __init__(self, params, cfg: OptimConfig, data_group=None, pipe_group=None,
                 world_reduce: bool = False, timers: PhaseTimers | None = None,
                 world_group=None):
        super().__init__(cfg, data_group, pipe_group, world_reduce, timers, world_group)
        self.params = [p for p in params if p.requires_grad]
        bucketed = data_group is not None and bool(self.params)
        #: torch.optim.AdamW's implementation: the bucketed path steps every tensor in
        #: one fused kernel (one pass over each tensor's data instead of torch's five
        #: single-tensor ops; the same update to fp32 rounding, ~1e-8 per element); else
        #: the single-tensor update the parity references run
        self.adamw_impl = {"foreach": False, "fused": True if bucketed and all(
            p.is_floating_point() and p.device.type in FUSED_DEVICES for p in self.params)
            else None}
        self.opt = torch.optim.AdamW(param_groups(self.params, cfg.weight_decay), lr=cfg.lr,
                                     betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                     **self.adamw_impl)
        self.scaler = LossScaler(False)
        self.last_grad_norm = float("nan")
        #: buckets whose all-reduce the backward posted (before step), over the run: a
        #: run whose backward never posts one has lost the overlap
        self.posted_in_backward = 0
        self.buckets: list[_GradBucket] = []
        self._views: list[torch.Tensor] = []
        self._bucket_of: list[int] = []
        self._count: list[int] = []
        self._expected: int | None = None  # accumulations per gradient this step
        self._next = 0                      # the next bucket to post
        self._hooked = False
        if bucketed:
            self._build_buckets()

    # --- buckets ------------------------------------------------------------------------
    def _build_buckets(self) -> None:
        """The flat buckets and each gradient's view (see the class doc)."""
        total = sum(p.numel() * p.element_size() for p in self.params)
        first, later = bucket_bytes(total, self.cfg.bucket_mib)
        groups: list[list[int]] = []
        size, limit, key = 0, first, None
        for k in reversed(range(len(self.params))):
            p = self.params[k]
            if groups and (size >= limit or (p.dtype, p.device) != key):
                groups.append([])
                size, limit = 0, later
            if not groups:
                groups.append([])
            groups[-1].append(k)
            size += p.numel() * p.element_size()
            key = (p.dtype, p.device)
        self._views = [None] * len(self.params)  # type: ignore[list-item]
        self._bucket_of = [0] * len(self.params)
        for b, members in enumerate(groups):
            p0 = self.params[members[0]]
            flat = torch.zeros(sum(self.params[k].numel() for k in members), dtype=p0.dtype,
                               device=p0.device)
            off = 0
            for k in members:
                p = self.params[k]
                view = flat[off:off + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._views[k], self._bucket_of[k] = view, b
                off += p.numel()
            self.buckets.append(_GradBucket(flat, members))
        self._count = [0] * len(self.params)

    def bucket_sizes(self) -> list[int]:
        """Bytes of each gradient bucket, in posting order."""
        return [b.flat.numel() * b.flat.element_size() for b in self.buckets]

    def begin_step(self, accumulations: int) -> None:
        """Before a step's backward passes: each gradient accumulates `accumulations`
        times in them (once per microbatch this rank runs), so each bucket's all-reduce
        is posted from the backward once its gradients have (class doc)."""
        if not self.buckets:
            return
        if accumulations < 1:
            raise ValueError(f"begin_step: {accumulations} accumulations per gradient; "
                             "expected >= 1 (the microbatches this rank runs)")
        if not self._hooked:
            for k, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, k))
            self._hooked = True
        self._expected = accumulations

    def _own_grad(self, k: int) -> None:
        """Make parameter k's gradient its bucket view again, keeping its value (a caller
        may have set ``p.grad`` to None or to a tensor of its own)."""
        p, view = self.params[k], self._views[k]
        g = p.grad
        if g is None:
            view.zero_()
        elif g.data_ptr() != view.data_ptr() or g.stride() != view.stride():
            view.copy_(g)
        else:
            return
        p.grad = view

    def _accumulated(self, k: int, param: torch.Tensor) -> None:
        """The hook: gradient k has accumulated one more microbatch."""
        if self._expected is None:
            return
        self._count[k] += 1
        if self._count[k] < self._expected:
            return
        b = self._bucket_of[k]
        if self._count[k] > self._expected or b < self._next:
            raise RuntimeError(
                f"DataParallelAdamW: a gradient accumulated {self._count[k]} times in one "
                f"step, begin_step announced {self._expected} (one per microbatch); its "
                "bucket's all-reduce was already posted")
        self._own_grad(k)
        bucket = self.buckets[b]
        bucket.pending -= 1
        if bucket.pending == 0 and b == self._next:
            while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
                self._post(self._next)
                self.posted_in_backward += 1

    def _post(self, b: int) -> None:
        # untimed: posting takes microseconds, and from the backward it would count twice
        self.buckets[b].work = self._all_reduce(self.buckets[b].flat, mcrdl.ReduceOp.AVG,
                                                self.data_group, async_op=True)
        self._next = b + 1

    def _finish_reduce(self, want_sumsq: bool) -> torch.Tensor | None:
        """Post the buckets the backward did not, wait for all; the local sum of squares
        (float64) when `want_sumsq`."""
        for b in range(self._next, len(self.buckets)):
            for k in self.buckets[b].params:
                self._own_grad(k)
            self._post(b)
        local = None
        if want_sumsq:
            local = torch.zeros(1, dtype=torch.float64, device=self.buckets[0].flat.device)
        for bucket in self.buckets:
            with self.timers("collective"):
                bucket.work.wait()
            bucket.work = None
            if local is not None:
                with self.timers("optimizer"):
                    local += flat_sumsq(bucket.flat)
        return local

    def _reset(self) -> None:
        """Zero the buckets (the next step accumulates into them) and the counts."""
        for bucket in self.buckets:
            bucket.flat.zero_()
            bucket.pending = len(bucket.params)
        self._count = [0] * len(self.params)
        self._expected = None
        self._next = 0

    # --- the step -------------------------------------------------------------------------
    def step(self, sumsq: float | None = None) -> bool:
        """One AdamW step. `sumsq`: the squared global gradient norm, when the caller
        has reduced the gradients and computed it (module docstring)."""
        lr = self.cfg.lr_at(self.step_count)
        if not self.buckets:  # nothing to reduce: the gradients as autograd left them
            self._step_unbucketed(lr, sumsq)
            return True
        local = self._finish_reduce(sumsq is None and self.cfg.grad_clip > 0)
        if sumsq is None:
            sumsq = self.global_sumsq(local) if self.cfg.grad_clip > 0 else 0.0
        self.last_grad_norm = math.sqrt(sumsq)
        with self.timers("optimizer"):
            coef = self.clip_coef(sumsq)
            if coef < 1.0:
                for bucket in self.buckets:
                    bucket.flat.mul_(coef)
            for group in self.opt.param_groups:
                group["lr"] = lr
            self.opt.step()
            self._reset()
        self.step_count += 1
        return True

    def _step_unbucketed(self, lr: float, sumsq: float | None) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
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

    def zero_grad(self) -> None:
        """Drop the gradients accumulated so far this step (waiting for any all-reduce
        the backward posted)."""
        if not self.buckets:
            self.opt.zero_grad(set_to_none=True)
            return
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
        for k in range(len(self.params)):
            self.params[k].grad = self._views[k]
        self._reset()

    def state_dict(self) -> dict:
        return {"kind": "adamw", "step_count": self.step_count, "torch": self.opt.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """Load `sd`; a state saved by another AdamW implementation (a checkpoint of the
        single-tensor update) keeps this optimizer's (torch would take the saved one)."""
        _check_kind(sd, "adamw")
        self.step_count = sd["step_count"]
        self.opt.load_state_dict(sd["torch"])
        for group in self.opt.param_groups:
            group.update(self.adamw_impl)
            if self.adamw_impl["fused"]:  # the fused kernel reads each step count on
                for p in group["params"]:   # the parameter's device, in fp32
                    st = self.opt.state.get(p)
                    if st and "step" in st:
                        st["step"] = torch.as_tensor(st["step"], dtype=torch.float32,
                                                     device=p.device)


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
        self.buckets = make_buckets(spans, update_bucket_elements(cfg))
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
