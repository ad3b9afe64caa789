"""Per-operation routing of the "mcrdl" torch.distributed backend: which mcrdl backend
each c10d operation goes to.

A route is ``key=backend``; the keys are the c10d operation families below (the names
of torch's ProcessGroup methods: ``allreduce`` covers allreduce and allreduce_coalesced,
``allgather`` every all-gather form, ``alltoall`` both all_to_all and
all_to_all_single...), and ``*`` for every family not named. A family without a route
goes to ``"auto"``, which picks the fastest initialized backend per call from the
tuning table. Sources, the later winning:

1. ``$MCRDL_TORCH_ROUTES``, e.g. ``"allreduce=mpi,alltoall=gloo"``, read when the first
   mcrdl process group is made;
2. :func:`set_routes` (``mcrdl.set_torch_routes``): process-wide, for every later call
   of the groups that have no routes of their own;
3. ``pg_options=mcrdl.TorchBackendOptions(routes=...)`` of ``init_process_group`` or
   ``new_group``: that group's own routes (over 1 and 2 as they are then), fixed for
   its lifetime.

Names are checked against the backends mcrdl knows when routes are set, and against
the initialized ones when a group uses them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from ..backends import registry
from ..errors import BackendUnavailableError, InvalidArgumentError

ROUTES_ENV = "MCRDL_TORCH_ROUTES"
DEFAULT_BACKEND = "auto"
EVERY_OTHER = "*"

# The route keys: c10d operation families, each declared once (process_group.py names
# the ProcessGroup methods of each family in its section headings).
ALLREDUCE = "allreduce"
BROADCAST = "broadcast"
REDUCE = "reduce"
ALLGATHER = "allgather"
GATHER = "gather"
SCATTER = "scatter"
REDUCE_SCATTER = "reduce_scatter"
ALLTOALL = "alltoall"
SEND = "send"
RECV = "recv"
BARRIER = "barrier"
KEYS = (ALLREDUCE, BROADCAST, REDUCE, ALLGATHER, GATHER, SCATTER, REDUCE_SCATTER, ALLTOALL,
        SEND, RECV, BARRIER)

_lock = threading.Lock()
#: The process-wide table (key -> backend), updated in place so that the groups holding
#: it see every change; None until first used.
_process_routes: dict[str, str] | None = None


def parse(routes: str | Mapping[str, str] | None, where: str) -> dict[str, str]:
    """The routes named by `routes` (``"key=backend,..."`` or a mapping; None: none) as a
    dict, checked: keys are families or ``*``, backends are names mcrdl knows."""
    if routes is None:
        return {}
    if isinstance(routes, str):
        pairs = []
        for item in routes.split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, backend = item.partition("=")
            if not sep or not key.strip() or not backend.strip():
                raise InvalidArgumentError(
                    f"{where}: route {item!r} is not 'op=backend' (e.g. "
                    f"'{ALLREDUCE}=mpi,{ALLTOALL}=gloo')")
            pairs.append((key.strip(), backend.strip()))
    elif isinstance(routes, Mapping):
        pairs = list(routes.items())
    else:
        raise InvalidArgumentError(
            f"{where}: routes must be a string 'op=backend,...' or a dict, got "
            f"{type(routes).__name__}")
    known = registry.known_names()
    out: dict[str, str] = {}
    for key, backend in pairs:
        if key not in KEYS and key != EVERY_OTHER:
            raise InvalidArgumentError(
                f"{where}: {key!r} is not a c10d operation family; routes take "
                f"{', '.join(KEYS)} or '{EVERY_OTHER}' (every other)")
        if not isinstance(backend, str) or (backend != DEFAULT_BACKEND and backend not in known):
            raise InvalidArgumentError(
                f"{where}: {key}={backend!r}: unknown mcrdl backend; choose from "
                f"{DEFAULT_BACKEND}, {', '.join(known)}")
        out[key] = backend
    if out.get(SEND, out.get(RECV)) != out.get(RECV, out.get(SEND)):
        raise InvalidArgumentError(
            f"{where}: {SEND}={out[SEND]} and {RECV}={out[RECV]}: a message sent on one "
            f"backend is received only on the same one; route both to one backend (naming "
            f"one of them routes both)")
    return out


def table(routes: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The full table (every key) of `routes` over `base` (a full table, or None: every
    family to "auto")."""
    full = dict(base) if base is not None else dict.fromkeys(KEYS, DEFAULT_BACKEND)
    if EVERY_OTHER in routes:
        full = dict.fromkeys(KEYS, routes[EVERY_OTHER])
    full.update((k, v) for k, v in routes.items() if k != EVERY_OTHER)
    for k, v in routes.items():  # a send and its receive meet only on one backend
        if k in (SEND, RECV):
            full[SEND] = full[RECV] = v
    return full


def process_routes() -> dict[str, str]:
    """The process-wide table, made from ``$MCRDL_TORCH_ROUTES`` on first use."""
    global _process_routes
    with _lock:
        if _process_routes is None:
            _process_routes = table(parse(os.environ.get(ROUTES_ENV), ROUTES_ENV))
        return _process_routes


def set_routes(routes: str | Mapping[str, str] | None,
               initialized: list[str] | None = None) -> dict[str, str]:
    """``mcrdl.set_torch_routes`` (torch_backend.set_routes says what it does), given
    `initialized`: mcrdl's backends when it is initialized (groups may exist, which would
    call them), checked before anything changes. Returns the new table."""
    new = table(parse(routes, "set_torch_routes")) if routes is not None else \
        table(parse(os.environ.get(ROUTES_ENV), ROUTES_ENV))
    if initialized is not None:
        check_initialized(new, initialized, "set_torch_routes")
    current = process_routes()
    with _lock:
        # in one step: a call of another thread reads it without the lock, and `new`
        # has every key
        current.update(new)
    return dict(current)


@dataclass(frozen=True)
class TorchBackendOptions:
    """``pg_options`` of ``init_process_group("mcrdl")`` and ``new_group``: the group's
    own routes (``"allreduce=mpi,..."`` or a dict, over the process-wide ones), fixed
    for its lifetime; checked when made."""

    routes: str | Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "routes", parse(self.routes, "TorchBackendOptions"))


def check_initialized(routes: Mapping[str, str], initialized: list[str], where: str) -> None:
    """Raise BackendUnavailableError when a route names a backend not initialized."""
    missing = sorted({b for b in routes.values() if b != DEFAULT_BACKEND and b not in initialized})
    if missing:
        used = ", ".join(f"{k}={v}" for k, v in routes.items() if v in missing)
        raise BackendUnavailableError(
            f"{where}: routes {used} name backend(s) {', '.join(missing)}, which mcrdl did not "
            f"initialize in this process (initialized: {', '.join(initialized) or 'none'}); "
            f"change the routes or initialize them with mcrdl.init([...]) before "
            f"init_process_group")


def describe(routes: Mapping[str, str]) -> str:
    """One line for the log: the pinned families, then the rest."""
    parts = [f"{k}->{v}" for k, v in routes.items() if v != DEFAULT_BACKEND]
    if len(parts) < len(KEYS):
        parts.append(f"{'every other op' if parts else 'every op'}->{DEFAULT_BACKEND}")
    return ", ".join(parts)
