"""The front: the public functions of mcrdl (docs/api.md), over one Runtime per process.

``init`` builds the :class:`~mcrdl.runtime.Runtime`; every operation then resolves the
backend name in the runtime's dispatch table (one dict lookup) and calls the top of that
backend's layers (mcrdl.extensions.stack), which validate, log, fuse, compress or check
the call on the way to the backend. The operation functions are made from their specs
in :data:`mcrdl.ops.OPS`, so their parameters, defaults and docstrings are the specs'.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence

from . import _C
from .backends import registry
from .errors import BackendUnavailableError, InvalidArgumentError, UnsupportedOperationError
from .groups import Group
from .launch import LaunchInfo, detect
from .ops import ALIASES, OPS, REQUIRED, Kind, OpSpec, ReduceOp, to_reduce_op
from .runtime import Runtime, check_timeout, unavailable

log = logging.getLogger("mcrdl")


def _log_level(value: str) -> None:
    """MCRDL_LOG_LEVEL: a level name (debug, info, ...) or number; a bad value warns and
    is ignored (it must not make ``import mcrdl`` fail)."""
    try:
        log.setLevel(int(value) if value.strip().isdigit() else value.strip().upper())
    except (ValueError, TypeError):
        import warnings

        warnings.warn(f"mcrdl: MCRDL_LOG_LEVEL={value!r} is not a logging level (debug, info, "
                      "warning, error, critical or a number); ignored", stacklevel=3)


if os.environ.get("MCRDL_LOG_LEVEL"):
    _log_level(os.environ["MCRDL_LOG_LEVEL"])

DEFAULT_TIMEOUT = 300.0

_runtime: Runtime | None = None
_sessions = 0  # runtimes made so far: a group of an earlier one is refused
#: The runtime's dispatch table (backend name and "auto" -> the top of its layers): the
#: hot path is one lookup here. Empty before init and after finalize.
_dispatch: dict = {}


_hook_installed = False
_job_end: _JobEnd | None = None  # set once an uncaught exception ends the job


def _launch() -> LaunchInfo:
    return _runtime.launch if _runtime is not None else detect()


def _unavailable(name: object):
    raise unavailable(name, _runtime, _launch())


def _alternatives(exc: UnsupportedOperationError) -> UnsupportedOperationError:
    """`exc` with the backends that do have the operation named."""
    if exc.backend is None or exc.alternatives is not None:
        return exc
    others = [b for b in registry.backends_supporting(exc.op) if b != exc.backend]
    usable = set(available_backends())
    return UnsupportedOperationError(exc.op, exc.backend, [b for b in others if b in usable],
                                     [b for b in others if b not in usable])


def _async_flag(value: object, op: str) -> bool:
    """`async_op` as a bool: True, False, or an integer or numpy bool of 0 or 1. Anything
    else (a string is truthy: "no" would have meant async) is refused."""
    import numpy as np

    if isinstance(value, (int, np.integer, np.bool_)) and value in (0, 1):
        return bool(value)
    raise InvalidArgumentError(f"{op}: 'async_op' must be True or False, got {value!r}")


def _names(backends: object, where: str) -> list:
    """A backend name or a sequence of names, as a list."""
    if isinstance(backends, str):
        return [backends]
    if isinstance(backends, (list, tuple)):
        return list(backends)
    raise BackendUnavailableError(
        f"{where}: 'backends' must be a backend name or a list of names, got {backends!r}; "
        f"usable here: {', '.join(available_backends())}")


# -- lifecycle -------------------------------------------------------------------------

def _env_timeout(value: object) -> object:
    """$MCRDL_TIMEOUT as a number (check_timeout then says what is wrong with it)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"MCRDL_TIMEOUT={value!r}: expected seconds > 0, e.g. "
                                   "MCRDL_TIMEOUT=300") from None


def init(backends: str | Sequence[str] | None = None, *, timeout: float | None = None,
         tuning_table: str | None = None) -> None:
    """Initialize mcrdl and the given backends (collective over the world).

    ``backends``: None (every backend usable here), a name, or a list of names; calling
    init again with more backends adds them. ``timeout`` (seconds) bounds every wait;
    default ``$MCRDL_TIMEOUT`` or 300. ``tuning_table`` (or ``$MCRDL_TUNING_TABLE``) is
    the table "auto" routes by; without one the table shipped for this system, if any.
    """
    global _runtime, _dispatch, _sessions
    if timeout is None:  # a later init keeps the timeout in force
        timeout = (_runtime.timeout if _runtime is not None
                   else _env_timeout(os.environ.get("MCRDL_TIMEOUT", DEFAULT_TIMEOUT)))
    timeout = check_timeout(timeout, "init")
    if tuning_table is None:  # a later init keeps the table in force
        tuning_table = (_runtime.tuning_table if _runtime is not None and _runtime.backends
                        else None) or os.environ.get("MCRDL_TUNING_TABLE")
    launch = _launch()
    avail = registry.availability(launch)
    names = None if backends is None else _names(backends, "init")
    if names is None or names == ["auto"]:  # every backend usable here
        names = [n for n, why in avail.items() if why is None]
    initialized = tuple(_runtime.backends) if _runtime is not None else ()
    for n in names:
        if n == "auto":
            continue
        if not isinstance(n, str) or n not in avail or avail[n] is not None:
            raise BackendUnavailableError(registry.describe_unavailable(n, launch, initialized))
    names = [n for n in dict.fromkeys(names) if n != "auto"]

    if _runtime is None:
        _runtime = Runtime(launch, timeout, _sessions)
        _sessions += 1
        _dispatch = _runtime.dispatch
    _runtime.set_timeout(timeout)
    _runtime.add_backends(names, tuning_table)
    _end_job_on_uncaught_exception()
    log.info("mcrdl: initialized %s on rank %d of %d", list(_runtime.backends),
             _runtime.world.rank, _runtime.world.size)


def _end_job_on_uncaught_exception() -> None:
    """Chain a sys.excepthook that ends the job when an exception nobody caught ends this
    rank's program while mcrdl is initialized in a world of several ranks: the other
    ranks may be waiting for this one (in a collective, or in finalize's barrier) and
    would otherwise wait out the timeout (MPI_Abort in an MPI world, else a non-zero
    exit, which torchrun and srun --kill-on-bad-exit take as the job's end; what
    `python -m mpi4py` does). MCRDL_ABORT_ON_ERROR=0 keeps Python's plain exit."""
    global _hook_installed
    if _hook_installed or os.environ.get("MCRDL_ABORT_ON_ERROR", "1") == "0":
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        runtime = _runtime
        if runtime is None or runtime.world.size < 2 or not runtime.backends:
            return
        sys.stderr.write(
            f"mcrdl: rank {runtime.world.rank}: {kind.__name__} was not caught; ending the "
            f"job (the other ranks may be waiting for this one; MCRDL_ABORT_ON_ERROR=0 "
            f"exits this rank alone)\n")
        # A hook chained after this one may hold what this one printed until it returns
        # (torch.distributed's buffers the traceback to prefix it with the rank): end the
        # job after it, as the first exit handler, or in 2 s whatever else runs first.
        global _job_end
        if _job_end is None:
            _job_end = _JobEnd(runtime)
            atexit.register(_job_end)
            threading.Thread(target=_job_end, args=(2.0,), name="mcrdl-end-job",
                             daemon=True).start()

    sys.excepthook = hook
    _hook_installed = True


class _JobEnd:
    """Ends the job once (MPI_Abort in an MPI world, else exit code 1), from whichever
    of the exit handler and the timer thread comes first; the other one then waits for
    it (the exit must not go on into MPI_Finalize meanwhile)."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.once = threading.Lock()

    def __call__(self, delay: float = 0.0) -> None:
        time.sleep(delay)
        if not self.once.acquire(blocking=False):
            threading.Event().wait()  # the other caller ends the process
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(0.5)  # the launcher forwards what was printed before the abort's kill
        mpi = sys.modules.get("mpi4py.MPI")
        if self.runtime.bootstrap.mpi and mpi is not None and mpi.Is_initialized() \
                and not mpi.Is_finalized():
            mpi.COMM_WORLD.Abort(1)
        os._exit(1)


def finalize() -> None:
    """Tear down every backend (outstanding ops are abandoned) and the bootstrap.
    Calls the extensions still hold (fusion buffers) are posted first."""
    global _runtime, _dispatch
    runtime, _runtime = _runtime, None
    _dispatch = {}
    _C.front_invalidate()
    if runtime is not None:
        runtime.finalize()


def is_initialized() -> bool:
    return _runtime is not None and bool(_runtime.backends)


def available_backends() -> list[str]:
    """Backends usable in this process (before or after init)."""
    return [n for n, why in registry.availability(_launch()).items() if why is None]


def get_backends() -> list[str]:
    """Initialized backends, in init order."""
    return list(_runtime.backends) if _runtime is not None else []


def current_runtime() -> Runtime | None:
    """This process's :class:`~mcrdl.runtime.Runtime` (None before init and after
    finalize), for integrations below the front that need its launch information, its
    timeout or its bootstrap store (mcrdl.torch_backend gets the front injected and
    rendezvouses torch.distributed on that store under mpiexec). ``init([])`` makes one
    with no backend: the bootstrap alone."""
    return _runtime


def _initialized() -> Runtime:
    if _runtime is None or not _runtime.backends:
        _unavailable("auto")
    return _runtime


def _check_query(backend: object, group: Group | None) -> Runtime:
    rt = _initialized()
    if backend != "auto" and (not isinstance(backend, str) or backend not in rt.backends):
        _unavailable(backend)
    if group is not None and not isinstance(group, Group):
        raise InvalidArgumentError(
            f"'group' must be a mcrdl Group or None, got {type(group).__name__}")
    return rt


def get_rank(backend: str = "auto", group: Group | None = None) -> int:
    """This process's rank in `group` (world when None); -1 if not a member."""
    rt = _check_query(backend, group)
    return rt.world.rank if group is None else group.rank


def get_size(backend: str = "auto", group: Group | None = None) -> int:
    """Number of ranks in `group` (world when None)."""
    rt = _check_query(backend, group)
    return rt.world.size if group is None else group.size


get_world_size = get_size


def new_group(ranks: Sequence[int]) -> Group:
    """Create a group of world ranks (collective over the world: every rank calls it,
    in the same order, with the same ranks). Group rank i is ``ranks[i]``."""
    return _initialized().new_group(ranks)


def synchronize(backends: str | Sequence[str] | None = None) -> None:
    """Wait for every outstanding op of the given backends (all when None), including
    calls held by extensions (fused calls are flushed and their results copied back)."""
    rt = _initialized()
    names = None if backends is None else _names(backends, "synchronize")
    for n in names or ():
        if n not in _dispatch:
            _unavailable(n)
    rt.synchronize(names)


# -- object collectives --------------------------------------------------------------

def all_gather_object(obj: object, group: Group | None = None) -> list:
    """Every member's picklable `obj`, in group rank order (collective over the group).

    For set-up and bookkeeping (configurations, error texts, checksums), not for data:
    objects move pickled over mcrdl's bootstrap channel, outside the backends' lanes.
    Every rank of the group calls it in the same order; bounded by the init timeout."""
    return _initialized().all_gather_object(obj, group)


def broadcast_object(obj: object, src: int = 0, group: Group | None = None) -> object:
    """Group rank `src`'s picklable `obj` on every member (collective over the group);
    see :func:`all_gather_object`."""
    return _initialized().broadcast_object(obj, src, group)


# -- operations: one function per spec -------------------------------------------------

# Names the generated functions use (they run with this module's globals, so that they
# see _dispatch as init and finalize rebind it).
_ReduceOp, _to_reduce_op, _SUM, _Unsupported = ReduceOp, to_reduce_op, ReduceOp.SUM, \
    UnsupportedOperationError


def _make_operation(spec: OpSpec):
    """The public function of `spec`: ``name(backend, <params>, group=None,
    async_op=False)``. It looks the backend up, converts reduce ops, calls the backend's
    layers, and names the backends that have the op when this one does not."""
    params, args = [], []
    for p in spec.params:
        if p.default is REQUIRED:
            params.append(p.name)
        else:
            params.append(f"{p.name}={'_SUM' if p.kind is Kind.REDUCE_OP else repr(p.default)}")
        if p.kind is Kind.REDUCE_OP:
            args.append(f"({p.name} if {p.name}.__class__ is _ReduceOp "
                        f"else _to_reduce_op({p.name}))")
        else:
            args.append(p.name)
    source = "\n".join((
        f"def {spec.name}(backend, {', '.join([*params, 'group=None', 'async_op=False'])}):",
        "    if async_op.__class__ is not bool:",
        f"        async_op = _async_flag(async_op, {spec.name!r})",
        "    try:",
        "        target = _dispatch[backend]",
        "    except (KeyError, TypeError):",
        "        target = _unavailable(backend)",
        "    try:",
        f"        return target.{spec.name}({', '.join([*args, 'group', 'async_op'])})",
        "    except _Unsupported as exc:",
        "        raise _alternatives(exc) from None",
    ))
    namespace: dict = {}
    exec(compile(source, f"<mcrdl.api.{spec.name}>", "exec"), globals(), namespace)  # noqa: S102
    fn = namespace[spec.name]
    fn.__module__ = __name__
    fn.__doc__ = (f"{spec.doc}\n\n``backend``: a backend name or \"auto\"; ``group``: a "
                  "Group (None: the world); with ``async_op=True`` returns a Work, else None "
                  "once the result is ready.")
    # The public object: the same steps in C, without this function's Python frame (a
    # third of a small blocking call); it calls `fn` for whatever it does not handle, and
    # inspect.signature follows __wrapped__ to `fn`.
    code = fn.__code__
    names = code.co_varnames[1:code.co_argcount]
    assert names[-1] == "async_op", names  # the C front checks the last one is a bool
    defaults = (REQUIRED,) * (len(names) - len(fn.__defaults__)) + fn.__defaults__
    reduce_at = [i for i, p in enumerate(spec.params) if p.kind is Kind.REDUCE_OP]
    front = _C.front_op(fn, spec.name, globals(), names, defaults, REQUIRED, reduce_at,
                        ReduceOp, to_reduce_op, UnsupportedOperationError, _alternatives)
    front.__name__ = front.__qualname__ = spec.name
    front.__module__, front.__doc__, front.__wrapped__ = __name__, fn.__doc__, fn
    return front


for _spec in OPS.values():
    globals()[_spec.name] = _make_operation(_spec)
for _alias, _name in ALIASES.items():
    globals()[_alias] = globals()[_name]
del _spec, _alias, _name
