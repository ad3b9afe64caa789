"""The "auto" backend: the first layer of the call path, which resolves each call to a
concrete backend and hands it to that backend's layers.

With a tuning table, a call goes to the backend the table predicts fastest for
(operation, group size, bytes) among the initialized ones that take the payload's device
(a CPU tensor never goes to "nccl", a GPU tensor never to a CPU-only backend); an
exchange whose bytes differ by rank (uneven all_to_all) goes by group size alone, as the
table's choice for its largest messages, so that every rank picks the same backend;
in debug mode (MCRDL_DEBUG=1) every call goes by group size alone, so that ranks that
disagree on a call's size still meet on one backend, whose check reports it
(DesyncError) instead of each rank timing out on another backend; calls the table cannot place
(no data, malformed arguments) take the fixed rule, whose backend then validates them.
The fixed rule, without a table: tensors on a GPU to "nccl" (or "rccl") when
initialized, other tensors to "mpi" when initialized, else "gloo", else the first
initialized backend. Lookups are cached per (group size, bytes): one dict hit.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

from ..ops import OPS, Agreement, Kind, OpSpec

log = logging.getLogger("mcrdl")

#: The fixed rule, in order of preference.
CPU_PREFERENCE = ("mpi", "gloo")
GPU_PREFERENCE = ("nccl", "rccl")
_ROUTES_MAX = 4096  # distinct (group size, bytes) per op kept before starting over
#: The bytes an exchange whose size differs by rank is routed as: the table's choice for
#: its largest messages (see _uneven).
UNEVEN_BYTES = 1 << 50
#: Ops routed by another op's data: a receive must go to the backend its send went to, or
#: the two never meet (a table may hold send's data and not recv's, or other winners).
ROUTED_AS = {"recv": "send"}


def _uneven(spec: OpSpec) -> Callable[[tuple], bool]:
    """Whether a call of `spec` may count different bytes on different ranks: an
    exchange with per-rank splits (all_to_all_single given split sizes), a list per
    destination (all_to_all) or counts (all_to_allv). Every rank must route such a call
    to the same backend, or the ranks never meet, so it routes by group size alone."""
    if spec.agreement is not Agreement.EXCHANGE:
        return lambda args: False
    splits = [spec.index[p.name] for p in spec.params if p.kind is Kind.SPLITS]
    if not splits:
        return lambda args: True
    return lambda args: any(args[i] is not None for i in splits)


def load_table(path: str | None):
    """The tuning table "auto" routes by: `path` (init's tuning_table or
    $MCRDL_TUNING_TABLE), else the shipped table matching this system; None (fixed rule)
    when there is none."""
    from ..tuning.provenance import SHIPPED_TABLES, current_provenance, find_shipped_table
    from ..tuning.table import TuningTable

    current = current_provenance()
    if path is None:
        path = find_shipped_table(SHIPPED_TABLES, current)
        if path is None:
            return None
    table = TuningTable.load(path)
    stale = table.stale_reasons(current)
    if stale:
        warnings.warn(f"mcrdl: tuning table {path} was measured with other libraries than "
                      f"these ({'; '.join(stale)}); \"auto\" may pick slower backends. "
                      "Re-run mcrdl-tune.", stacklevel=4)
    log.info("mcrdl: \"auto\" routes by tuning table %s", path)
    return table


def build(chains: dict, table, world_size: int, devices: dict | None = None,
          debug: bool = False):
    """The object the front calls for "auto" over `chains` (backend name -> the top of
    its layers); None when no backend is initialized. `devices`: backend name -> the
    device types it takes (its Capabilities; default: CPU only); `debug`: debug mode."""
    def first(names):
        return next((chains[n] for n in names if n in chains), None)

    cpu, gpu = first(CPU_PREFERENCE), first(GPU_PREFERENCE)
    if cpu is not None and gpu is not None:
        fixed = ByDevice(cpu, gpu)
    elif cpu or gpu or chains:
        fixed = cpu or gpu or next(iter(chains.values()))
    else:
        return None
    if table is None:
        return fixed
    return ByTable(table, chains, fixed, world_size, devices or {}, debug)


class _Router:
    """One callable per operation, made by :meth:`route`; synchronize reaches every
    backend the router may send to."""

    name = "auto"

    def __init__(self, targets: list):
        self._targets = targets
        for op, spec in OPS.items():
            self.__dict__[op] = self.route(spec)

    def route(self, spec: OpSpec) -> Callable:
        raise NotImplementedError

    def synchronize(self, timeout: float) -> None:
        for t in self._targets:
            t.synchronize(timeout)


class ByTable(_Router):
    """"auto" with a tuning table; see the module docstring."""

    def __init__(self, table, chains: dict, fixed, world_size: int, devices: dict,
                 debug: bool = False):
        self._table, self._chains, self._fixed = table, chains, fixed
        self._world_size, self._debug = world_size, debug
        # the candidates for a payload on a GPU and for any other payload
        takes = {n: devices.get(n, frozenset({"cpu"})) for n in chains}
        self._names = {False: tuple(n for n in chains if "cpu" in takes[n]),
                       True: tuple(n for n in chains if "cuda" in takes[n])}
        self._mixed = self._names[False] != self._names[True]
        super().__init__(list(chains.values()))

    def route(self, spec: OpSpec) -> Callable:
        op, table, chains, names = spec.name, self._table, self._chains, self._names
        fallback = getattr(self._fixed, op)
        looked_up = ROUTED_AS.get(op, op)
        nbytes_of, at_group, world_size = spec.nbytes_of, len(spec.params), self._world_size
        uneven = (lambda args: True) if self._debug else _uneven(spec)
        on_gpu = _on_gpu(spec) if self._mixed else None
        routes: dict = {}  # (group size, bytes, payload on a GPU) -> the backend's callable

        def call(*args):
            try:
                group = args[at_group]
                gsize = world_size if group is None else group.size
                key = (gsize, UNEVEN_BYTES if uneven(args) else nbytes_of(args, gsize),
                       on_gpu(args) if on_gpu else False)
            except (AttributeError, TypeError, IndexError):  # let a backend say what is wrong
                return fallback(*args)
            fn = routes.get(key)
            if fn is None:
                name = table.lookup(looked_up, gsize, key[1], names[key[2]])
                fn = getattr(chains[name], op) if name else fallback
                if len(routes) >= _ROUTES_MAX:
                    routes.clear()
                routes[key] = fn
            return fn(*args)

        return call


def _on_gpu(spec: OpSpec) -> Callable[[tuple], bool]:
    """Whether a call of `spec` has its payload (its first tensor) on a GPU."""
    if spec.payload is None:
        return lambda args: False
    at = spec.index[spec.payload]
    if spec.params[at].kind is Kind.TENSOR_LIST:
        return lambda args: bool(args[at]) and getattr(args[at][0], "is_cuda", False)
    return lambda args: getattr(args[at], "is_cuda", False)


class ByDevice(_Router):
    """"auto" when CPU and GPU backends are both initialized: a call whose payload
    tensor is on a GPU goes to the GPU backend, any other to the CPU backend."""

    def __init__(self, cpu, gpu):
        self._cpu, self._gpu = cpu, gpu
        super().__init__([cpu, gpu])

    def route(self, spec: OpSpec) -> Callable:
        on_cpu, on_gpu = getattr(self._cpu, spec.name), getattr(self._gpu, spec.name)
        if spec.payload is None:
            return on_cpu
        gpu_payload = _on_gpu(spec)

        def call(*args):
            return (on_gpu if gpu_payload(args) else on_cpu)(*args)

        return call
