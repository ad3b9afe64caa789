"""SAMO: sparsity-aware memory optimization for pruned networks (Singh & Bhatele,
IPDPS 2023; dissertation ch. 4), in the pipeline x data engine.

After pruning (``training/samo/pruning.py``: per parameter tensor, the flat int32 index
of its unpruned entries), ``SamoAdamW`` keeps only the compute copy dense:

- theta16, the parameters in the training dtype, stay dense with zeros at the pruned
  positions, so that forward and backward run the ordinary dense kernels.
- theta32 (fp32 master weights), grad16, grad32 and Adam's two moments are *compressed*:
  one flat buffer each, holding every tensor's values at its index, laid out like the
  flat index buffer (decaying tensors first, as OffloadedAdamW).
- Backward: a post-accumulate-grad hook on every parameter tensor gathers its dense
  gradient at the index into grad16 (adding over microbatches) and frees it, so the
  dense gradients of the whole model never coexist; only one tensor's at a time.
- The data-parallel all-reduce runs on grad16, bucketed and overlapped with the update
  exactly as ``OffloadedAdamW`` (``BucketedAdamW``): message sizes shrink by (1 - p)
  and pruned gradients are never communicated.
- Per bucket: grad16 is up-cast into grad32, AdamW runs on the compressed tensors (the
  denominator is formed in grad32's storage, which is free by then: no temporaries), and
  theta32 is *expanded* into theta16: down-cast into a compressed fp16 copy, then
  scattered to the index. theta16's pruned positions are never written, so they stay
  exactly zero; the expansion writes in place instead of freeing and re-allocating
  theta16. The step's only temporaries are float64 pieces of the gradient (its norm, for
  clipping) and int64 pieces of the index (the scatter), each of at most kept/8 entries:
  at most f phi bytes, within the 2 f phi the acceptance allows over the steady state.

Memory model (Eq. 4.1-4.5), bytes of model states for phi parameters before pruning and
f = 1 - p kept: mixed precision with Adam keeps theta16, grad16 (2 + 2), theta32, grad32
and two moments (4 x 4): ``M_default = 20 phi``. SAMO keeps theta32, grad32, the moments
and grad16 compressed (18 f phi), the index (4 f phi), theta16 dense (2 phi) and the
compressed fp16 copy of the expansion (2 f phi):

    M_SAMO = 18 f phi + 4 f phi + 2 phi + 2 f phi = 24 f phi + 2 phi
           = M_default - (24 p - 6) phi,

a saving of (24 p - 6) / 20: break-even at p = 0.25, 66% at p = 0.8, 78% at p = 0.9.
``SamoAdamW.state_bytes`` accounts every state tensor's storage; with the ``kept``
entries as f phi it equals ``samo_bytes`` exactly.

Pipeline consequence (Eq. 4.6-4.9): the memory saved lets the same model run with fewer
pipeline stages G_inter and more data parallelism G_data. With t_f + t_b the forward and
backward time of one microbatch through the whole model, a step's pipeline bubble is
``(t_f + t_b)(1 - 1/G_inter)`` (Eq. 4.7), growing with G_inter, and each GPU handles
``4 B / (mbs G_data)`` point-to-point messages per step for a batch of B sequences in
microbatches of mbs (Eq. 4.8-4.9). ``benchmarks/samo.py`` measures it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from ..core.optim import (
    BucketedAdamW,
    DataParallelAdamW,
    LossScaler,
    OffloadedAdamW,
    OptimConfig,
    decays,
    make_buckets,
    storage_bytes,
    update_bucket_elements,
)
from ..core.timers import PhaseTimers
from .pruning import full_index, pruned_mask

KIND = "samo-adamw"


# --- the memory and pipeline models ---------------------------------------------------

def default_bytes(phi: int) -> int:
    """Eq. 4.1: model-state bytes of mixed-precision Adam (theta16, grad16, theta32,
    grad32, two moments) for `phi` parameters."""
    return 20 * phi


def samo_bytes(phi: int, kept: int, compute_bytes: int = 2) -> int:
    """Eq. 4.2: SAMO's model-state bytes for `phi` parameters of which `kept` (f phi) are
    unpruned; `compute_bytes` is the size of a theta16 element (4 for fp32 runs)."""
    compressed = (16 + compute_bytes) * kept          # theta32, grad32, 2 moments, grad16
    return compressed + 4 * kept + compute_bytes * phi + compute_bytes * kept


def saving(sparsity: float) -> float:
    """Eq. 4.3-4.5: the fraction of M_default that SAMO saves at `sparsity` p,
    (24 p - 6) / 20 (negative below the break-even p = 0.25)."""
    return (24 * sparsity - 6) / 20


def bubble_seconds(fwd_bwd_seconds: float, n_stages: int) -> float:
    """Eq. 4.7: a step's pipeline bubble, (t_f + t_b)(1 - 1/G_inter), for `fwd_bwd_seconds`
    the forward and backward time of one microbatch through the whole model."""
    return fwd_bwd_seconds * (1 - 1 / n_stages)


def p2p_messages(global_batch: int, micro_batch: int, n_replicas: int) -> float:
    """Eq. 4.8-4.9: point-to-point messages per GPU and step, 4 B / (mbs G_data)."""
    return 4 * global_batch / (micro_batch * n_replicas)


def dense_state_bytes(optimizer) -> dict[str, int]:
    """Bytes of the model states of a dense optimizer of training/core/optim.py at its step:
    its buffers' storages, plus the gradients autograd leaves in ``p.grad`` (one per
    parameter, of its size and dtype), which live from the backward pass until the step
    gathers them (OffloadedAdamW copies them into its flat gradient buffer there)."""
    if isinstance(optimizer, OffloadedAdamW):
        params = optimizer.params
        out = {"theta16": storage_bytes([optimizer.flat]),
               "grad16 (flat buffer)": storage_bytes([optimizer.flat_grad]),
               "theta32": storage_bytes([optimizer.master]),
               "exp_avg": storage_bytes([optimizer.exp_avg]),
               "exp_avg_sq": storage_bytes([optimizer.exp_avg_sq])}
    elif isinstance(optimizer, DataParallelAdamW):
        params = optimizer.params
        states = [t for p in params for t in optimizer.opt.state.get(p, {}).values()
                  if t.shape == p.shape]
        # torch.optim.AdamW creates its moments, like the parameters, at its first step
        moments = storage_bytes(states) if states else 2 * storage_bytes(params)
        out = {"theta": storage_bytes(params), "exp_avg + exp_avg_sq": moments}
    else:
        raise TypeError(f"dense_state_bytes: {type(optimizer).__name__} is not a dense "
                        "optimizer of training/core/optim.py")
    out["grad16 (autograd)" if isinstance(optimizer, OffloadedAdamW) else "grad"] = sum(
        p.numel() * p.element_size() for p in params)
    return out


# --- the optimizer --------------------------------------------------------------------

class SamoAdamW(BucketedAdamW):
    """AdamW on compressed model states (module doc). `named_params` in model order;
    `index` (default: every entry) the int32 index of each tensor, e.g. a ``Pruning``'s;
    ``set_index`` changes it (a pruning round). The other arguments as OffloadedAdamW's.
    Every state lives on the parameters' device."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]],
                 cfg: OptimConfig, index: list[torch.Tensor] | None = None, data_group=None,
                 pipe_group=None, world_reduce: bool = False,
                 timers: PhaseTimers | None = None, loss_scaling: bool = False,
                 world_group=None):
        super().__init__(cfg, data_group, pipe_group, world_reduce, timers, world_group)
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if not named:
            raise ValueError("SamoAdamW: no trainable parameters")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.device, self.dtype = self.params[0].device, self.params[0].dtype
        if any(p.device != self.device or p.dtype != self.dtype for p in self.params):
            raise ValueError("SamoAdamW: all parameters must share one device and dtype")
        # decaying tensors first in the compressed buffers: at most two runs per bucket
        self.layout = sorted(range(len(self.params)), key=lambda k: not decays(self.params[k]))
        self.scaler = LossScaler(loss_scaling)
        self.last_grad_norm = float("nan")
        self.index: list[torch.Tensor] = []
        self._allocate(index if index is not None else full_index(self.params), None)
        for k, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._compress_grad, k))

    # --- storage ------------------------------------------------------------------------
    def _allocate(self, index: list[torch.Tensor], old: dict | None) -> None:
        """Compressed buffers for `index`. Entries kept from `old` (the previous buffers
        and index) keep their master weight and moments; others start from theta16 with
        zero moments. theta16 is zeroed where `index` prunes."""
        if len(index) != len(self.params):
            raise ValueError(f"SamoAdamW: {len(index)} index tensors for "
                             f"{len(self.params)} parameters")
        self.slots: list[tuple[int, int]] = [(0, 0)] * len(self.params)
        off = 0
        for k in self.layout:
            i = index[k]
            if i.dtype != torch.int32 or i.dim() != 1 or (
                    i.numel() and not (0 <= int(i[0]) and int(i[-1]) < self.params[k].numel()
                                       and bool((i[1:] > i[:-1]).all()))):
                raise ValueError(f"SamoAdamW: the index of {self.names[k]} must be sorted "
                                 "unique int32 positions inside the tensor")
            self.slots[k] = (off, off + i.numel())
            off += i.numel()
        kept, dev = off, self.device
        self.piece = max(1, kept // 8)  # entries per float64/int64 temporary of the step
        flat_index = torch.empty(kept, dtype=torch.int32, device=dev)
        self.theta32 = torch.empty(kept, dtype=torch.float32, device=dev)
        self.exp_avg = torch.zeros(kept, dtype=torch.float32, device=dev)
        self.exp_avg_sq = torch.zeros(kept, dtype=torch.float32, device=dev)
        self.flat_grad = torch.zeros(kept, dtype=self.dtype, device=dev)      # grad16
        self.grad32 = torch.zeros(kept, dtype=torch.float32, device=dev)
        self.theta16_compressed = torch.empty(kept, dtype=self.dtype, device=dev)
        new_index = []
        with torch.no_grad():
            for k, p in enumerate(self.params):
                a, b = self.slots[k]
                flat_index[a:b].copy_(index[k])
                new_index.append(flat_index[a:b])
                dense = p.view(-1)
                self.theta32[a:b].copy_(dense[index[k]])
                if old is not None:
                    self._keep_states(k, index[k], old)
                dense.masked_fill_(pruned_mask(p.numel(), index[k]), 0)
        self.flat_index, self.index = flat_index, new_index
        self._fresh = [True] * len(self.params)  # no gradient of this step gathered yet
        spans = [(*self.slots[k], self.cfg.weight_decay if decays(self.params[k]) else 0.0)
                 for k in self.layout]
        self.buckets = make_buckets(spans, update_bucket_elements(self.cfg))
        # the tensors of each bucket, by the bucket's start
        self._bucket_tensors = {start: [k for k in self.layout if start <= self.slots[k][0] < end]
                                for start, end, _ in self.buckets}

    def _keep_states(self, k: int, now: torch.Tensor, old: dict) -> None:
        """Copy tensor k's master and moments from the `old` buffers at the positions of
        its new index `now` that its old index holds."""
        a, b = self.slots[k]
        oa, ob = old["slots"][k]
        was = old["index"][k]
        if was.numel() == 0 or now.numel() == 0:
            return
        pos = torch.searchsorted(was, now).clamp_(max=was.numel() - 1)
        present = was[pos] == now
        for name in ("theta32", "exp_avg", "exp_avg_sq"):
            dst = getattr(self, name)[a:b]
            src = old[name][oa:ob][pos]
            dst.copy_(torch.where(present, src, dst))

    def set_index(self, index: list[torch.Tensor]) -> None:
        """Store the states over a new index (a pruning round, or a checkpoint's mask)."""
        old = {"slots": self.slots, "index": self.index, "theta32": self.theta32,
               "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        self._allocate(index, old)

    def kept_values(self) -> list[torch.Tensor]:
        """Each tensor's fp32 master weights at its index (for a pruning round)."""
        return [self.theta32[a:b] for a, b in self.slots]

    def kept(self) -> int:
        """Unpruned entries (f phi of this stage)."""
        return self.theta32.numel()

    def state_bytes(self) -> dict[str, int]:
        """Bytes of every model state's storage (theta16 dense; the rest compressed)."""
        return {"theta16": storage_bytes(self.params),
                "theta32": storage_bytes([self.theta32]),
                "grad16": storage_bytes([self.flat_grad]),
                "grad32": storage_bytes([self.grad32]),
                "exp_avg": storage_bytes([self.exp_avg]),
                "exp_avg_sq": storage_bytes([self.exp_avg_sq]),
                "index": storage_bytes([self.flat_index]),
                "theta16_compressed": storage_bytes([self.theta16_compressed])}

    # --- backward -----------------------------------------------------------------------
    def _compress_grad(self, k: int, param: torch.Tensor) -> None:
        """Gather tensor k's freshly accumulated dense gradient at its index into grad16
        (added to the earlier microbatches'), then free it."""
        a, b = self.slots[k]
        dense = param.grad.reshape(-1)
        if self._fresh[k]:
            torch.index_select(dense, 0, self.index[k], out=self.flat_grad[a:b])
            self._fresh[k] = False
        else:
            self.flat_grad[a:b].add_(dense.index_select(0, self.index[k]))
        param.grad = None

    def _gather_grads(self) -> None:
        """The hooks gathered the gradients: zero those of tensors that got none this
        step, and start the next step's accumulation afresh."""
        for k, fresh in enumerate(self._fresh):
            if fresh:
                a, b = self.slots[k]
                self.flat_grad[a:b].zero_()
        self._fresh = [True] * len(self.params)

    # --- update ---------------------------------------------------------------------------
    def _grad_sumsq(self, start: int, end: int) -> torch.Tensor:
        """Sum of squares of grad16[start:end] in float64, piece by piece."""
        return sum(g.double().pow_(2).sum() for g in self.flat_grad[start:end].split(self.piece))

    def _update(self, bucket, lr: float, grad_coef: float) -> None:
        """OffloadedAdamW's update, run by run, on the compressed fp32 states; then expand."""
        c = self.cfg
        step = self.step_count + 1
        bias1 = 1 - c.beta1 ** step
        bias2_sqrt = (1 - c.beta2 ** step) ** 0.5
        step_size = lr / bias1
        start, end, runs = bucket
        self.grad32[start:end].copy_(self.flat_grad[start:end])
        if grad_coef != 1.0:
            self.grad32[start:end].mul_(grad_coef)
        for a, b, wd in runs:
            g, p = self.grad32[a:b], self.theta32[a:b]
            m, v = self.exp_avg[a:b], self.exp_avg_sq[a:b]
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - c.beta1)
            v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
            denom = torch.sqrt(v, out=g).div_(bias2_sqrt).add_(c.eps)  # g is spent
            p.addcdiv_(m, denom, value=-step_size)
        self._expand(start, end, self._bucket_tensors[start])

    def _expand(self, start: int, end: int, tensors: list[int]) -> None:
        """theta32[start:end] into the dense theta16 of `tensors`: down-cast into the
        compressed fp16 copy, then scatter to the index."""
        self.theta16_compressed[start:end].copy_(self.theta32[start:end])
        with torch.no_grad():
            for k in tensors:
                a, b = self.slots[k]
                dense = self.params[k].view(-1)
                for i, v in zip(self.index[k].split(self.piece),
                                self.theta16_compressed[a:b].split(self.piece), strict=True):
                    dense.index_put_((i,), v)  # converts the piece of the index to int64

    def zero_grad(self) -> None:
        """Drop the gradients gathered so far this step."""
        for p in self.params:
            p.grad = None
        self._fresh = [True] * len(self.params)

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Step, loss scaler and each tensor's compressed master weights and moments by
        name (the index is saved once, with the mask: ``Pruning.add_to_shard``)."""
        out = {"kind": KIND, "step_count": self.step_count, "scaler": self.scaler.state_dict()}
        for name in ("theta32", "exp_avg", "exp_avg_sq"):
            flat = getattr(self, name)
            out[name] = {n: flat[a:b].clone() for n, (a, b) in zip(self.names, self.slots,
                                                                     strict=True)}
        return out

    def load_state_dict(self, sd: dict) -> None:
        """Load `sd` over the current index (set it first: ``Pruning.load_shard``)."""
        if sd.get("kind") != KIND:
            raise ValueError(f"optimizer state is of kind {sd.get('kind')!r}, this run uses "
                             f"{KIND!r}; resume with the same --samo setting")
        for name in ("theta32", "exp_avg", "exp_avg_sq"):
            for n, (a, b) in zip(self.names, self.slots, strict=True):
                t = sd[name].get(n)
                if t is None or t.numel() != b - a:
                    have = "nothing" if t is None else f"{t.numel()} values"
                    raise ValueError(f"optimizer state {name} of {n} holds {have}, its index "
                                     f"{b - a} entries: the checkpoint's mask differs")
        self.step_count = sd["step_count"]
        self.scaler.load_state_dict(sd["scaler"])
        for name in ("theta32", "exp_avg", "exp_avg_sq"):
            flat = getattr(self, name)
            for n, (a, b) in zip(self.names, self.slots, strict=True):
                flat[a:b].copy_(sd[name][n])
        for start, end, _ in self.buckets:
            self._expand(start, end, self._bucket_tensors[start])
