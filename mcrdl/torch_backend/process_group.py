"""The torch.distributed ProcessGroup of the "mcrdl" backend (its Work is work.py's, the
creator torch calls to make one factory.py's).

Each c10d operation torch calls on the group becomes one call of the public mcrdl API
(the front, handed in by ``mcrdl/__init__.py``) on the backend its family is routed to
(routing.py), so it gets mcrdl's validation, "auto" routing, lanes, timeouts, debug
mode and extensions. The group is a Python subclass of ``torch.distributed.ProcessGroup``
(torch's trampoline forwards the C++ virtual calls DDP's reducer and the functional
collectives make to these methods).

Calls with ``opts.asyncOp`` False (torch's blocking calls) run the blocking mcrdl call
and return None, which torch accepts as "already complete"; the others return a
:class:`~mcrdl.torch_backend.work.McrdlWork`. A group made with a timeout other than
mcrdl's waits on its own.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # not in dist's namespace

from ..backends import registry
from ..errors import (
    BackendUnavailableError,
    CommTimeoutError,
    InvalidArgumentError,
    MCRDLError,
    UnsupportedOperationError,
)
from ..ops import OPS, ReduceOp
from ..validate import validate
from . import monitored
from .convert import (
    BY_HASH,
    c10d_error,
    explicit_timeout,
    flat_view,
    not_one,
    op_of,
    reduce_op,
    single,
    timeout_seconds,
)
from .routing import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    EVERY_OTHER,
    GATHER,
    RECV,
    REDUCE,
    REDUCE_SCATTER,
    SCATTER,
    SEND,
    TorchBackendOptions,
    check_initialized,
    describe,
    process_routes,
    table,
)
from .work import McrdlWork

log = logging.getLogger("mcrdl")

BACKEND_NAME = "mcrdl"


class _Refusing(dict):
    """The routes of a group an op's timeout broke: every lookup (each call's first
    step) raises the error that says so, at no cost to the calls of healthy groups."""

    def __init__(self, routes: dict[str, str], why: str):
        super().__init__(routes)
        self.why = why

    def __getitem__(self, family: str):
        raise BackendUnavailableError(f"torch.distributed {family} on mcrdl: {self.why}")


class ProcessGroupMCRDL(dist.ProcessGroup):
    """A torch.distributed process group whose operations run on mcrdl.

    ``front``: the mcrdl front (``mcrdl.api``); ``group``: the mcrdl Group of the same
    ranks in the same order (None: mcrdl's world); ``routes``: c10d family -> mcrdl
    backend (the process-wide dict, shared, or one of the group's own); ``timeout``:
    seconds this group's waits take, None for mcrdl's.
    """

    # Slots: the hot path reads these on every call (see McrdlWork).
    __slots__ = ("_api", "_all_reduce", "_group", "_routes", "_timeout",
                 "_finalize_on_shutdown", "_name", "_desc", "__dict__")

    def __init__(self, front, rank: int, size: int, group, routes: dict[str, str],
                 timeout: float | None, finalize_on_shutdown: bool = False, store=None):
        super().__init__(rank, size)
        self._store = store  # torch's store of the world (monitored_barrier's)
        self._monitored = 0  # monitored barriers called
        self._api = front
        self._all_reduce = front.all_reduce  # a module function, fixed: one lookup saved
        self._group = group
        self._routes = routes
        self._timeout = timeout
        self._finalize_on_shutdown = finalize_on_shutdown
        self._name = ""
        self._desc = "undefined"

    # The C++ virtuals torch's trampoline forwards; c10d keeps a group's name and
    # description in its C++ backends, which this group has none of.
    def getBackendName(self) -> str:  # noqa: N802
        return BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def __repr__(self) -> str:
        where = "world" if self._group is None else f"ranks {list(self._group.ranks)}"
        return f"<ProcessGroupMCRDL {where}, rank {self.rank()} of {self.size()}>"

    @property
    def routes(self) -> dict[str, str]:
        """c10d operation family -> mcrdl backend, as this group routes now."""
        return dict(self._routes)

    def _break(self, what: str, exc: CommTimeoutError) -> None:
        """An op of this group timed out: the group refuses every later op."""
        if not isinstance(self._routes, _Refusing):
            self._routes = _Refusing(self._routes, (
                f"an earlier {what} of this group timed out ({exc}). A timed-out op stays "
                "in flight, so the group's later ops would no longer match across ranks; "
                "it refuses them. Destroy the group (torch.distributed.destroy_process_group) "
                "and make another, or end the job"))

    # -- issuing -------------------------------------------------------------------
    def _post(self, family: str, op: Callable, args: tuple, outputs: list, async_op: bool,
              timeout: float | None = None):
        """One mcrdl call: a McrdlWork when `async_op`, else None once complete (a call
        with a timeout of its own, `timeout`, else the group's, waits on a work with it)."""
        backend = self._routes[family]
        if timeout is None:
            timeout = self._timeout
        try:
            if not async_op and timeout is None:
                op(backend, *args, self._group, False)
                return None
            work = McrdlWork.of((op(backend, *args, self._group, True),), outputs,
                                timeout, None, family, self)
        except MCRDLError as exc:
            raise c10d_error(exc, family, backend) from None
        if async_op:
            return work
        work.wait()
        return None

    def _post_each(self, family: str, op: Callable, calls: list[tuple], outputs: list,
                   async_op: bool, finish: Callable[[], None] | None = None):
        """Several mcrdl calls as one work (the coalesced forms). Every call is validated
        before the first is issued, so a bad one sends nothing."""
        backend = self._routes[family]
        spec = OPS[op.__name__]
        try:
            for args in calls:
                validate(spec.call((*args, self._group, True)), self.size(), self.rank())
            works = tuple(op(backend, *args, self._group, True) for args in calls)
        except MCRDLError as exc:
            raise c10d_error(exc, family, backend) from None
        work = McrdlWork.of(works, outputs, self._timeout, finish, family, self)
        if async_op:
            return work
        work.wait()
        return None

    # -- allreduce: allreduce, allreduce_coalesced -------------------------------------
    def allreduce(self, tensors, opts=None):
        # _post and op_of written out: the small all-reduce is the call whose overhead
        # matters. Each option is read once (a read of reduceOp builds a ReduceOp).
        if opts is None:
            opts = dist.AllreduceOptions()
        if len(tensors) != 1:
            raise not_one(tensors, ALLREDUCE)
        op = opts.reduceOp
        try:
            op = BY_HASH[hash(op)]
        except KeyError:
            op = reduce_op(op, ALLREDUCE)
        backend = self._routes[ALLREDUCE]
        try:
            if not opts.asyncOp:
                if self._timeout is None:
                    self._all_reduce(backend, tensors[0], op, self._group, False)
                    return None
                McrdlWork.of((self._all_reduce(backend, tensors[0], op, self._group, True),),
                             tensors, self._timeout, None, ALLREDUCE, self).wait()
                return None
            return McrdlWork.of((self._all_reduce(backend, tensors[0], op, self._group, True),),
                                tensors, self._timeout, None, ALLREDUCE, self)
        except MCRDLError as exc:
            if tensors[0].layout is torch.sparse_coo:  # refused by mcrdl: not on the hot path
                return self._sparse_allreduce(tensors[0], op, opts.asyncOp)
            raise c10d_error(exc, ALLREDUCE, backend) from None

    def _sparse_allreduce(self, tensor: torch.Tensor, op, async_op: bool):
        """The sum of a sparse COO tensor over the group, into it (as Gloo's sparse
        all_reduce): every rank's indices and values are gathered (padded to the largest
        count, which one all_gather of the counts tells first) and summed, coalesced."""
        backend = self._routes[ALLREDUCE]
        if op is not ReduceOp.SUM:
            raise c10d_error(InvalidArgumentError(
                f"all_reduce: a sparse tensor reduces with ReduceOp.SUM only (as on Gloo), "
                f"got {op.name}; convert it with .to_dense() for other ops"),
                ALLREDUCE, backend)
        local = tensor.coalesce()
        indices, values = local.indices(), local.values()
        count = torch.tensor([values.shape[0]], dtype=torch.int64)
        counts = [torch.empty_like(count) for _ in range(self.size())]
        try:
            self._api.all_gather(backend, counts, count, self._group, False)
        except MCRDLError as exc:
            raise c10d_error(exc, ALLREDUCE, backend) from None
        counts = [int(c) for c in counts]
        most = max(counts)
        padded_indices = indices.new_zeros((indices.shape[0], most))
        padded_indices[:, :counts[self.rank()]] = indices
        padded_values = values.new_zeros((most, *values.shape[1:]))
        padded_values[:counts[self.rank()]] = values
        all_indices = [torch.empty_like(padded_indices) for _ in counts]
        all_values = [torch.empty_like(padded_values) for _ in counts]

        def total():
            summed = torch.sparse_coo_tensor(
                torch.cat([i[:, :n] for i, n in zip(all_indices, counts, strict=True)], 1),
                torch.cat([v[:n] for v, n in zip(all_values, counts, strict=True)]), tensor.shape)
            tensor.copy_(summed.coalesce())

        calls = [(all_indices, padded_indices), (all_values, padded_values)] if most else []
        return self._post_each(ALLREDUCE, self._api.all_gather, calls, [tensor], async_op,
                               total)

    def allreduce_coalesced(self, tensors, opts=None):
        """One all_reduce per dtype, of the tensors packed into one buffer."""
        if opts is None:
            opts = dist.AllreduceCoalescedOptions()
        op = op_of(opts, "allreduce_coalesced")
        backend, spec = self._routes[ALLREDUCE], OPS["all_reduce"]
        for i, t in enumerate(tensors):  # as mcrdl takes each: the pack would take any
            try:
                validate(spec.call((t, op, self._group, True)), self.size(), self.rank())
            except MCRDLError as exc:
                raise c10d_error(type(exc)(f"tensors[{i}]: {exc}"), ALLREDUCE,
                                  backend) from None
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        packed = [(torch.cat([t.reshape(-1) for t in ts]), ts) for ts in by_dtype.values()]

        def unpack():
            for flat, ts in packed:
                offset = 0
                for t in ts:
                    t.copy_(flat.narrow(0, offset, t.numel()).view_as(t))
                    offset += t.numel()

        return self._post_each(ALLREDUCE, self._api.all_reduce,
                               [(flat, op) for flat, _ in packed], list(tensors), opts.asyncOp,
                               unpack)

    # -- broadcast, reduce -------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        if opts is None:
            opts = dist.BroadcastOptions()
        tensor = single(tensors, BROADCAST)
        return self._post(BROADCAST, self._api.bcast, (tensor, opts.rootRank), tensors,
                          opts.asyncOp)

    def reduce(self, tensors, opts=None):
        if opts is None:
            opts = dist.ReduceOptions()
        tensor = single(tensors, REDUCE)
        return self._post(REDUCE, self._api.reduce,
                          (tensor, opts.rootRank, op_of(opts, REDUCE)), tensors,
                          opts.asyncOp)

    # -- allgather: allgather, all_gather_single (_allgather_base), allgather_coalesced,
    #    all_gather_single_coalesced (allgather_into_tensor_coalesced) -----------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = AllgatherOptions()
        tensor = single(input_tensors, ALLGATHER)
        outputs = single(output_tensors, ALLGATHER)
        return self._post(ALLGATHER, self._api.all_gather, (outputs, tensor), outputs,
                          opts.asyncOp)

    def all_gather_single(self, output, input, opts=None):
        if opts is None:
            opts = AllgatherOptions()
        return self._post(ALLGATHER, self._api.all_gather,
                          (flat_view(output), flat_view(input)), [output], opts.asyncOp)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """``output_lists[r][i]`` receives rank r's ``input_tensors[i]`` (one list per
        rank, as torch's all_gather_coalesced documents): one all_gather per input."""
        if opts is None:
            opts = AllgatherOptions()
        size = self.size()
        if len(output_lists) != size or any(len(outs) != len(input_tensors)
                                            for outs in output_lists):
            raise c10d_error(InvalidArgumentError(
                f"all_gather_coalesced: output_tensor_lists holds one list per rank of the "
                f"group ({size}), each with one tensor per input ({len(input_tensors)}); "
                f"got {len(output_lists)} lists of "
                f"{sorted({len(outs) for outs in output_lists})} tensors"),
                ALLGATHER, self._routes[ALLGATHER])
        calls = [([output_lists[r][i] for r in range(size)], t)
                 for i, t in enumerate(input_tensors)]
        return self._post_each(ALLGATHER, self._api.all_gather, calls,
                               [o for outs in output_lists for o in outs], opts.asyncOp)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        if opts is None:
            opts = AllgatherOptions()
        calls = [(flat_view(o), flat_view(i)) for o, i in zip(outputs, inputs, strict=True)]
        return self._post_each(ALLGATHER, self._api.all_gather, calls, list(outputs),
                               opts.asyncOp)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- gather, scatter -------------------------------------------------------------
    def gather(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = dist.GatherOptions()
        tensor = single(input_tensors, GATHER)
        outputs = single(output_tensors, GATHER) if output_tensors else None
        return self._post(GATHER, self._api.gather, (outputs, tensor, opts.rootRank),
                          outputs or [], opts.asyncOp)

    def scatter(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = dist.ScatterOptions()
        tensor = single(output_tensors, SCATTER)
        inputs = single(input_tensors, SCATTER) if input_tensors else None
        return self._post(SCATTER, self._api.scatter, (tensor, inputs, opts.rootRank),
                          output_tensors, opts.asyncOp)

    # -- reduce_scatter: reduce_scatter, reduce_scatter_single (_reduce_scatter_base),
    #    reduce_scatter_single_coalesced (reduce_scatter_tensor_coalesced) ------------
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = dist.ReduceScatterOptions()
        tensor = single(output_tensors, REDUCE_SCATTER)
        inputs = single(input_tensors, REDUCE_SCATTER)
        return self._post(REDUCE_SCATTER, self._api.reduce_scatter,
                          (tensor, inputs, op_of(opts, REDUCE_SCATTER)),
                          output_tensors, opts.asyncOp)

    def reduce_scatter_single(self, output, input, opts=None):
        if opts is None:
            opts = dist.ReduceScatterOptions()
        return self._post(REDUCE_SCATTER, self._api.reduce_scatter,
                          (flat_view(output), flat_view(input),
                           op_of(opts, REDUCE_SCATTER)),
                          [output], opts.asyncOp)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        if opts is None:
            opts = dist.ReduceScatterOptions()
        op = op_of(opts, REDUCE_SCATTER)
        calls = [(flat_view(o), flat_view(i), op)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._post_each(REDUCE_SCATTER, self._api.reduce_scatter, calls, list(outputs),
                               opts.asyncOp)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- alltoall: all_to_all_single (alltoall_base), alltoall -------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        if opts is None:
            opts = dist.AllToAllOptions()
        return self._post(ALLTOALL, self._api.all_to_all_single,
                          (output, input, list(output_split_sizes) or None,
                           list(input_split_sizes) or None), [output], opts.asyncOp)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = dist.AllToAllOptions()
        return self._post(ALLTOALL, self._api.all_to_all, (output_tensors, input_tensors),
                          output_tensors, opts.asyncOp)

    # -- point to point, barrier -----------------------------------------------------
    def send(self, tensors, dst, tag=0):
        tensor = single(tensors, SEND)
        return self._post(SEND, self._api.send, (tensor, dst, tag), tensors, True)

    def recv(self, tensors, src, tag=0):
        tensor = single(tensors, RECV)
        return self._post(RECV, self._api.recv, (tensor, src, tag), tensors, True)

    def recv_anysource(self, tensors, tag=0):
        raise UnsupportedOperationError(
            "recv_anysource: no mcrdl backend receives from any source (mcrdl.recv takes "
            "the sender's rank); pass src to torch.distributed.recv / irecv")

    def barrier(self, opts=None):
        """torch.distributed.barrier(timeout=...) waits that long (longer or shorter than
        the group's or mcrdl's timeout), as on Gloo."""
        if opts is None:
            opts = dist.BarrierOptions()
        return self._post(BARRIER, self._api.barrier, (), [], opts.asyncOp,
                          timeout_seconds(opts.timeout))

    def monitored_barrier(self, timeout: datetime.timedelta | float | None = None,
                          wait_all_ranks: bool = False) -> None:
        """torch.distributed.monitored_barrier (monitored.py): a barrier over the group's
        store that names the ranks which did not reach it within `timeout` (the group's,
        else mcrdl's, when None)."""
        if self._store is None:
            raise UnsupportedOperationError(
                "monitored_barrier: this mcrdl group has no store (it runs over the store "
                "torch gives init_process_group); use barrier()")
        seconds = self._timeout if timeout is None else (
            timeout.total_seconds() if isinstance(timeout, datetime.timedelta)
            else float(timeout))
        if seconds is None:
            seconds = self._api.current_runtime().timeout
        self._monitored += 1
        monitored.monitored_barrier(self._store, f"{monitored.KEY}/{self._name}/"
                                    f"{self._monitored}", self.rank(), self.size(), seconds,
                                    wait_all_ranks)

    # -- groups and lifetime ---------------------------------------------------------
    def new_group(self, ranks, timeout=None, pg_options=None, group_name=None,
                  group_desc=None, backend=None):
        """torch.distributed.new_group's hook: torch 2.13 hands every new_group (and so
        new_subgroups and DeviceMesh's dimension groups) to the default group's
        ``new_group`` on every rank, so every sub-group of an "mcrdl" world is an mcrdl
        group. torch 2.13 passes no ``backend``; later torch passes the one asked for
        (the default group's when none was): one of mcrdl's backends then carries every
        op of the group (_pinned_routes). mcrdl makes groups collectively over the
        world: use_local_synchronization=True (only members call) cannot be served."""
        if group_name is not None and not str(group_name).isdigit():
            # torch names groups by a counter, or by a hash of the ranks when only the
            # members call (use_local_synchronization=True)
            raise InvalidArgumentError(
                "new_group: mcrdl creates groups collectively over every rank; "
                "use_local_synchronization=True (only the members call new_group) is not "
                "supported: call new_group on every rank")
        # checked on every rank before the collective, so that all of them raise alike
        where = f"new_group({list(ranks)})"
        routes = group_routes(pg_options, self._api, where,
                               base=_pinned_routes(backend, where, self._api.get_backends()))
        group = self._api.new_group(list(ranks))
        if not group.is_member:
            return None
        pg = ProcessGroupMCRDL(self._api, group.rank, group.size, group, routes,
                               group_timeout(self._api, timeout), store=self._store)
        pg._set_group_name(str(group_name))
        pg._set_group_desc(group_desc or "undefined")
        log.info("mcrdl torch backend: group %s (ranks %s): %s", group_name, list(ranks),
                 describe(routes))
        return pg

    def shutdown(self) -> None:
        """destroy_process_group's hook: the group whose creation initialized mcrdl
        finalizes it (collective, as destroy_process_group is); the others keep their
        mcrdl group (mcrdl has no group destruction)."""
        if self._finalize_on_shutdown:
            self._finalize_on_shutdown = False
            self._api.finalize()


def _pinned_routes(backend: object, where: str,
                   initialized: Sequence[str]) -> dict[str, str] | None:
    """The table of a sub-group whose new_group named one of the `initialized` mcrdl
    backends (every family to it; torch lowercases the name, so it matches any case);
    None when it named none, or "mcrdl" (also as every device's entry of a device map
    such as "cpu:mcrdl,cuda:mcrdl"). A device map naming one backend for every device
    pins the group to it, CUDA tensors too."""
    if backend is None:
        return None
    entries = {e.partition(":")[2].strip() if ":" in e else e.strip()
               for e in str(backend).lower().split(",") if e.strip()}
    if entries <= {BACKEND_NAME, "undefined"}:
        return None
    by_lower = {n.lower(): n for n in initialized}
    name = next(iter(entries)) if len(entries) == 1 else None
    if name in by_lower:
        return table({EVERY_OTHER: by_lower[name]})
    known = {n.lower() for n in registry.known_names()}
    why = (f"mcrdl's backend {name!r} is not initialized in this process (mcrdl.init([...]) "
           f"before init_process_group initializes it)" if name in known else
           "a sub-group of an mcrdl world is an mcrdl group, which can pin its ops to one "
           "of mcrdl's initialized backends")
    raise InvalidArgumentError(
        f"{where}: backend={backend!r} under the 'mcrdl' default group: {why}; pass one of "
        f"{', '.join(initialized) or 'none'}, or backend=None (the group's ops follow "
        f"mcrdl's routes), or pg_options=mcrdl.TorchBackendOptions(routes=...) for "
        f"per-operation routes")


def group_routes(pg_options: object, front, where: str, initialized: list[str] | None = None,
                  base: dict[str, str] | None = None) -> dict[str, str]:
    """The routes of a new group: the process-wide dict itself, or the group's own table
    when pg_options carries routes (over `base`, else the process-wide table), or `base`.
    Backends named must be initialized (`initialized`, else mcrdl's now)."""
    if base is None:
        base = process_routes()
    if pg_options is None:
        routes = base
    elif isinstance(pg_options, TorchBackendOptions):
        routes = table(pg_options.routes, base)
    else:
        raise InvalidArgumentError(
            f"{where}: pg_options of the mcrdl backend is a mcrdl.TorchBackendOptions, got "
            f"{type(pg_options).__name__}")
    check_initialized(routes, front.get_backends() if initialized is None else initialized,
                      where)
    return routes


def group_timeout(front, timeout: datetime.timedelta | None) -> float | None:
    """A group's own wait timeout in seconds, None when it is mcrdl's."""
    seconds = explicit_timeout(timeout)
    if seconds is None or seconds == front.current_runtime().timeout:
        return None
    return seconds
