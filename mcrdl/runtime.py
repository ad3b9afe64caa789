"""The runtime object: everything ``mcrdl.init`` builds, in one place.

A :class:`Runtime` holds the launch information, the bootstrap channel (object
collectives, the rendezvous store), the world and every group, the initialized
backends, and the dispatch table the front calls through: backend name (and "auto")
-> the top of that backend's layers (mcrdl.extensions.stack). It is built by the front
(``mcrdl.api``), which keeps the one of this process, and passed down to what needs it:
the layers get it when the stack builds them, backends get an InitContext.

The layers of one backend: ``validate`` (when the backend does not validate) and
``debug`` (MCRDL_DEBUG=1) are made with the backend, once; the extensions above them are
rebuilt by the stack whenever their configuration changes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from . import _C
from .backends import registry
from .backends.base import Backend, InitContext
from .bootstrap import Bootstrap
from .errors import BackendUnavailableError, DesyncError, InvalidArgumentError
from .extensions import auto, stack
from .extensions.debug import Debugged
from .extensions.validation import Validated
from .groups import Group, bad_group_error, check_ranks
from .launch import LaunchInfo

log = logging.getLogger("mcrdl")


def debug_enabled() -> bool:
    """MCRDL_DEBUG=1: cross-rank agreement check before every collective."""
    return os.environ.get("MCRDL_DEBUG", "0") not in ("", "0", "false", "False")


class Runtime:
    """See the module docstring. Created collectively (every rank, same order)."""

    def __init__(self, launch: LaunchInfo, timeout: float, session: int):
        self.launch = launch
        self.timeout = float(timeout)
        self.session = session  # group ids carry it: groups of an earlier init are refused
        self.bootstrap = Bootstrap(launch, self.timeout)
        self.world: Group = self.bootstrap.world
        self.groups: list[Group] = [self.world]
        self.backends: dict[str, Backend] = {}  # the backend objects, in init order
        self.bases: dict[str, object] = {}  # each backend under its validate/debug layers
        self.dispatch: dict[str, object] = {}  # what the front calls: name -> top layer
        self.tuning_table: str | None = None
        self.auto_table = None

    # -- queries -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.size

    def timeout_of(self) -> float:
        return self.timeout

    def size_rank(self, group: object) -> tuple[int, int]:
        """(size, rank) of `group` (the world when None); raises for non-members and
        non-groups."""
        if group is None:
            return self.world.size, self.world.rank
        if not isinstance(group, Group) or not group.is_member:
            raise bad_group_error(group)
        return group.size, group.rank

    def backend(self, name: str) -> Backend | None:
        """The initialized backend object `name` itself (None when not initialized)."""
        return self.backends.get(name)

    # -- set-up ----------------------------------------------------------------------
    def set_timeout(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self.bootstrap.timeout = self.timeout
        for b in self.bases.values():
            b.set_timeout(self.timeout)

    def add_backends(self, names: Sequence[str], tuning_table: str | None) -> None:
        """Construct the backends of `names` not initialized yet (collective: every rank
        passes the same names), then rebuild the dispatch table."""
        views = self.bootstrap.all_gather_object(list(names), purpose="init")
        if any(v != list(names) for v in views):
            raise DesyncError("init: ranks asked for different backends:\n" + "\n".join(
                f"  rank {r}: {v}" for r, v in enumerate(views)))
        # before any backend is made: a refused table leaves the runtime as it was
        table = self._agreed_table(auto.load_table(tuning_table), tuning_table)
        for name in names:
            if name in self.backends:
                continue
            cls = registry.backend_class(name)
            ctx = InitContext(self.bootstrap, self.timeout, self.world, self.backend)
            backend = cls(ctx)
            base = backend if cls.validates_arguments else Validated(backend, self.size_rank)
            if debug_enabled():
                base = Debugged(base, self)
            for g in self.groups[1:]:
                base.add_group(g)
            self.backends[name] = backend
            self.bases[name] = base
        self.tuning_table = tuning_table
        self.auto_table = table
        for backend in self.backends.values():
            backend.use_tuning_table(self.auto_table)
        self.install()

    def _agreed_table(self, table, path: str | None):
        """The table "auto" routes by, the same on every rank (collective): ranks that
        route one call to different backends never meet. Where each rank found a shipped
        table by itself (no path given anywhere) and they differ (per-host tables on a
        multi-node job), rank 0's is used everywhere; tables given by path must agree."""
        digest = None if table is None else table.digest()
        views = self.bootstrap.all_gather_object((path, digest), purpose="the tuning table")
        if all(d == digest for _, d in views):
            return table
        if all(p is None for p, _ in views):
            doc = self.bootstrap.broadcast_object(None if table is None else table.to_dict(),
                                                  purpose="the tuning table")
            if doc is None:
                return None
            from .tuning.table import TuningTable

            return TuningTable.from_dict(doc, source="rank 0's shipped tuning table")
        differ = [r for r, (_, d) in enumerate(views) if d != views[0][1]]
        raise DesyncError(
            f"init: ranks {differ} would route \"auto\" by another tuning table than rank 0 "
            f"(rank 0: {views[0][0] or 'the shipped table'}, rank {differ[0]}: "
            f"{views[differ[0]][0] or 'the shipped table'}, with other contents); give every "
            "rank the same file (init's tuning_table or MCRDL_TUNING_TABLE)")

    def install(self) -> None:
        """(Re)build the dispatch table: the configured extensions over each base, and
        "auto" over them (mcrdl.extensions.stack). The dict is updated in place: the
        front holds it, and caches each entry's methods until this runs again (as the
        extensions bind the methods below them here)."""
        tops = stack.build(self)
        devices = {n: type(b).capabilities.devices for n, b in self.backends.items()}
        router = auto.build(tops, self.auto_table, self.world.size, devices, debug_enabled())
        if router is not None:
            tops["auto"] = router
        self.dispatch.clear()
        self.dispatch.update(tops)
        _C.front_invalidate()  # the front's cached methods (csrc/front.cpp)

    def new_group(self, ranks: Sequence[int]) -> Group:
        """A group of world ranks (collective over the world, same ranks everywhere)."""
        ranks = check_ranks(ranks, self.world.size)
        views = self.bootstrap.all_gather_object(ranks, purpose="new_group")
        if any(v != ranks for v in views):
            raise DesyncError("new_group: ranks passed different member lists:\n" + "\n".join(
                f"  rank {r}: {list(v)}" for r, v in enumerate(views)))
        group = Group(ranks, self.world.rank, self.session * 1_000_000 + len(self.groups))
        self.bootstrap.add_group(group)
        for b in self.bases.values():
            b.add_group(group)
        self.groups.append(group)
        return group

    # -- operations that are not calls of a backend ------------------------------------
    def synchronize(self, names: Sequence[str] | None = None) -> None:
        """Wait for every outstanding op of the backends `names` (all when None),
        including what the extensions hold."""
        targets = list(self.backends) if names is None else names
        for t in dict.fromkeys(self.dispatch[n] for n in targets):
            t.synchronize(self.timeout)

    def all_gather_object(self, obj: object, group: Group | None = None) -> list:
        return self.bootstrap.all_gather_object(obj, group)

    def broadcast_object(self, obj: object, src: int = 0, group: Group | None = None) -> object:
        return self.bootstrap.broadcast_object(obj, src, group)

    def finalize(self) -> None:
        """Post what the extensions hold, tear every backend down, close the bootstrap."""
        stack.retire(self)
        # each backend drains its ops in flight for up to the timeout: a rank may reach
        # the bootstrap's closing barrier that much later than another
        grace = len(self.bases) * self.timeout
        for b in reversed(list(self.bases.values())):
            b.finalize()
        self.dispatch.clear()
        _C.front_invalidate()
        self.bases.clear()
        self.backends.clear()
        self.bootstrap.close(grace)


def check_timeout(timeout: object, where: str) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 \
            or timeout == float("inf"):
        raise InvalidArgumentError(f"{where}: 'timeout' is {timeout!r}; expected seconds > 0")
    return float(timeout)


def unavailable(name: object, runtime: Runtime | None,
                launch: LaunchInfo) -> BackendUnavailableError:
    """The error for backend `name` the front cannot call."""
    if runtime is None or not runtime.backends:
        return BackendUnavailableError(
            f"mcrdl is not initialized (backend {name!r} requested): call mcrdl.init() first")
    return BackendUnavailableError(
        registry.describe_unavailable(name, launch, tuple(runtime.backends)))
