"""The operations of API.md: resolve the backend, then call it.

Argument validation runs before anything is sent: the built-in backends do it in C++
(``mcrdl._C.validate`` / ``MpiComm``); third-party backends that do not validate get a
validating wrapper (:class:`_Validated`). The hot path here is one dict lookup.

"auto" (until the tuning suite lands) resolves by a fixed rule: for GPU tensors
"nccl"/"rccl" when initialized; for the others "mpi" when initialized, else "gloo",
else the first initialized backend.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence

from .backends import registry
from .backends.base import Backend, InitContext
from .bootstrap import Bootstrap
from .debug import Debugged
from .errors import BackendUnavailableError, DesyncError, InvalidArgumentError
from .fusion import chain as _extension_chain
from .fusion.stream import ExtContext
from .groups import Group, bad_group_error, check_ranks
from .launch import LaunchInfo, detect
from .ops import CALL_BYTES, ReduceOp, to_reduce_op
from .validate import OPERATIONS as VALIDATED_OPS
from .validate import validate_call

log = logging.getLogger("mcrdl")
if os.environ.get("MCRDL_LOG_LEVEL"):
    log.setLevel(os.environ["MCRDL_LOG_LEVEL"].upper())

#: The fixed rule behind "auto" until tuning tables exist, in order of preference.
AUTO_PREFERENCE = ("mpi", "gloo")
AUTO_GPU_PREFERENCE = ("nccl", "rccl")

SUM = ReduceOp.SUM


def debug_enabled() -> bool:
    """MCRDL_DEBUG=1: cross-rank agreement check before every collective (mcrdl.debug)."""
    return os.environ.get("MCRDL_DEBUG", "0") not in ("", "0", "false", "False")


class _State:
    def __init__(self) -> None:
        self.launch: LaunchInfo | None = None
        self.bootstrap: Bootstrap | None = None
        self.timeout = 300.0
        self.tuning_table: str | None = None
        self.backends: dict[str, Backend] = {}  # initialized, in init order
        self.groups: list[Group] = []  # every group, world first
        self.world: Group | None = None
        self.session = 0  # bumped by finalize: groups of an earlier session are refused
        self.auto_table = None  # the tuning table "auto" routes by (None: fixed rule)


_state = _State()
#: name -> backend object for every initialized backend, plus "auto". The hot path.
_active: dict[str, Backend] = {}


def _unavailable(name: object) -> Backend:
    if not _state.backends:
        raise BackendUnavailableError(
            f"mcrdl is not initialized (backend {name!r} requested): call mcrdl.init() first"
        )
    raise BackendUnavailableError(registry.describe_unavailable(
        name, _state.launch, tuple(_state.backends)))


def _backend(name: object) -> Backend:
    try:
        return _active[name]
    except (KeyError, TypeError):
        return _unavailable(name)


def _names(backends: object, where: str) -> list:
    """A backend name or a sequence of names, as a list."""
    if isinstance(backends, str):
        return [backends]
    if isinstance(backends, (list, tuple)):
        return list(backends)
    raise BackendUnavailableError(
        f"{where}: 'backends' must be a backend name or a list of names, got {backends!r}; "
        f"usable here: {', '.join(available_backends())}")


def _op(op: object) -> ReduceOp:
    return op if op.__class__ is ReduceOp else to_reduce_op(op)


# -- lifecycle -------------------------------------------------------------------------

def init(backends: str | Sequence[str] | None = None, *, timeout: float | None = None,
         tuning_table: str | None = None) -> None:
    """Initialize mcrdl and the given backends (collective over the world).

    ``backends``: None (every backend usable here), a name, or a list of names; calling
    init again with more backends adds them. ``timeout`` (seconds) bounds every wait;
    default ``$MCRDL_TIMEOUT`` or 300. ``tuning_table`` (or ``$MCRDL_TUNING_TABLE``) is
    recorded for "auto"; until tuning tables are supported "auto" uses AUTO_PREFERENCE.
    """
    if timeout is None:
        timeout = float(os.environ.get("MCRDL_TIMEOUT", _state.timeout))
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 \
            or timeout == float("inf"):
        raise InvalidArgumentError(f"init: 'timeout' is {timeout!r}; expected seconds > 0")
    launch = _state.launch or detect()
    avail = registry.availability(launch)
    names = None if backends is None else _names(backends, "init")
    if names is None or names == ["auto"]:  # every backend usable here
        names = [n for n, why in avail.items() if why is None]
    for n in names:
        if n == "auto":
            continue
        if not isinstance(n, str) or n not in avail or avail[n] is not None:
            raise BackendUnavailableError(
                registry.describe_unavailable(n, launch, tuple(_state.backends)))
    names = [n for n in dict.fromkeys(names) if n != "auto"]

    if _state.bootstrap is None:
        _state.launch = launch
        _state.bootstrap = Bootstrap(launch, timeout)
        _state.world = Group(range(_state.bootstrap.size), _state.bootstrap.rank, 0)
        _state.groups = [_state.world]
    _state.timeout = float(timeout)
    _state.tuning_table = tuning_table or os.environ.get("MCRDL_TUNING_TABLE")
    views = _state.bootstrap.allgather_obj(names)
    if any(v != names for v in views):
        raise DesyncError("init: ranks asked for different backends:\n" + "\n".join(
            f"  rank {r}: {v}" for r, v in enumerate(views)))

    for b in _state.backends.values():
        b.set_timeout(_state.timeout)
    for n in names:
        if n in _state.backends:
            continue
        cls = registry.backend_class(n)
        ctx = InitContext(_state.bootstrap, _state.timeout, _state.world)
        backend = cls(ctx)
        if not cls.validates_arguments:
            backend = _Validated(backend)
        if debug_enabled():
            backend = Debugged(backend, _state.bootstrap, _state.world, lambda: _state.timeout,
                                group_size_rank)
        for g in _state.groups[1:]:
            backend.add_group(g)
        _state.backends[n] = backend
        _active[n] = backend
    _resolve_auto()
    _install_extensions()
    log.info("mcrdl: initialized %s on rank %d of %d", list(_state.backends),
             _state.world.rank, _state.world.size)


def _resolve_auto() -> None:
    _state.auto_table = _load_tuning_table()
    _build_auto(_state.backends)


def _build_auto(backends: dict) -> None:
    """Set _active["auto"] over `backends` (the backends, or their extension chains)."""
    def first(names):
        return next((backends[n] for n in names if n in backends), None)

    cpu = first(AUTO_PREFERENCE)
    gpu = first(AUTO_GPU_PREFERENCE)
    if cpu is not None and gpu is not None:
        fixed = _AutoByDevice(cpu, gpu)
    elif cpu or gpu or backends:
        fixed = cpu or gpu or next(iter(backends.values()))
    else:
        _active.pop("auto", None)
        return
    table = _state.auto_table
    _active["auto"] = fixed if table is None else _AutoByTable(table, backends, fixed)


def _install_extensions() -> None:
    """Route every name through the extension chain of mcrdl.fusion when an extension is
    on (mcrdl.configure / mcrdl.extensions), else straight to the backends: with none on
    the hot path is exactly the same."""
    ext = ExtContext(_state.world.rank, _state.world.size, lambda: _state.timeout,
                     group_size_rank)
    chained = _extension_chain.wrap(_state.backends, ext)
    _active.update(chained)
    _build_auto(chained)


def _load_tuning_table():
    """The table "auto" routes by: init(tuning_table=...), $MCRDL_TUNING_TABLE, or the
    shipped table matching this system; None (fixed rule) when there is none."""
    from .tuning.table import TuningTable, current_provenance, find_shipped_table

    current = current_provenance()
    path = _state.tuning_table
    if path is None:
        shipped = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tuning_tables")
        path = find_shipped_table(shipped, current) if os.path.isdir(shipped) else None
        if path is None:
            return None
    table = TuningTable.load(path)
    stale = table.stale_reasons(current)
    if stale:
        warnings.warn(f"mcrdl: tuning table {path} was measured with other libraries than "
                      f"these ({'; '.join(stale)}); \"auto\" may pick slower backends. "
                      "Re-run mcrdl-tune.", stacklevel=3)
    log.info("mcrdl: \"auto\" routes by tuning table %s", path)
    return table




_ROUTES_MAX = 4096  # distinct (group size, bytes) per op kept by "auto" before starting over


class _AutoByTable:
    """"auto" with a tuning table: each call goes to the backend the table predicts
    fastest for (op, group size, bytes) among the initialized ones; calls the table
    cannot place (no data, bad arguments) take the fixed rule, whose backend then
    validates them. Lookups are cached in the table (microseconds)."""

    def __init__(self, table, backends: dict, fixed):
        self._table, self._backends, self._fixed = table, backends, fixed
        self._names = tuple(backends)
        self.name = "auto"

    def __getattr__(self, op):
        if op not in CALL_BYTES:
            return getattr(self._fixed, op)
        table, backends, names, fixed = self._table, self._backends, self._names, self._fixed
        nbytes_of = CALL_BYTES[op]

        routes = {}  # (group size, bytes) -> the chosen backend's bound op: one dict hit
        world_size = _state.world.size

        def call(*args):
            group = args[-2]
            try:
                gsize = world_size if group is None else group.size
                key = (gsize, nbytes_of(args, gsize))
            except (AttributeError, TypeError):  # malformed arguments: let a backend say so
                return getattr(fixed, op)(*args)
            fn = routes.get(key)
            if fn is None:
                name = table.lookup(op, gsize, key[1], names)
                fn = getattr(backends[name] if name else fixed, op)
                if len(routes) >= _ROUTES_MAX:
                    routes.clear()
                routes[key] = fn
            return fn(*args)

        self.__dict__[op] = call  # built once: later calls skip __getattr__
        return call

    def synchronize(self, timeout: float) -> None:
        for b in self._backends.values():
            b.synchronize(timeout)


class _AutoByDevice:
    """"auto" when CPU and GPU backends are both initialized: an op whose first tensor
    is on a GPU goes to the GPU backend, any other to the CPU backend."""

    def __init__(self, cpu: Backend, gpu: Backend):
        self._cpu, self._gpu = cpu, gpu
        self.name = "auto"

    def __getattr__(self, op):
        cpu, gpu = self._cpu, self._gpu

        def call(*args):
            return getattr(gpu if _first_tensor_on_gpu(args) else cpu, op)(*args)

        self.__dict__[op] = call  # built once: later calls skip __getattr__
        return call

    def synchronize(self, timeout: float) -> None:
        self._cpu.synchronize(timeout)
        self._gpu.synchronize(timeout)


def _first_tensor_on_gpu(args) -> bool:
    for a in args:
        if isinstance(a, (list, tuple)) and a:
            a = a[0]
        if hasattr(a, "is_cuda"):
            return a.is_cuda
    return False


def finalize() -> None:
    """Tear down every backend (outstanding ops are abandoned) and the bootstrap.
    Calls the extension chain still holds (fusion buffers) are posted first."""
    if _state.backends:
        _extension_chain.shutdown(_state.timeout)
    for b in reversed(list(_state.backends.values())):
        b.finalize()
    _active.clear()
    _state.backends.clear()
    if _state.bootstrap is not None:
        _state.bootstrap.close()
    session = _state.session + 1
    _state.__init__()
    _state.session = session


def is_initialized() -> bool:
    return bool(_state.backends)


def available_backends() -> list[str]:
    """Backends usable in this process (before or after init)."""
    launch = _state.launch or detect()
    return [n for n, why in registry.availability(launch).items() if why is None]


def get_backends() -> list[str]:
    """Initialized backends, in init order."""
    return list(_state.backends)


def _check_query(backend: object, group: Group | None) -> None:
    if backend != "auto":
        _backend(backend)
    elif not _state.backends:
        _unavailable(backend)
    if group is not None and not isinstance(group, Group):
        raise InvalidArgumentError(
            f"'group' must be a mcrdl Group or None, got {type(group).__name__}")


def get_rank(backend: str = "auto", group: Group | None = None) -> int:
    """This process's rank in `group` (world when None); -1 if not a member."""
    _check_query(backend, group)
    return _state.world.rank if group is None else group.rank


def get_size(backend: str = "auto", group: Group | None = None) -> int:
    """Number of ranks in `group` (world when None)."""
    _check_query(backend, group)
    return _state.world.size if group is None else group.size


get_world_size = get_size


def new_group(ranks: Sequence[int]) -> Group:
    """Create a group of world ranks (collective over the world: every rank calls it,
    in the same order, with the same ranks). Group rank i is ``ranks[i]``."""
    if not _state.backends:
        _unavailable("auto")
    ranks = check_ranks(ranks, _state.world.size)
    views = _state.bootstrap.allgather_obj(ranks)
    if any(v != ranks for v in views):
        raise DesyncError("new_group: ranks passed different member lists:\n" + "\n".join(
            f"  rank {r}: {list(v)}" for r, v in enumerate(views)))
    group = Group(ranks, _state.world.rank, _state.session * 1_000_000 + len(_state.groups))
    for b in _state.backends.values():
        b.add_group(group)
    _state.groups.append(group)
    return group


def synchronize(backends: str | Sequence[str] | None = None) -> None:
    """Wait for every outstanding op of the given backends (all when None), including
    calls held by extensions (fused calls are flushed and their results copied back)."""
    if backends is None:
        targets = [_active[n] for n in _state.backends]
    else:
        targets = list(dict.fromkeys(_backend(n) for n in _names(backends, "synchronize")))
    for b in targets:
        b.synchronize(_state.timeout)


# -- operations --------------------------------------------------------------------------

def all_reduce(backend, tensor, op=SUM, group=None, async_op=False):
    """Reduce `tensor` across the group, in place on every rank."""
    return _backend(backend).all_reduce(tensor, _op(op), group, async_op)


def reduce(backend, tensor, dst=0, op=SUM, group=None, async_op=False):
    """Reduce `tensor` to group rank `dst`; other ranks' tensors are unchanged."""
    return _backend(backend).reduce(tensor, dst, _op(op), group, async_op)


def bcast(backend, tensor, src=0, group=None, async_op=False):
    """Broadcast `tensor` from group rank `src` to every rank."""
    return _backend(backend).bcast(tensor, src, group, async_op)


broadcast = bcast


def all_gather(backend, output, input, group=None, async_op=False):
    """Gather every rank's `input` into `output` (one tensor of size blocks, or a list)."""
    return _backend(backend).all_gather(output, input, group, async_op)


def gather(backend, output, input, dst=0, group=None, async_op=False):
    """Gather every rank's `input` into `output` on group rank `dst` (None elsewhere)."""
    return _backend(backend).gather(output, input, dst, group, async_op)


def scatter(backend, output, input, src=0, group=None, async_op=False):
    """Scatter block i of `input` (on group rank `src`) into `output` of rank i."""
    return _backend(backend).scatter(output, input, src, group, async_op)


def reduce_scatter(backend, output, input, op=SUM, group=None, async_op=False):
    """Reduce `input` (size blocks) across ranks; rank i gets block i in `output`."""
    return _backend(backend).reduce_scatter(output, input, _op(op), group, async_op)


def all_to_all_single(backend, output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """Exchange rows (dim 0) of `input`: split i goes to rank i; equal splits when None."""
    return _backend(backend).all_to_all_single(output, input, output_split_sizes,
                                               input_split_sizes, group, async_op)


def all_to_all(backend, output_list, input_list, group=None, async_op=False):
    """Send input_list[i] to rank i, receive output_list[i] from rank i."""
    return _backend(backend).all_to_all(output_list, input_list, group, async_op)


def gatherv(backend, output, input, counts, displs=None, dst=0, group=None, async_op=False):
    """Gather `counts[i]` elements from rank i at element `displs[i]` of `output` on `dst`."""
    return _backend(backend).gatherv(output, input, counts, displs, dst, group, async_op)


def scatterv(backend, output, input, counts, displs=None, src=0, group=None, async_op=False):
    """Scatter `counts[i]` elements at element `displs[i]` of `input` (on `src`) to rank i."""
    return _backend(backend).scatterv(output, input, counts, displs, src, group, async_op)


def all_gatherv(backend, output, input, counts, displs=None, group=None, async_op=False):
    """All-gather variable blocks: rank i's `input` lands at element `displs[i]`."""
    return _backend(backend).all_gatherv(output, input, counts, displs, group, async_op)


def all_to_allv(backend, output, input, send_counts, recv_counts, send_displs=None,
                recv_displs=None, group=None, async_op=False):
    """All-to-all with element counts/displacements per rank (flattened tensors)."""
    return _backend(backend).all_to_allv(output, input, send_counts, recv_counts, send_displs,
                                         recv_displs, group, async_op)


def send(backend, tensor, dst, tag=0, group=None, async_op=False):
    """Send `tensor` to group rank `dst` with `tag` (0..32767)."""
    return _backend(backend).send(tensor, dst, tag, group, async_op)


def recv(backend, tensor, src, tag=0, group=None, async_op=False):
    """Receive into `tensor` from group rank `src` with `tag`."""
    return _backend(backend).recv(tensor, src, tag, group, async_op)


def barrier(backend, group=None, async_op=False):
    """Block until every rank of the group reached the barrier."""
    return _backend(backend).barrier(group, async_op)


# -- argument validation for third-party backends ----------------------------------------

def group_size_rank(group: object) -> tuple[int, int]:
    """(size, rank) of `group` (world when None); raises for non-members and non-groups."""
    if group is None:
        return _state.world.size, _state.world.rank
    if not isinstance(group, Group) or not group.is_member:
        raise bad_group_error(group)
    return group.size, group.rank


class _Validated:
    """Wraps a backend that does not validate: runs mcrdl's checks, then delegates."""

    def __init__(self, inner: Backend):
        self._inner = inner
        self.name = inner.name

    def __getattr__(self, attr):
        if attr not in VALIDATED_OPS:
            return getattr(self._inner, attr)
        method = getattr(self._inner, attr)

        def call(*args):
            *rest, group, async_op = args
            size, rank = group_size_rank(group)
            return method(*validate_call(attr, tuple(rest), size, rank), group, async_op)

        self.__dict__[attr] = call  # built once: later calls skip __getattr__
        return call
