"""Magnitude pruning of a pipeline stage's parameters, and dense masked training.

A pruned tensor is described by the *index* of its unpruned entries: a sorted 1-D int32
tensor of positions in ``tensor.view(-1)``, one per parameter tensor, shared by all the
states of that tensor (SAMO, ``training/samo/optimizer.py``, stores theta32, the gradients and the
Adam moments as their values at the index; dense masked training holds the other
entries at zero).

Every parameter tensor is prunable (matrices, embeddings, biases, LayerNorm), so that
sparsity p means p of the model's phi parameters, as the memory model counts them. A
scope of n entries keeps ``n - floor(p n)`` of them (p read as the decimal it is written
as), those of largest magnitude, ties kept in model order (pipeline stage, parameter,
position), which makes the mask independent of the process grid:

- ``global``: one threshold over the whole model, every pipeline stage included. The
  selection is exact and distributed: a bisection over the float32 bit patterns of the
  magnitudes (monotone for non-negative floats) finds the keep-th largest magnitude with
  one all-reduce of a count per halving (31) over the pipeline group, then the stages
  share their numbers of ties to take them in stage order.
- ``layer``: each tensor keeps ``n - floor(p n)`` of its own entries.

Pruning is iterative (``--prune-schedule 0,100,200``): a round runs before the step it
names (0: before the first) and only removes entries, choosing among the unpruned ones
by the magnitude of their fp32 master weights. Round k of n reaches sparsity
``1 - (1 - p)^(k/n)``: every round prunes the same fraction of the entries still there
(iterative magnitude pruning), the last one reaches p. By default one round at step 0.

``DenseMasking`` applies an index to the dense optimizers (``DataParallelAdamW``,
``OffloadedAdamW``): pruned entries of the parameters, fp32 masters and Adam moments are
zeroed at each round and the pruned gradients as each tensor's gradient is accumulated,
so Adam never moves them. It is what SAMO is compared with (same mask, same numbers)
and the dense layouts of ``benchmarks/samo.py``.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Protocol

import torch

import mcrdl

from ..core.checkpoint import CheckpointError
from ..core.optim import DataParallelAdamW, OffloadedAdamW

SCOPES = ("global", "layer")
_FLOAT32_INF_BITS = 0x7F800000


@dataclass(frozen=True)
class PruneRound:
    step: int        # the round runs before this step (steps completed; 0: before the first)
    sparsity: float  # fraction of the entries of each scope pruned after the round


def check_sparsity(sparsity: float, what: str = "--prune-sparsity") -> float:
    """`sparsity` as a float in [0, 1); ValueError naming `what` otherwise."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, int | float) \
            or not 0 <= sparsity < 1:
        raise ValueError(f"{what} {sparsity!r}: expected a fraction in [0, 1) (0.9 prunes "
                         "90% of the parameters; 1 would prune them all)")
    return float(sparsity)


def parse_schedule(spec: str | None, sparsity: float) -> list[PruneRound]:
    """The rounds of ``--prune-schedule`` (comma-separated steps, increasing, from 0)
    reaching `sparsity`; None: one round at step 0. ValueError for a bad spec."""
    sparsity = check_sparsity(sparsity)
    if spec is None:
        return [PruneRound(0, sparsity)]
    try:
        steps = [int(s) for s in spec.split(",")]
    except ValueError:
        raise ValueError(f"--prune-schedule {spec!r}: expected comma-separated steps at "
                         "which to prune, e.g. 0,100,200") from None
    if steps[0] < 0 or any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise ValueError(f"--prune-schedule {spec!r}: expected strictly increasing steps "
                         ">= 0, e.g. 0,100,200")
    n = len(steps)
    rounds = [PruneRound(s, 1 - (1 - sparsity) ** ((k + 1) / n)) for k, s in enumerate(steps)]
    rounds[-1] = PruneRound(steps[-1], sparsity)
    return rounds


def kept_count(n: int, sparsity: float) -> int:
    """Entries kept of `n` at `sparsity`: n - floor(p n), p read as the decimal it prints as
    (0.95 is 19/20, not the binary float just below it)."""
    return n - math.floor(Fraction(repr(float(sparsity))) * n)


def select(values: Sequence[torch.Tensor], index: Sequence[torch.Tensor] | None,
           numels: Sequence[int], sparsity: float, scope: str, group=None) -> list[torch.Tensor]:
    """The new index of each tensor: the entries of `index` (int32, sorted; None: every
    entry of each tensor) kept at `sparsity`, by the magnitude of `values` (the tensors'
    values at their index, any float dtype), in `scope` (module doc). `numels` are the
    tensors' sizes; `group` is the pipeline group over which a global scope extends
    (None: this stage is the whole model). Collective over `group` for the global scope.

    Memory: one float32 magnitude per candidate (kept per tensor, never concatenated)
    and temporaries of one tensor at a time, so that the first round, run before SAMO's
    compressed optimizer exists, stays far below the dense optimizer it replaces."""
    if scope not in SCOPES:
        raise ValueError(f"prune scope {scope!r}: expected one of {', '.join(SCOPES)}")
    check_sparsity(sparsity, "sparsity")
    if index is not None:
        for v, i in zip(values, index, strict=True):
            if v.numel() != i.numel():
                raise ValueError(f"select: {v.numel()} values for an index of {i.numel()}")

    def positions(k: int, kept: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor k's index, or its entries where `kept`."""
        if index is not None:
            return index[k].clone() if kept is None else index[k][kept]
        n = values[k].numel()
        if kept is None:
            return torch.arange(n, dtype=torch.int32, device=values[k].device)
        return kept.nonzero().flatten().to(torch.int32)

    def magnitude(v: torch.Tensor) -> torch.Tensor:  # a new float32 tensor
        return v.detach().reshape(-1).float().abs()

    if scope == "layer":
        out = []
        for k, n in enumerate(numels):
            keep = kept_count(n, sparsity)
            if values[k].numel() <= keep:
                out.append(positions(k))
                continue
            order = torch.sort(magnitude(values[k]), descending=True, stable=True).indices
            kept = torch.zeros(values[k].numel(), dtype=torch.bool, device=values[k].device)
            kept[order[:keep]] = True
            out.append(positions(k, kept))
        return out
    # float32 bit patterns of the magnitudes: monotone for non-negative floats
    bits = [magnitude(v).view(torch.int32) for v in values]
    if not all(bool((b < _FLOAT32_INF_BITS).all()) for b in bits):
        raise ValueError("cannot prune: the weights hold non-finite values (NaN or inf); "
                         "the run diverged before the pruning round")
    total, candidates = _sum_over(group, [sum(numels), sum(b.numel() for b in bits)])
    keep = kept_count(total, sparsity)
    if candidates <= keep:
        return [positions(k) for k in range(len(values))]
    lo, hi = 0, _FLOAT32_INF_BITS + 1   # count(bits >= lo) >= keep > count(bits >= hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _sum_over(group, [sum(int((b >= mid).sum()) for b in bits)])[0] >= keep:
            lo = mid
        else:
            hi = mid
    n_stages, stage = (1, 0) if group is None else (group.size, group.rank)
    counts = [0] * (n_stages + 1)
    counts[0] = sum(int((b > lo).sum()) for b in bits)
    counts[1 + stage] = sum(int((b == lo).sum()) for b in bits)
    counts = _sum_over(group, counts)
    quota = keep - counts[0] - sum(counts[1:1 + stage])
    quota = max(0, min(quota, counts[1 + stage]))  # this stage's ties, in model order
    out = []
    for k, b in enumerate(bits):
        kept = b > lo
        ties = (b == lo).nonzero().flatten()[:quota]
        kept[ties] = True
        quota -= ties.numel()
        bits[k] = None  # one tensor's magnitudes less from here on
        out.append(positions(k, kept))
    return out


def _sum_over(group, values: list[int]) -> list[int]:
    """`values` summed elementwise over `group` (collective; None: unchanged)."""
    if group is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    mcrdl.all_reduce("auto", t, op=mcrdl.ReduceOp.SUM, group=group)
    return [int(v) for v in t]


def full_index(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The index of unpruned tensors: every position."""
    return [torch.arange(p.numel(), dtype=torch.int32, device=p.device) for p in params]


def pruned_mask(numel: int, index: torch.Tensor) -> torch.Tensor:
    """A bool tensor of `numel` entries, True at the positions not in `index`."""
    mask = torch.ones(numel, dtype=torch.bool, device=index.device)
    mask[index] = False
    return mask


class Prunable(Protocol):
    """What a pruning round works on: per parameter tensor (in model order) its index and
    its fp32 master values at the index; `set_index` applies a new index."""

    index: list[torch.Tensor]

    def kept_values(self) -> list[torch.Tensor]: ...

    def set_index(self, index: list[torch.Tensor]) -> None: ...


class DenseMasking:
    """Dense masked training with `optimizer` (a DataParallelAdamW or OffloadedAdamW over
    `named_params`): see the module doc."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], optimizer):
        if not isinstance(optimizer, DataParallelAdamW | OffloadedAdamW):
            raise TypeError(f"DenseMasking: {type(optimizer).__name__} is not a dense "
                            "optimizer of training/core/optim.py")
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.optimizer = optimizer
        if isinstance(optimizer, OffloadedAdamW):  # where each parameter's states start
            self._offsets = {id(q): off for q, off in zip(optimizer.params, optimizer.offsets,
                                                          strict=True)}
        self.index = full_index(self.params)
        self._pruned: list[torch.Tensor | None] = [None] * len(self.params)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._mask_grad, i))

    def _mask_grad(self, i: int, param: torch.Tensor) -> None:
        if self._pruned[i] is not None:
            param.grad.view(-1).masked_fill_(self._pruned[i], 0)

    def _fp32_states(self, p: torch.Tensor) -> list[torch.Tensor]:
        """The optimizer's fp32 master and moments of `p`, flat (absent ones left out)."""
        opt = self.optimizer
        if isinstance(opt, OffloadedAdamW):
            s = slice(self._offsets[id(p)], self._offsets[id(p)] + p.numel())
            return [opt.master[s], opt.exp_avg[s], opt.exp_avg_sq[s]]
        state = opt.opt.state.get(p, {})
        return [p.data.view(-1)] + [state[k].view(-1) for k in ("exp_avg", "exp_avg_sq")
                                    if k in state]

    def kept_values(self) -> list[torch.Tensor]:
        return [self._fp32_states(p)[0][i.long()] for p, i in zip(self.params, self.index,
                                                                   strict=True)]

    def set_index(self, index: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for k, (p, i) in enumerate(zip(self.params, index, strict=True)):
                mask = pruned_mask(p.numel(), i)
                self._pruned[k] = mask if bool(mask.any()) else None
                p.view(-1).masked_fill_(mask, 0)
                for t in self._fp32_states(p):
                    t.masked_fill_(mask, 0)
        self.index = [i.clone() for i in index]


class Pruning:
    """The pruning of this pipeline stage: its rounds (`schedule`), the current index of
    each parameter tensor (`named_params`, model order), and the optimizer it applies to
    (``attach``). The first round, when at step 0, runs at construction from the
    parameters themselves (the fp32 masters start as their copies), so that SAMO's
    optimizer is built already compressed. Collective over `pipe_group` (global scope)
    and, after every round and on loading a checkpoint's mask, over `data_group`: the
    stage's data-parallel replicas must hold the same mask (their gradients are
    all-reduced entry by entry at the index), else every rank raises DesyncError."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]],
                 sparsity: float, schedule: list[PruneRound], scope: str, pipe_group=None,
                 data_group=None):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.names = [n for n, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.sparsity = check_sparsity(sparsity)
        if scope not in SCOPES:
            raise ValueError(f"--prune-scope {scope!r}: expected one of {', '.join(SCOPES)}")
        self.scope, self.schedule, self.group = scope, schedule, pipe_group
        self.data_group = data_group
        self.done: list[PruneRound] = []
        self.target: Prunable | None = None
        if schedule and schedule[0].step == 0:  # from every entry: no full index made
            self._index = select([p.detach() for _, p in named], None, self.numels,
                                 schedule[0].sparsity, scope, pipe_group)
            self._check_replicas_agree(self._index, _round_name(schedule[0]))
            self.done.append(schedule[0])
        else:
            self._index = full_index(p for _, p in named)

    @classmethod
    def from_config(cls, cfg, model_stage: torch.nn.Module, pipe_group,
                    data_group=None) -> Pruning:
        """The pruning of a run's stage from its --prune-* options."""
        return cls(model_stage.named_parameters(), cfg.prune_sparsity,
                   parse_schedule(cfg.prune_schedule, cfg.prune_sparsity), cfg.prune_scope,
                   pipe_group, data_group)

    def _check_replicas_agree(self, index: list[torch.Tensor], what: str) -> None:
        """DesyncError on every rank unless the data-parallel replicas of each stage hold
        the same index (`what`: where it comes from): a CRC-32 of every tensor's length
        and positions, compared over `data_group` by one all-reduce of (h, -h) under MAX,
        then whether any stage differed over `pipe_group`, so that no stage goes on to
        wait for one that raised."""
        if self.data_group is None:
            return
        h = index_digest(index)
        t = torch.tensor([h, -h], dtype=torch.int64)
        mcrdl.all_reduce("auto", t, op=mcrdl.ReduceOp.MAX, group=self.data_group)
        here = int(t[0]) != -int(t[1])
        anywhere = _sum_over(self.group, [int(here)])[0] > 0
        if not anywhere:
            return
        if not here:
            raise mcrdl.DesyncError(
                f"{what}: the data-parallel replicas of another pipeline stage chose "
                "different masks (this stage's agree); see the error on that stage's ranks")
        raise mcrdl.DesyncError(
            f"{what}: the data-parallel replicas of this pipeline stage hold different "
            f"masks (CRC-32 of the index {int(t[0]):#010x} on one, {-int(t[1]):#010x} on "
            f"another; this rank's {h:#010x}), so their weights differ. Replicas must start "
            "from the same weights (the same --seed) or the same checkpoint and stay equal "
            "(a nondeterministic reduction breaks that)")

    @property
    def index(self) -> list[torch.Tensor]:
        """The current index of each parameter tensor (the optimizer's once attached)."""
        return self._index if self.target is None else self.target.index

    def attach(self, target: Prunable) -> None:
        """Apply the current index to `target` (SamoAdamW, or DenseMasking over a dense
        optimizer) and prune it in the later rounds."""
        if any(not torch.equal(a, b) for a, b in zip(target.index, self._index, strict=True)):
            target.set_index(self._index)
        self.target, self._index = target, []

    def kept(self) -> int:
        """Unpruned entries on this stage."""
        return sum(i.numel() for i in self.index)

    def prune_if_due(self, step: int) -> bool:
        """Run the round scheduled before step `step` (steps completed), if any."""
        due = [r for r in self.schedule if r.step == step and r not in self.done]
        for r in due:
            new = select(self.target.kept_values(), self.index, self.numels, r.sparsity,
                         self.scope, self.group)
            self._check_replicas_agree(new, _round_name(r))
            self.target.set_index(new)
            self.done.append(r)
        return bool(due)

    def describe(self) -> str:
        steps = ",".join(str(r.step) for r in self.schedule)
        return f"pruned to sparsity {self.sparsity} ({self.scope}, rounds before steps {steps})"

    # --- checkpoints ------------------------------------------------------------------
    @property
    def compressed(self) -> bool:
        """Whether the optimizer stores the model compressed (SAMO), not dense masked."""
        return not isinstance(self.target, DenseMasking)

    def add_to_shard(self, shard: dict) -> None:
        """Record the mask in a checkpoint shard (the rounds done, the scope and each
        tensor's index, by parameter name); with SAMO also replace the shard's dense
        model by its values at the index (``training.checkpoint.shard_model`` expands)."""
        shard["pruning"] = {
            "sparsity": self.sparsity, "scope": self.scope,
            "rounds": [[r.step, r.sparsity] for r in self.done],
            "compressed": self.compressed,
            "shapes": dict(zip(self.names, self.shapes, strict=True)),
            "index": {n: i.clone() for n, i in zip(self.names, self.index, strict=True)}}
        if self.compressed:
            shard["model"] = {n: shard["model"][n].reshape(-1)[i.long()]
                              for n, i in zip(self.names, self.index, strict=True)}

    def expected_rounds(self, step: int) -> list[list]:
        """The rounds (step, sparsity) this run has done after `step` steps."""
        return [[r.step, r.sparsity] for r in self.schedule if r.step < step]

    def load_shard(self, shard: dict, step: int) -> None:
        """Adopt the mask of a checkpoint shard (checked by ``check_shard``) of `step`."""
        self.done = [r for r in self.schedule if r.step < step]
        index = [shard["pruning"]["index"][n].clone() for n in self.names]
        self._check_replicas_agree(index, f"the mask of the checkpoint of step {step}")
        self.target.set_index(index)


def check_shard(shard: dict, pruning: Pruning | None, path: Path | str, step: int) -> None:
    """CheckpointError unless the mask of `shard` (its "pruning" entry) is the one this
    run's `pruning` has after `step` steps (same scope and rounds, same storage) and is
    well formed for this stage's tensors; a dense checkpoint goes only with no pruning."""
    entry = shard.get("pruning")
    if entry is None and pruning is None:
        return
    if entry is None:
        raise CheckpointError(
            f"checkpoint {path} was written by a run without pruning; this run prunes to "
            f"sparsity {pruning.sparsity}: resume without --prune-sparsity, or start anew")
    have = (f"toward sparsity {entry['sparsity']} ({entry['scope']}), rounds (step, "
            f"sparsity) {_rounded(entry['rounds'])}")
    if pruning is None:
        raise CheckpointError(
            f"checkpoint {path} holds a model pruned {have}; this run prunes nothing: "
            "resume with the --prune-sparsity, --prune-schedule and --prune-scope (and "
            "--samo) of the run that wrote it")
    want = pruning.expected_rounds(step)
    if entry["scope"] != pruning.scope or entry["rounds"] != want:
        raise CheckpointError(
            f"checkpoint {path} has a different mask: it was pruned {have}; this run's "
            f"options prune toward sparsity {pruning.sparsity} ({pruning.scope}), rounds "
            f"{_rounded(want)} by step {step}: resume with the --prune-sparsity, "
            "--prune-schedule and --prune-scope of the run that wrote it")
    if entry["compressed"] != pruning.compressed:
        kinds = {True: "SAMO (--samo)", False: "dense masked training"}
        raise CheckpointError(f"checkpoint {path} was written by {kinds[entry['compressed']]}"
                              f", this run uses {kinds[pruning.compressed]}: resume with the "
                              "same --samo setting")
    for name, shape, numel in zip(pruning.names, pruning.shapes, pruning.numels, strict=True):
        index = entry["index"].get(name)
        if index is None or tuple(entry["shapes"].get(name, ())) != shape:
            raise CheckpointError(f"checkpoint {path}: no mask for {name} {list(shape)}; "
                                  "it was written for another model or stage")
        ok = index.dtype == torch.int32 and index.dim() == 1 and (
            index.numel() == 0 or (int(index[0]) >= 0 and int(index[-1]) < numel
                                   and bool((index[1:] > index[:-1]).all())))
        if not ok:
            raise CheckpointError(f"checkpoint {path}: the index of {name} is not a sorted "
                                  f"int32 list of positions in 0..{numel - 1}; the shard is "
                                  "damaged")
        values = shard["model"][name]
        if entry["compressed"]:
            states = [values] + [shard["optimizer"].get(k, {}).get(name)
                                 for k in ("theta32", "exp_avg", "exp_avg_sq")]
            if any(t is None or t.shape != index.shape for t in states):
                raise CheckpointError(f"checkpoint {path}: the states of {name} do not hold "
                                      f"one value per entry of its index ({index.numel()}); "
                                      "the shard is damaged")
        elif bool(values.reshape(-1).masked_select(pruned_mask(numel, index)).any()):
            raise CheckpointError(f"checkpoint {path}: {name} has nonzero weights at pruned "
                                  "positions: its mask does not belong to its weights")


def index_digest(index: Sequence[torch.Tensor]) -> int:
    """A CRC-32 of each tensor's index, its length first ([0, 1] + [2] differs from
    [0] + [1, 2])."""
    h = 0
    for i in index:
        h = zlib.crc32(struct.pack("<q", i.numel()), h)
        h = zlib.crc32(i.detach().to("cpu", torch.int32).contiguous().numpy(), h)
    return h


def _round_name(r: PruneRound) -> str:
    return f"pruning round before step {r.step} (sparsity {r.sparsity})"


def _rounded(rounds: list[list]) -> list[tuple[int, float]]:
    return [(step, round(sparsity, 4)) for step, sparsity in rounds]
