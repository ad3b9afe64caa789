"""The communication a tensor-parallel layer needs, passed to it as arguments.

``AxisComm`` is one axis of the grid as a layer sees it: this rank's mcrdl group along
the axis (None when the axis has degree 1: then every collective is a no-op or a copy
and nothing is sent), the backend its collectives go to ("auto" unless pinned, e.g.
``z=pccl``), and the recorder of issue/wait events. ``TensorComms`` bundles the three
axes of the 3D matrix multiplication (x, y, z), the data axis, the overlap settings,
the matmul kernel chooser and the weight-gather schedule; a layer gets one and never
reads globals, so that X alone (Megatron tensor parallelism), Z alone (FSDP/ZeRO-3)
or any mix is a matter of which groups are passed.

Every collective here is a SUM. ``Pending`` is an issued collective: ``wait()`` returns
its result; with async off (or degree 1) the result is already there. Use that result,
not the tensor passed in: a blocking call inside a CAC segment's recomputation
(training/core/cac.py) returns the first forward's stashed result and writes nothing.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

import mcrdl

from ..core.cac import through_stash

#: --overlap levels: what each turns on (each includes the ones before it).
OVERLAP_LEVELS = ("none", "oar", "oar+ors", "all")


@dataclass(frozen=True)
class Overlap:
    """Which collectives overlap computation. ``oar``: the backward all_reduce of a
    Linear's input gradient runs while its weight gradient is computed. ``ors``: the Z
    reduce_scatters of the weight gradients are waited only before the data all_reduce.
    ``oag``: the Z all_gather of the next layer's weight is issued before this layer
    computes (the order of the gathers is recorded in the first forward)."""

    oar: bool = False
    ors: bool = False
    oag: bool = False

    @classmethod
    def from_level(cls, level: str) -> Overlap:
        if level not in OVERLAP_LEVELS:
            raise ValueError(f"--overlap {level!r}: expected one of {', '.join(OVERLAP_LEVELS)}")
        i = OVERLAP_LEVELS.index(level)
        return cls(oar=i >= 1, ors=i >= 2, oag=i >= 3)


class Recorder:
    """Issue and wait events of the collectives, in program order, when enabled:
    ``(event, op, axis, tag)`` with event "issue" or "wait" (a blocking call records
    both at once). The proof that overlap happens in the intended order."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.events: list[tuple[str, str, str, str]] = []

    def add(self, event: str, op: str, axis: str, tag: str) -> None:
        if self.enabled:
            self.events.append((event, op, axis, tag))

    def mark(self, tag: str) -> None:
        """A non-communication event (e.g. "compute dW c_attn") in the same stream."""
        if self.enabled:
            self.events.append(("mark", "", "", tag))

    def clear(self) -> None:
        self.events.clear()


class Pending:
    """An issued collective and the tensor holding its result once waited."""

    __slots__ = ("work", "value", "comm", "what")

    def __init__(self, work, value: torch.Tensor, comm: AxisComm | None = None,
                 what: tuple[str, str, str] | None = None):
        self.work, self.value, self.comm, self.what = work, value, comm, what

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            t0 = time.perf_counter()
            self.work.wait()
            self.work = None
            self.comm.exposed += time.perf_counter() - t0
            self.comm.recorder.add("wait", *self.what)
        return self.value


class AxisComm:
    """One axis of the grid: its group (None: degree 1), backend and recorder.
    `backend`: one name for every collective, or a mapping from the mcrdl operation
    ("all_reduce", "all_gather", "reduce_scatter") to its backend ("auto" where absent).
    ``exposed``: seconds this rank spent blocked on the axis's collectives (blocking
    calls and waits), the communication that computation did not hide."""

    def __init__(self, name: str, group: mcrdl.Group | None,
                 backend: str | dict[str, str] = "auto", recorder: Recorder | None = None):
        self.name, self.group, self.backend = name, group, backend
        self.recorder = recorder or Recorder()
        self.size = 1 if group is None else group.size
        self.rank = 0 if group is None else group.rank
        self.exposed = 0.0

    def __repr__(self) -> str:
        return f"AxisComm({self.name}, size {self.size}, rank {self.rank}, {self.backend!r})"

    def backend_of(self, op: str) -> str:
        return self.backend if isinstance(self.backend, str) else self.backend.get(op, "auto")

    def _issue(self, op: str, tag: str, fn, value: torch.Tensor, async_op: bool) -> Pending:
        """Run `fn(async_op)`, the collective that leaves its result in `value`. Blocking
        calls go through the CAC stash (training/core/cac.py); async ones never do, so a
        segment must issue the same ones in its first forward and its recomputation."""
        self.recorder.add("issue", op, self.name, tag)
        if async_op:
            return Pending(fn(True), value, self, (op, self.name, tag))
        t0 = time.perf_counter()

        def move() -> torch.Tensor:
            fn(False)
            return value

        value = through_stash(op, move)
        self.exposed += time.perf_counter() - t0
        self.recorder.add("wait", op, self.name, tag)
        return Pending(None, value)

    def all_reduce(self, t: torch.Tensor, *, async_op: bool = False, tag: str = "") -> Pending:
        """Sum `t` (contiguous) in place over the axis."""
        if self.group is None:
            return Pending(None, t)
        return self._issue("all_reduce", tag, lambda a: mcrdl.all_reduce(
            self.backend_of("all_reduce"), t, op=mcrdl.ReduceOp.SUM, group=self.group,
            async_op=a), t, async_op)

    def all_gather(self, t: torch.Tensor, *, async_op: bool = False, tag: str = "") -> Pending:
        """The axis's `t`s (equal shapes) stacked in group-rank order along a new dim 0."""
        if self.group is None:
            return Pending(None, t.unsqueeze(0))
        t = t.contiguous()
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        return self._issue("all_gather", tag, lambda a: mcrdl.all_gather(
            self.backend_of("all_gather"), out, t, group=self.group, async_op=a), out, async_op)

    def reduce_scatter(self, t: torch.Tensor, *, async_op: bool = False,
                       tag: str = "") -> Pending:
        """Block `rank` of the sum over the axis of `t` (1-D, size divisible by the degree)."""
        if self.group is None:
            return Pending(None, t)
        t = t.contiguous()
        out = torch.empty(t.numel() // self.size, dtype=t.dtype, device=t.device)
        return self._issue("reduce_scatter", tag, lambda a: mcrdl.reduce_scatter(
            self.backend_of("reduce_scatter"), out, t, op=mcrdl.ReduceOp.SUM,
            group=self.group, async_op=a), out, async_op)


class GatherSchedule:
    """The order of the Z all_gathers of weights in one forward pass, and the OAG
    prefetch built on it. The first forward records the order; later forwards, with
    prefetch on, issue the gather of entry i+1 as soon as entry i's weight is in hand
    (before entry i computes), so that it travels while entry i computes. Never across
    forward passes: the optimizer changes the shards between steps. Only between
    ``begin_forward`` and ``end_forward`` (GPT4D.forward calls them); a layer used
    outside them gathers its weight directly."""

    def __init__(self, prefetch: bool = False):
        self.prefetch = prefetch
        self.order: list = []
        self.recorded = False
        self.active = False
        self.cursor = 0
        self.pending: dict[int, Pending] = {}
        self._owner: weakref.ref | None = None  # the model whose order is recorded

    def begin_forward(self, owner: object = None) -> None:
        """A forward pass of `owner` (the model) begins: a model other than the one
        recorded records its own order (two models may share the comms)."""
        if owner is not None and (self._owner is None or self._owner() is not owner):
            self._owner = weakref.ref(owner)
            self.order, self.recorded = [], False
        self.cursor = 0
        self.pending.clear()
        self.active = True

    def end_forward(self, completed: bool = True) -> None:
        """The forward pass ended; `completed` False when it raised: then a first pass
        records nothing (its order stopped at the failure), and the next one records."""
        self.active = False
        if completed and self.order:
            self.recorded = True
        elif not self.recorded:
            self.order.clear()
        for p in self.pending.values():  # not consumed (a forward that stopped early)
            p.wait()
        self.pending.clear()

    def weight(self, layer) -> torch.Tensor:
        """`layer`'s gathered weight: the prefetched one, else gathered now. Without
        prefetch nothing depends on the order, so nothing is recorded or checked."""
        if not self.active or not self.prefetch:
            return layer.gather_weight().wait()
        i = self.cursor
        self.cursor += 1
        if not self.recorded:
            self.order.append(layer)
            return layer.gather_weight().wait()
        if i >= len(self.order) or self.order[i] is not layer:
            raise RuntimeError(f"weight gathers out of the recorded order at position {i}: "
                               "the forward pass must call the layers in the same order "
                               "every time")
        pending = self.pending.pop(i, None)
        w = pending.wait() if pending is not None else layer.gather_weight().wait()
        if self.prefetch and i + 1 < len(self.order):
            self.pending[i + 1] = self.order[i + 1].gather_weight(async_op=True)
        return w


@dataclass
class TensorComms:
    """What a tensor-parallel layer communicates over (module docstring). `kernels`
    chooses the matmul operand layouts (None: torch's natural ones)."""

    x: AxisComm
    y: AxisComm
    z: AxisComm
    data: AxisComm
    overlap: Overlap = field(default_factory=Overlap)
    keep_weights: bool = True
    kernels: object | None = None
    recorder: Recorder = field(default_factory=Recorder)
    gathers: GatherSchedule = field(default_factory=GatherSchedule)

    @classmethod
    def single(cls) -> TensorComms:
        """Every axis of degree 1 (a serial model built from the parallel layers)."""
        return cls(*(AxisComm(a, None) for a in ("x", "y", "z", "data")))

    def axis(self, name: str) -> AxisComm:
        return getattr(self, name)

    def coords(self) -> dict[str, int]:
        return {a: self.axis(a).rank for a in ("x", "y", "z", "data")}

    def sizes(self) -> dict[str, int]:
        return {a: self.axis(a).size for a in ("x", "y", "z", "data")}
