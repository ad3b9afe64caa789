"""Process grids: named parallel axes mapped onto ranks, one mcrdl group per grid line.

    grid = ProcessGrid({Axis.DATA: 2, Axis.PIPE: 4})          # 8 ranks
    grid.coord(Axis.PIPE), grid.size(Axis.PIPE), grid.group(Axis.DATA)

Axes are the members of ``Axis``; their values ("pipe", "data") are accepted wherever an
axis is, so a grid order read from the command line names them. The options that set
an axis's degree (``--G-inter`` for PIPE) declare it (``option(..., axis=Axis.PIPE)``
in training/pipeline/options.py).

``order`` lists the axes from the fastest-varying (consecutive ranks, e.g. the
ranks of one node) to the slowest; by default the order of ``sizes``. With
``{DATA: 2, PIPE: 4}`` ranks 0 and 1 form a data-parallel pair and ranks 0, 2, 4, 6
a pipeline. Groups are created collectively on every rank in one fixed order, so the
grid must be built by every rank of the world with the same arguments.

A grid may span a ``world`` group instead of the whole world: its ranks are then the
group's ranks (grid rank i is world rank ``world.ranks[i]``), so that several runs can
train side by side in one launch, each on its own ranks (the tests batch their grids
so: every process pays ~2 s to import torch). Creating groups stays collective over
the whole world: every rank builds every grid and calls ``make_groups`` on each in the
same order, and a rank outside `world` gets no groups from it. ``group_cache`` (one
dict shared by grids built in the same order on every rank) reuses the group of a line
of world ranks that another grid already made: every group keeps lane threads alive,
and their idle wake-ups slow a 2-core machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import Enum

import mcrdl
from mcrdl.launch import launch_command


class Axis(str, Enum):
    """A parallel dimension of the process grid; its value is its name in options."""

    X = "x"          # 4D tensor parallelism: a Linear's out-features (in-features in a T-layer)
    Y = "y"          # 4D tensor parallelism: a Linear's in-features (out-features in a T-layer)
    Z = "z"          # 4D tensor parallelism: weight shards and token shards (FSDP-like)
    PIPE = "pipe"    # pipeline stages (inter-layer parallelism)
    DATA = "data"    # data-parallel replicas (in TED: of the expert parameters, data_exp)
    TENSOR = "tensor"  # Megatron tensor parallelism (TED's tensor groups)
    EXPERT = "expert"  # expert parallelism: experts spread over it, tokens all-to-all'd

    def __str__(self) -> str:
        return self.value


class GridError(ValueError):
    """A process grid that does not fit the world."""


#: Axes whose lines get a second group each (ProcessGrid.twin_group): the pipeline's,
#: whose forward and backward messages go on groups of their own (training/pipeline/engine.py).
TWINNED = (Axis.PIPE,)


def to_axis(name: Axis | str) -> Axis:
    """`name` as an Axis; GridError naming the known axes for anything else."""
    try:
        return Axis(name)
    except ValueError:
        raise GridError(f"unknown axis {name!r}; expected one of "
                        f"{', '.join(a.value for a in Axis)}") from None


def _names(axes) -> str:
    return "[" + ", ".join(str(a) for a in axes) + "]"


class ProcessGrid:
    """Ranks laid out on named axes (see the module docstring); `sizes` maps each axis
    to its degree, whose product must be the world size."""

    def __init__(self, sizes: Mapping[Axis | str, int],
                 order: Sequence[Axis | str] | None = None, *,
                 world: mcrdl.Group | None = None,
                 world_size: int | None = None, rank: int | None = None,
                 group_cache: dict[tuple[int, ...], mcrdl.Group] | None = None):
        sizes = {to_axis(a): n for a, n in sizes.items()}
        for axis, n in sizes.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise GridError(f"process grid: axis '{axis}' has degree {n!r}; "
                                "expected a positive integer")
        order = list(sizes) if order is None else [to_axis(a) for a in order]
        if sorted(order) != sorted(sizes):
            raise GridError(f"process grid: order {_names(order)} must list each axis of "
                            f"{_names(sizes)} exactly once")
        self.world = world  # None: the whole mcrdl world
        if world is not None:
            world_size, rank = world.size, world.rank  # rank -1: not a member
        self.world_size = mcrdl.get_size() if world_size is None else world_size
        self.rank = mcrdl.get_rank() if rank is None else rank
        total = math.prod(sizes.values())
        if total != self.world_size:
            shown = " x ".join(f"{a}={n}" for a, n in sizes.items())
            where = "the world has" if world is None else f"its group {list(world.ranks)} has"
            raise GridError(f"process grid {shown} needs {total} ranks but {where} "
                            f"{self.world_size}; launch with {launch_command(total)} or change "
                            f"the degrees so that their product is {self.world_size}")
        self.sizes = sizes
        self.order = order
        self._stride = {}
        s = 1
        for a in order:
            self._stride[a] = s
            s *= sizes[a]
        self._groups: dict[Axis, mcrdl.Group | None] = {}
        self._cache = group_cache
        self._made_groups = False
        self._planes: dict[tuple[Axis, ...], mcrdl.Group | None] = {}
        self._twins: dict[Axis, mcrdl.Group | None] = {}

    # --- coordinates -------------------------------------------------------------------
    def coords_of(self, rank: int) -> dict[Axis, int]:
        return {a: (rank // self._stride[a]) % self.sizes[a] for a in self.sizes}

    def rank_of(self, **coords: int) -> int:
        """The rank at `coords` (one keyword per axis value: ``pipe=1, data=0``)."""
        coords = {to_axis(a): c for a, c in coords.items()}
        if sorted(coords) != sorted(self.sizes):
            raise GridError(f"rank_of: give a coordinate for each axis of {_names(self.sizes)}")
        for a, c in coords.items():
            if not 0 <= c < self.sizes[a]:
                raise GridError(f"rank_of: {a}={c} outside 0..{self.sizes[a] - 1}")
        return self._rank_at(coords)

    def _rank_at(self, coords: Mapping[Axis, int]) -> int:
        return sum(c * self._stride[a] for a, c in coords.items())

    @property
    def is_member(self) -> bool:
        """Whether this process is one of the grid's ranks (always, without a `world`)."""
        return self.rank >= 0

    def coord(self, axis: Axis | str) -> int:
        """This rank's coordinate along `axis`."""
        self._check_member()
        return self.coords_of(self.rank)[self._axis(axis)]

    def _check_member(self) -> None:
        if not self.is_member:
            raise GridError(f"this process is not in the grid's group of world ranks "
                            f"{list(self.world.ranks)}; only its members train on it")

    def size(self, axis: Axis | str) -> int:
        """The degree of `axis`."""
        return self.sizes[self._axis(axis)]

    def line(self, axis: Axis | str, rank: int | None = None) -> list[int]:
        """Ranks that differ from `rank` (default: this one) only along `axis`, in axis order."""
        axis = self._axis(axis)
        if rank is None:
            self._check_member()
        c = self.coords_of(self.rank if rank is None else rank)
        out = []
        for i in range(self.size(axis)):
            c[axis] = i
            out.append(self._rank_at(c))
        return out

    def _axis(self, axis: Axis | str) -> Axis:
        axis = to_axis(axis)
        if axis not in self.sizes:
            raise GridError(f"axis '{axis}' is not in this grid; it has {_names(self.sizes)}")
        return axis

    # --- groups ------------------------------------------------------------------------
    def make_groups(self) -> None:
        """Create one mcrdl group per line of every axis of degree > 1 (collective over
        the whole world, members of the grid or not)."""
        if self._made_groups:
            return
        world_ranks = self.world.ranks if self.world is not None else range(self.world_size)
        for axis in self.order:
            self._groups[axis] = None
            if self.sizes[axis] == 1:
                continue
            lines = sorted({tuple(self.line(axis, r)) for r in range(self.world_size)})
            mine = tuple(self.line(axis)) if self.is_member else None
            for ln in lines:
                g = self._cached_group(tuple(world_ranks[r] for r in ln))
                if ln == mine:
                    self._groups[axis] = g
            if axis in TWINNED:  # never cached: communicators of their own
                for ln in lines:
                    g = mcrdl.new_group([world_ranks[r] for r in ln])
                    if ln == mine:
                        self._twins[axis] = g
        self._made_groups = True

    def _cached_group(self, ranks: tuple[int, ...]) -> mcrdl.Group:
        """Collective over the world: the group of world ranks `ranks`, from
        ``group_cache`` where a grid made it already (then every rank skips new_group
        alike), else made and cached."""
        g = None if self._cache is None else self._cache.get(ranks)
        if g is None:
            g = mcrdl.new_group(list(ranks))
            if self._cache is not None:
                self._cache[ranks] = g
        return g

    def twin_group(self, axis: Axis | str) -> mcrdl.Group | None:
        """The second group of this rank's line along `axis` (an axis of TWINNED): the
        same ranks on communicators of their own, made with the others by make_groups;
        None when the axis has degree 1."""
        axis = self._axis(axis)
        if axis not in TWINNED:
            raise GridError(f"process grid: axis '{axis}' has no twin groups; only "
                            f"{_names(TWINNED)}")
        self._check_member()
        self.make_groups()
        return self._twins.get(axis)

    def plane_group(self, axes: Sequence[Axis | str]) -> mcrdl.Group | None:
        """This rank's group of the ranks that differ from it only along `axes` (a
        sub-grid: TED's non-expert data group spans the expert and data axes); None
        when it has one rank. Collective over the world: every rank calls it with the
        same axes, in the same order as its other plane_group calls (on a grid over a
        group of ranks, non-members too; they get None)."""
        axes = [self._axis(a) for a in axes]
        key = tuple(sorted(axes))
        if key in self._planes:
            return self._planes[key]
        self.make_groups()

        def plane(rank: int) -> tuple[int, ...]:
            members = [rank]
            for a in axes:
                members = [r2 for r in members for r2 in self.line(a, r)]
            return tuple(sorted(members))

        world_ranks = self.world.ranks if self.world is not None else range(self.world_size)
        planes = sorted({plane(r) for r in range(self.world_size)})
        mine = plane(self.rank) if self.is_member else None
        group = None
        for members in planes:
            if len(members) > 1:
                g = self._cached_group(tuple(world_ranks[r] for r in members))
                if members == mine:
                    group = g
        self._planes[key] = group
        return group

    def group(self, axis: Axis | str) -> mcrdl.Group | None:
        """This rank's group along `axis` (None when the axis has degree 1)."""
        axis = self._axis(axis)
        self._check_member()
        self.make_groups()
        return self._groups[axis]

    def __repr__(self) -> str:
        axes = ", ".join(f"{a}={self.sizes[a]}" for a in self.order)
        if not self.is_member:
            return f"ProcessGrid({axes}; not a member)"
        at = ", ".join(f"{a}={c}" for a, c in self.coords_of(self.rank).items())
        return f"ProcessGrid({axes}; rank {self.rank} at {at})"
