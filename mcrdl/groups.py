"""Process groups: a set of world ranks usable with every initialized backend."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidArgumentError


class Group:
    """A group of world ranks, created collectively by :func:`mcrdl.new_group`.

    ``ranks`` is the tuple of world ranks in group order (group rank i is ``ranks[i]``),
    ``size`` its length and ``rank`` this process's group rank, -1 if not a member.
    """

    __slots__ = ("ranks", "size", "rank", "id")

    def __init__(self, ranks: Sequence[int], world_rank: int, group_id: int):
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(world_rank) if world_rank in self.ranks else -1
        self.id = group_id

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    def __repr__(self) -> str:
        return f"Group(id={self.id}, ranks={list(self.ranks)}, rank={self.rank})"

    def describe(self) -> str:
        """Short text naming the group in errors and logs."""
        return "world" if self.id == 0 else f"{self.id} {list(self.ranks)}"


def check_ranks(ranks: object, world_size: int) -> tuple[int, ...]:
    """Validate the argument of new_group; returns the ranks as a tuple of ints."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence | range):
        raise InvalidArgumentError(
            f"new_group: 'ranks' must be a sequence of world ranks, got {type(ranks).__name__}"
        )
    out = []
    for i, r in enumerate(ranks):
        if isinstance(r, bool) or not hasattr(r, "__index__"):
            raise InvalidArgumentError(
                f"new_group: 'ranks'[{i}] is {r!r}; expected an int world rank"
            )
        r = int(r)
        if not 0 <= r < world_size:
            raise InvalidArgumentError(
                f"new_group: 'ranks'[{i}] is {r}; expected a world rank in [0, {world_size - 1}]"
            )
        out.append(r)
    if not out:
        raise InvalidArgumentError("new_group: 'ranks' is empty; a group needs at least one rank")
    if len(set(out)) != len(out):
        dup = sorted({r for r in out if out.count(r) > 1})
        raise InvalidArgumentError(f"new_group: 'ranks' {out} repeats rank(s) {dup}")
    return tuple(out)


def bad_group_error(group: object) -> InvalidArgumentError:
    """The error for a `group` argument a backend has no communicator for."""
    if isinstance(group, Group) and not group.is_member:
        return InvalidArgumentError(
            f"'group' {list(group.ranks)} does not contain this process (world rank not in it); "
            "only its members may call operations on it"
        )
    if isinstance(group, Group):
        return InvalidArgumentError(
            f"'group' {group!r} was not created by mcrdl.new_group in this session "
            "(was mcrdl finalized since?)"
        )
    return InvalidArgumentError(
        f"'group' must be a mcrdl Group from mcrdl.new_group() or None, got {type(group).__name__}"
    )
