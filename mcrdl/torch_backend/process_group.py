"""The torch.distributed ProcessGroup of the "mcrdl" backend, and its Work.

Each c10d operation torch calls on the group becomes one call of the public mcrdl API
(the front, handed in by ``mcrdl/__init__.py``) on the backend its family is routed to
(routing.py), so it gets mcrdl's validation, "auto" routing, lanes, timeouts, debug
mode and extensions. The group is a Python subclass of ``torch.distributed.ProcessGroup``
(torch's trampoline forwards the C++ virtual calls DDP's reducer and the functional
collectives make to these methods).

Calls with ``opts.asyncOp`` False (torch's blocking calls) run the blocking mcrdl call
and return None, which torch accepts as "already complete"; the others return a
:class:`McrdlWork`. A group made with a timeout other than mcrdl's waits on its own.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # not in dist's namespace
from torch.distributed.constants import default_pg_timeout

from .._C import Work as _CWork
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

log = logging.getLogger("mcrdl")

BACKEND_NAME = "mcrdl"

_TORCH_SUM, _SUM = dist.ReduceOp.SUM, ReduceOp.SUM
_REDUCE_OPS = {getattr(dist.ReduceOp.RedOpType, op.name).value: op for op in ReduceOp
               if hasattr(dist.ReduceOp.RedOpType, op.name)}


def _ops_by_hash() -> dict[int, ReduceOp]:
    """hash(torch ReduceOp) -> mcrdl ReduceOp, when the hash tells the op apart (torch
    binds ``ReduceOp.__hash__`` to the RedOpType value: one call, where ``==`` converts
    its argument and ``.op`` builds a RedOpType); empty when it does not, and the calls
    go the slow way (:func:`_reduce_op`). Checked, not assumed: every op's hash is the
    same on two objects, the hashes differ, and PREMUL_SUM's (which mcrdl refuses, and
    whose object carries a factor) is none of them."""
    kinds = dist.ReduceOp.RedOpType
    pairs = [(getattr(kinds, op.name), op) for op in ReduceOp if hasattr(kinds, op.name)]
    table = {hash(dist.ReduceOp(kind)): op for kind, op in pairs}
    premul = getattr(dist, "_make_nccl_premul_sum", None)
    usable = (len(table) == len(pairs)
              and all(table.get(hash(dist.ReduceOp(kind))) is op and
                      table.get(hash(getattr(dist.ReduceOp, kind.name))) is op
                      for kind, op in pairs)
              and (premul is None or hash(premul(2.0)) not in table))
    return table if usable else {}


#: hash(opts.reduceOp) -> mcrdl ReduceOp (see _ops_by_hash); a miss goes to _reduce_op.
_BY_HASH = _ops_by_hash()


def _reduce_op(op: dist.ReduceOp, where: str) -> ReduceOp:
    """mcrdl's ReduceOp of a torch one (the slow way: the hot paths look
    ``hash(op)`` up in _BY_HASH first); raises for ops mcrdl does not have."""
    if op == _TORCH_SUM:
        return _SUM
    kind = op.op
    try:
        return _REDUCE_OPS[kind.value]
    except KeyError:
        raise InvalidArgumentError(
            f"{where}: reduce op {kind.name} has no mcrdl equivalent; mcrdl reduces with "
            f"{', '.join(o.name for o in ReduceOp)} (PREMUL_SUM is NCCL's own)") from None


def _op_of(opts, where: str) -> ReduceOp:
    """mcrdl's ReduceOp of ``opts.reduceOp``, read once."""
    op = opts.reduceOp
    try:
        return _BY_HASH[hash(op)]
    except KeyError:
        return _reduce_op(op, where)


def _not_one(tensors: Sequence[torch.Tensor], where: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{where}: mcrdl takes one tensor per call, got a list of {len(tensors)} (torch's "
        "multi-tensor form is for several devices per process); call once per tensor")


def _single(tensors: Sequence[torch.Tensor], where: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise _not_one(tensors, where)
    return tensors[0]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a contiguous tensor; others as they are, for mcrdl to refuse."""
    return t.view(-1) if t.is_contiguous() else t


def _seconds(timeout: object) -> float | None:
    """A c10d timeout (timedelta; zero means none given) in seconds, or None."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
        else float(timeout)
    return seconds if seconds > 0 else None


def explicit_timeout(timeout: datetime.timedelta | None) -> float | None:
    """Seconds of a timeout torch passes to a backend, None when it is torch's default:
    init_process_group and new_group always pass one, so a timeout equal to the default
    (30 min) counts as not given and mcrdl's own ($MCRDL_TIMEOUT, else 300 s) applies."""
    if timeout is None or timeout == default_pg_timeout:
        return None
    return timeout.total_seconds()


def _c10d_error(exc: MCRDLError, family: str, backend: str) -> MCRDLError:
    """`exc` of the same class, its message led by the c10d operation and the route."""
    return type(exc)(f"torch.distributed {family} on mcrdl backend '{backend}': {exc}")


_completer_lock = threading.Lock()
_completer: ThreadPoolExecutor | None = None


def _completer_pool() -> ThreadPoolExecutor:
    """Threads that complete the futures of works that are not plain mcrdl._C.Works (or
    that have a finish step), one per pending future up to 128: a wait never holds up
    another's future."""
    global _completer
    with _completer_lock:
        if _completer is None:
            _completer = ThreadPoolExecutor(128, thread_name_prefix="mcrdl-torch-future")
        return _completer


class _Watchdog:
    """Fails the futures of works that completion callbacks settle (see
    :meth:`McrdlWork.get_future`) once they are pending past their timeout: a callback
    alone never comes for an op a rank never joins.

    One sleeping thread per process. Works are kept per timeout in dicts, in the order
    they were watched, which is their deadlines' order; a settled work leaves at once.
    The thread sleeps until the first deadline (indefinitely when nothing is watched),
    and is woken only when a work's deadline comes before its wake-up: once per busy
    spell, not per work.
    """

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._queues: dict[float, dict[McrdlWork, float]] = {}
        self._wake_at = float("inf")
        self._thread: threading.Thread | None = None
        #: mcrdl's timeout in force, for works whose group has none of its own (set by
        #: create(); a work's own default is the one its op was posted with, the same).
        self.default_timeout: Callable[[], float] = lambda: 300.0

    def watch(self, work: McrdlWork, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            queue = self._queues.get(timeout)
            if queue is None:
                queue = self._queues[timeout] = {}
            queue[work] = deadline
            if deadline < self._wake_at:
                self._wake_at = deadline
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="mcrdl-torch-watchdog")
                    self._thread.start()
                else:
                    self._cond.notify()

    def forget(self, work: McrdlWork, timeout: float) -> None:
        with self._cond:
            queue = self._queues.get(timeout)
            if queue is not None:
                queue.pop(work, None)

    def _run(self) -> None:
        while True:
            due = []
            with self._cond:
                now = time.monotonic()
                wake = float("inf")
                for queue in self._queues.values():
                    expired = []
                    for work, deadline in queue.items():
                        if deadline > now:
                            wake = min(wake, deadline)
                            break
                        expired.append(work)
                    for work in expired:
                        del queue[work]
                    due += expired
                if not due:
                    self._wake_at = wake
                    self._cond.wait(None if wake == float("inf") else wake - now)
                    continue
            for work in due:
                work._expire()


_watchdog = _Watchdog()


class McrdlWork(dist.Work):
    """The c10d Work of async calls: mcrdl works, the tensors they write (the future's
    value, as c10d gives it) and a finish step (copying a packed result out) run once
    when they are complete. Made by :meth:`of`.

    ``wait(timeout)`` blocks until then (timeout zero or None: the group's, else
    mcrdl's). Only one thread waits on the mcrdl works at a time (the lock), so the
    finish step runs once. A failed op's error is kept: every later ``wait`` raises it,
    ``exception()`` returns it. A timeout of ``wait()`` is not kept (the op may still
    complete); the watchdog's timeout of a future is (the future failed with it and the
    group is broken): the work is then completed, and failed. ``result()`` before the
    work completed raises, as torch's works do; after a failure it raises the failure
    (the outputs may be half written).

    ``get_future()``: when every work is an ``mcrdl._C.Work`` and there is no finish
    step (every single-op call, DDP's buckets among them), the works' completion
    callbacks settle the future, on the thread that completes the last one (the
    backend's lane thread, or a waiter), and the watchdog fails it with the
    CommTimeoutError ``wait()`` would raise when it is pending past the timeout. Other
    works (the Python works of extensions, debug mode) are waited on by a thread of the
    completer pool, which settles the future.
    """

    # Slots: a work is made per async call, and attributes of a Python subclass of a
    # pybind class are cheaper in slots; __dict__ stays for what torch may set.
    __slots__ = ("_works", "_outputs", "_timeout", "_finish", "_what", "_lock", "_done",
                 "_error", "_future", "_unsettled", "_left", "_watched", "_pg", "__dict__")

    @classmethod
    def of(cls, works: tuple, outputs: list, timeout: float | None,
           finish: Callable[[], None] | None, what: str,
           pg: ProcessGroupMCRDL | None = None) -> McrdlWork:
        """`pg`: the group the works are ops of, which a timeout of theirs breaks."""
        # No __init__ of its own: pybind's constructor alone is the cheaper call.
        work = cls()
        work._pg = pg
        work._works = works
        work._outputs = outputs
        work._timeout = timeout
        work._finish = finish
        work._what = what
        work._lock = threading.Lock()
        work._done = False
        work._error = None
        work._future = None
        return work

    def _complete(self) -> None:
        if self._finish is not None:
            with torch.no_grad():
                self._finish()
            self._finish = None
        self._works = ()
        self._done = True

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._finish = None
        self._works = ()
        self._done = True

    def _settle(self, deadline: float | None) -> None:
        """Wait on the works until `deadline` (time.monotonic(); None: each work's own
        bound) and finish, or keep the failure; called with the lock held."""
        try:
            for w in self._works:
                w.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        except CommTimeoutError:
            raise  # the op may still complete: not kept
        except BaseException as exc:
            self._fail(exc)
            return
        self._complete()

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        if not self._done and self._error is None:
            seconds = self._timeout if timeout is None else (_seconds(timeout) or self._timeout)
            lock = self._lock
            # One deadline bounds the whole wait: the lock (another thread's wait) and
            # every work after it share `seconds`.
            deadline = None if seconds is None else time.monotonic() + seconds
            if seconds is None:  # mcrdl's timeout bounds the waits, hence this one
                lock.acquire()
            elif not lock.acquire(timeout=seconds):
                raise self._timed_out(CommTimeoutError(
                    f"torch.distributed {self._what} on mcrdl did not complete within "
                    f"wait(timeout={seconds}) s; it is still pending"))
            try:
                if not self._done:
                    self._settle(deadline)
            except CommTimeoutError as exc:
                raise self._timed_out(exc) from None
            finally:
                lock.release()
        if self._error is not None:
            raise self._error
        return True

    def _timed_out(self, exc: CommTimeoutError) -> CommTimeoutError:
        """`exc`, having broken the group: the op stays in flight on every rank that
        posted it, so the group's later ops would no longer match across ranks (as Gloo
        closes its pairs and NCCL aborts its communicator after a timeout)."""
        if self._pg is not None:
            self._pg._break(self._what, exc)
        return exc

    def is_completed(self) -> bool:
        if self._done or self._error is not None:
            return True
        if not self._lock.acquire(blocking=False):  # another thread is waiting on it
            return False
        try:
            if not self._done:
                try:
                    if not all(w.is_completed() for w in self._works):
                        return False
                except BaseException as exc:  # noqa: BLE001 - a failed step: kept
                    self._fail(exc)
                    return True
                try:
                    self._settle(None)  # returns at once: every work is complete
                except CommTimeoutError as exc:  # a work's own timeout, not a wait's: kept
                    self._fail(exc)
            return True
        finally:
            self._lock.release()

    def get_future(self) -> torch.futures.Future:
        with _completer_lock:
            if self._future is not None:
                return self._future
            future = self._future = torch.futures.Future()
        works = self._works
        if self.is_completed():
            if self._error is None:
                future.set_result(self._outputs)
            else:
                future.set_exception(self._error)
        elif self._finish is None and all(type(w) is _CWork for w in works):
            # Settled by whoever takes the one entry of _unsettled (list.pop is atomic):
            # the last completion callback (the one that pops True off _left), a failing
            # one, or the watchdog.
            self._unsettled = [future]
            self._left = [True, *(False for _ in works[1:])]
            self._watched = self._timeout if self._timeout is not None \
                else _watchdog.default_timeout()
            _watchdog.watch(self, self._watched)
            for w in works:
                w.add_done_callback(self._on_done)
        else:
            _completer_pool().submit(self._complete_future)
        return future

    def _on_done(self, error: BaseException | None) -> None:
        """Completion callback of each mcrdl._C.Work (GIL held, any thread)."""
        if error is not None:
            self._settle_future(error)
        elif self._left.pop():
            self._done = True  # no finish step on this path, and every work is complete
            self._settle_future(None)

    def _settle_future(self, error: BaseException | None) -> None:
        try:
            future = self._unsettled.pop()
        except IndexError:
            return  # settled already
        _watchdog.forget(self, self._watched)
        if error is None:
            future.set_result(self._outputs)
        else:
            self._error = error
            future.set_exception(error)

    def _expire(self) -> None:
        """The watchdog's call at the deadline: the CommTimeoutError of the first work
        still pending (wait()'s, and as wait() it fails the backend under mcrdl's
        default timeout) goes to the future."""
        if not self._unsettled:
            return
        try:
            for w in self._works:
                w.time_out(-1.0 if self._timeout is None else self._timeout)
        except CommTimeoutError as exc:
            self._settle_future(self._timed_out(exc))
        except BaseException as exc:  # noqa: BLE001 - handed to the future's waiters
            self._settle_future(exc)

    def _complete_future(self) -> None:
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the future's waiters
            self._error = exc
            self._future.set_exception(exc)
            return
        self._future.set_result(self._outputs)

    def result(self) -> list:
        if not self.is_completed():
            raise RuntimeError(
                f"torch.distributed {self._what} on mcrdl: Work needs to be completed before "
                "calling result(). Should call wait() before result().")
        if self._error is not None:
            raise self._error
        return self._outputs

    def exception(self) -> BaseException | None:
        return self._error

    def is_success(self) -> bool:
        return self._done and self._error is None


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
                 timeout: float | None, finalize_on_shutdown: bool = False):
        super().__init__(rank, size)
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
            raise _c10d_error(exc, family, backend) from None
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
            raise _c10d_error(exc, family, backend) from None
        work = McrdlWork.of(works, outputs, self._timeout, finish, family, self)
        if async_op:
            return work
        work.wait()
        return None

    # -- allreduce: allreduce, allreduce_coalesced -------------------------------------
    def allreduce(self, tensors, opts=None):
        # _post and _op_of written out: the small all-reduce is the call whose overhead
        # matters. Each option is read once (a read of reduceOp builds a ReduceOp).
        if opts is None:
            opts = dist.AllreduceOptions()
        if len(tensors) != 1:
            raise _not_one(tensors, ALLREDUCE)
        op = opts.reduceOp
        try:
            op = _BY_HASH[hash(op)]
        except KeyError:
            op = _reduce_op(op, ALLREDUCE)
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
            raise _c10d_error(exc, ALLREDUCE, backend) from None

    def allreduce_coalesced(self, tensors, opts=None):
        """One all_reduce per dtype, of the tensors packed into one buffer."""
        if opts is None:
            opts = dist.AllreduceCoalescedOptions()
        op = _op_of(opts, "allreduce_coalesced")
        backend, spec = self._routes[ALLREDUCE], OPS["all_reduce"]
        for i, t in enumerate(tensors):  # as mcrdl takes each: the pack would take any
            try:
                validate(spec.call((t, op, self._group, True)), self.size(), self.rank())
            except MCRDLError as exc:
                raise _c10d_error(type(exc)(f"tensors[{i}]: {exc}"), ALLREDUCE,
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
        tensor = _single(tensors, BROADCAST)
        return self._post(BROADCAST, self._api.bcast, (tensor, opts.rootRank), tensors,
                          opts.asyncOp)

    def reduce(self, tensors, opts=None):
        if opts is None:
            opts = dist.ReduceOptions()
        tensor = _single(tensors, REDUCE)
        return self._post(REDUCE, self._api.reduce,
                          (tensor, opts.rootRank, _op_of(opts, REDUCE)), tensors,
                          opts.asyncOp)

    # -- allgather: allgather, all_gather_single (_allgather_base), allgather_coalesced,
    #    all_gather_single_coalesced (allgather_into_tensor_coalesced) -----------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = AllgatherOptions()
        tensor = _single(input_tensors, ALLGATHER)
        outputs = _single(output_tensors, ALLGATHER)
        return self._post(ALLGATHER, self._api.all_gather, (outputs, tensor), outputs,
                          opts.asyncOp)

    def all_gather_single(self, output, input, opts=None):
        if opts is None:
            opts = AllgatherOptions()
        return self._post(ALLGATHER, self._api.all_gather, (_flat(output), _flat(input)),
                          [output], opts.asyncOp)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        if opts is None:
            opts = AllgatherOptions()
        calls = [(outs, t) for outs, t in zip(output_lists, input_tensors, strict=True)]
        return self._post_each(ALLGATHER, self._api.all_gather, calls,
                               [o for outs in output_lists for o in outs], opts.asyncOp)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        if opts is None:
            opts = AllgatherOptions()
        calls = [(_flat(o), _flat(i)) for o, i in zip(outputs, inputs, strict=True)]
        return self._post_each(ALLGATHER, self._api.all_gather, calls, list(outputs),
                               opts.asyncOp)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- gather, scatter -------------------------------------------------------------
    def gather(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = dist.GatherOptions()
        tensor = _single(input_tensors, GATHER)
        outputs = _single(output_tensors, GATHER) if output_tensors else None
        return self._post(GATHER, self._api.gather, (outputs, tensor, opts.rootRank),
                          outputs or [], opts.asyncOp)

    def scatter(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = dist.ScatterOptions()
        tensor = _single(output_tensors, SCATTER)
        inputs = _single(input_tensors, SCATTER) if input_tensors else None
        return self._post(SCATTER, self._api.scatter, (tensor, inputs, opts.rootRank),
                          output_tensors, opts.asyncOp)

    # -- reduce_scatter: reduce_scatter, reduce_scatter_single (_reduce_scatter_base),
    #    reduce_scatter_single_coalesced (reduce_scatter_tensor_coalesced) ------------
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = dist.ReduceScatterOptions()
        tensor = _single(output_tensors, REDUCE_SCATTER)
        inputs = _single(input_tensors, REDUCE_SCATTER)
        return self._post(REDUCE_SCATTER, self._api.reduce_scatter,
                          (tensor, inputs, _op_of(opts, REDUCE_SCATTER)),
                          output_tensors, opts.asyncOp)

    def reduce_scatter_single(self, output, input, opts=None):
        if opts is None:
            opts = dist.ReduceScatterOptions()
        return self._post(REDUCE_SCATTER, self._api.reduce_scatter,
                          (_flat(output), _flat(input),
                           _op_of(opts, REDUCE_SCATTER)),
                          [output], opts.asyncOp)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        if opts is None:
            opts = dist.ReduceScatterOptions()
        op = _op_of(opts, REDUCE_SCATTER)
        calls = [(_flat(o), _flat(i), op) for o, i in zip(outputs, inputs, strict=True)]
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
        tensor = _single(tensors, SEND)
        return self._post(SEND, self._api.send, (tensor, dst, tag), tensors, True)

    def recv(self, tensors, src, tag=0):
        tensor = _single(tensors, RECV)
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
                          _seconds(opts.timeout))

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
        routes = _group_routes(pg_options, self._api, where,
                               base=_pinned_routes(backend, where, self._api.get_backends()))
        group = self._api.new_group(list(ranks))
        if not group.is_member:
            return None
        pg = ProcessGroupMCRDL(self._api, group.rank, group.size, group, routes,
                               _group_timeout(self._api, timeout))
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


def _group_routes(pg_options: object, front, where: str, initialized: list[str] | None = None,
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


def _group_timeout(front, timeout: datetime.timedelta | None) -> float | None:
    """A group's own wait timeout in seconds, None when it is mcrdl's."""
    seconds = explicit_timeout(timeout)
    if seconds is None or seconds == front.current_runtime().timeout:
        return None
    return seconds


def _runtime_timeout(front) -> float:
    runtime = front.current_runtime()
    return runtime.timeout if runtime is not None else front.DEFAULT_TIMEOUT


def _default_group_is_mcrdl() -> bool:
    """Whether torch's default group is an mcrdl one (False before init_process_group)."""
    return isinstance(dist.distributed_c10d._world.default_pg, ProcessGroupMCRDL)


def create(front, options: dist.distributed_c10d._DistributedBackendOptions,
           pg_options: object) -> ProcessGroupMCRDL:
    """The creator torch calls for ``init_process_group("mcrdl")`` (the world) and for
    ``new_group(backend="mcrdl")`` under another default backend (then only the
    members call it, so only a group of every rank can be made). Initializes mcrdl with
    every usable backend unless it is initialized already; the world's explicit
    ``timeout`` becomes mcrdl's, a sub-group's is its own."""
    ranks = list(options.global_ranks_in_group)
    world_timeout = explicit_timeout(options.timeout) if not ranks else None
    owns = not front.is_initialized()
    where = f"new_group({ranks})" if ranks else "init_process_group('mcrdl')"
    if owns:
        # the routes checked against what init() initializes, before it: refused routes
        # leave mcrdl uninitialized (a retry starts clean) with no collective cleanup,
        # which a failure on some ranks only would hold for the whole timeout
        _group_routes(pg_options, front, where, front.available_backends())
        front.init(timeout=world_timeout)
    elif world_timeout is not None:
        front.init(front.get_backends(), timeout=world_timeout)
    world_rank, world_size = front.get_rank(), front.get_size()
    if not ranks:
        if (options.group_rank, options.group_size) != (world_rank, world_size):
            raise BackendUnavailableError(
                f"init_process_group('mcrdl'): torch's rank {options.group_rank} of "
                f"{options.group_size} differs from mcrdl's launch discovery (rank "
                f"{world_rank} of {world_size}); launch with mpiexec, torchrun or srun and "
                "leave rank and world_size to them")
    elif sorted(ranks) != list(range(world_size)):
        # torch called the creator on the members only: a sub-group cannot be made
        if _default_group_is_mcrdl():
            # torch before 2.13 has no new_group hook: it calls the creator on the members
            raise InvalidArgumentError(
                f"new_group(ranks={ranks}): torch {torch.__version__} calls a backend only on "
                "the members of a new group, also when 'mcrdl' is the default group, and mcrdl "
                "creates groups collectively over every rank. Sub-groups of an mcrdl world "
                "need torch >= 2.13, which hands new_group to the default group on every rank: "
                "upgrade torch, or use groups of every rank, or mcrdl's own API "
                "(mcrdl.new_group on every rank) for the sub-group's communication")
        raise InvalidArgumentError(
            f"new_group(ranks={ranks}, backend='mcrdl'): mcrdl creates groups collectively "
            "over every rank, but torch calls a backend only on the members of a new "
            "group when the default group is another backend's. Make 'mcrdl' the default "
            "(init_process_group('mcrdl'): its new_group runs on every rank, torch >= "
            "2.13), or use a group of every rank")
    # checked before the group's collective creation, so that every rank raises alike
    routes = _group_routes(pg_options, front, where)
    group = front.new_group(ranks) if ranks else None
    _watchdog.default_timeout = lambda: _runtime_timeout(front)
    pg = ProcessGroupMCRDL(front, options.group_rank, options.group_size, group, routes,
                           None if group is None else _group_timeout(front, options.timeout),
                           finalize_on_shutdown=owns)
    log.info("mcrdl torch backend: %s on %s: %s", where, front.get_backends(),
             describe(routes))
    return pg
