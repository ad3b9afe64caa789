"""Debug mode (``MCRDL_DEBUG=1``): cross-rank agreement on every collective.

Before each collective, every rank posts its view of the call (op, dtype, element
counts, root, reduce op) as a small int64 vector on a side channel of its own per
(backend, group); the debug lane of that (backend, group) completes the exchange,
compares the views and only then posts the op itself. A mismatch raises DesyncError on
every rank (each rank sees all views) with a table of them, instead of a hang or
garbage. Exchange and lane are per (backend, group), so they follow the ordering rule
of the ops themselves: programs that interleave backends, or groups of one backend,
differently on each rank do not deadlock.

The side channel is a duplicated MPI communicator when there is an MPI world, else a
dedicated Gloo process group.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable

import numpy as np
import torch

from ..bootstrap import mpi_module
from ..errors import BackendUnavailableError, CommTimeoutError, DesyncError
from ..groups import Group, bad_group_error
from ..ops import DTYPES, OPS, Agreement, Call, Kind, OpSpec, ReduceOp
from ..validate import validate
from ..work import ThreadedWait, Work, poll_until
from .base import Layer

_OP_NAMES = tuple(OPS)  # a signature's op code is the operation's index here
_DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
_HEADER = 5  # op, dtype, count, root, reduce op
_LOCAL_ERROR = -2  # op code of a rank whose call raised before anything was sent


def _numel(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_numel(x) for x in t)
    return t.numel() if isinstance(t, torch.Tensor) else -1


def _dtype(t) -> int:
    if isinstance(t, (list, tuple)):
        t = t[0] if t else None
    return _DTYPE_CODE.get(getattr(t, "dtype", None), -1)


def _rows(t: torch.Tensor, splits, size: int) -> list[int]:
    """Element counts per peer of an all_to_all_single buffer."""
    if t.dim() == 0:
        return [0] * size
    row = 1
    for d in t.shape[1:]:
        row *= d
    if splits is None:
        return [t.shape[0] // size * row] * size
    return [int(s) * row for s in splits]


def _peer_counts(call: Call, size: int) -> tuple[list[int], list[int]]:
    """(elements sent to, elements expected from) each peer of an EXCHANGE call."""
    spec = call.spec
    if spec.param(Kind.SPLITS):
        return (_rows(call["input"], call["input_split_sizes"], size),
                _rows(call["output"], call["output_split_sizes"], size))
    if spec.param(Kind.TENSOR_LIST):
        return ([_numel(t) for t in call["input_list"]],
                [_numel(t) for t in call["output_list"]])
    return list(call["send_counts"]), list(call["recv_counts"])


def signature(call: Call, size: int) -> np.ndarray:
    """This rank's view of a call: header + per-peer send and receive counts."""
    spec = call.spec
    sig = np.full(_HEADER + 2 * size, -1, dtype=np.int64)
    payload = call[spec.payload] if spec.payload else None
    count = 0 if payload is None else _numel(payload)
    root = call[spec.root] if spec.root else None
    rop = call[spec.reduce_op] if spec.reduce_op else None
    send = recv = None
    if spec.agreement is Agreement.EXCHANGE:
        send, recv = _peer_counts(call, size)
    elif spec.agreement is Agreement.VECTOR:
        recv = list(call[spec.param(Kind.COUNTS)])
    sig[:_HEADER] = (_OP_NAMES.index(spec.name), _dtype(payload), count,
                     -1 if root is None else int(root), -1 if rop is None else int(rop))
    if send is not None and len(send) == size:
        sig[_HEADER:_HEADER + size] = send
    if recv is not None and len(recv) == size:
        sig[_HEADER + size:] = recv
    return sig


def disagreement(views: np.ndarray) -> str | None:
    """What the ranks' views (one row per group rank) disagree on, or None."""
    size = views.shape[0]
    head = views[:, :_HEADER]
    bad = [r for r in range(size) if head[r, 0] == _LOCAL_ERROR]
    if len(bad) == size:
        return None  # every rank rejected its arguments: nothing was sent anywhere
    if bad:
        return f"call: rank(s) {bad} rejected their arguments locally (see their errors)"
    for col, what in ((0, "operation"), (1, "dtype"), (3, "root"), (4, "reduce op")):
        if len(set(head[:, col].tolist())) > 1:
            return what
    agreement = OPS[_OP_NAMES[int(head[0, 0])]].agreement
    if agreement is Agreement.UNIFORM and len(set(head[:, 2].tolist())) > 1:
        return "element count"
    send, recv = views[:, _HEADER:_HEADER + size], views[:, _HEADER + size:]
    if agreement is Agreement.EXCHANGE and not np.array_equal(send, recv.T):
        return "counts (what rank i sends to j differs from what j expects from i)"
    if agreement is Agreement.VECTOR:
        if any(not np.array_equal(recv[0], recv[r]) for r in range(size)):
            return "counts vector"
        if not np.array_equal(recv[0], head[:, 2]):
            return "counts (counts[i] differs from rank i's element count)"
    return None


def table(views: np.ndarray, group: str, backend: str) -> str:
    size = views.shape[0]
    rows = [f"{'rank':>4}  {'op':<18} {'dtype':<15} {'count':>9} {'root':>5} {'reduce op':<9} "
            "send/recv counts"]
    for r in range(size):
        op, dt, count, root, rop = (int(x) for x in views[r, :_HEADER])
        name = _OP_NAMES[op] if 0 <= op < len(_OP_NAMES) else "<raised locally>"
        dname = str(DTYPES[dt]) if 0 <= dt < len(DTYPES) else "-"
        rname = ReduceOp(rop).name if 0 <= rop <= 7 else "-"
        extra = ""
        if (views[r, _HEADER:] >= 0).any():
            extra = (f"{views[r, _HEADER:_HEADER + size].tolist()}/"
                     f"{views[r, _HEADER + size:].tolist()}")
        rows.append(f"{r:>4}  {name:<18} {dname:<15} {count:>9} "
                    f"{root if root >= 0 else '-':>5} {rname:<9} {extra}")
    return f"backend '{backend}', group {group}:\n" + "\n".join(rows)


class _MPIChannel:
    """Signatures go point to point (not an allgather), so a rank that times out knows
    exactly whose signature never arrived."""

    def __init__(self, comm, ranks: tuple[int, ...]):
        self.comm, self.ranks = comm, ranks
        self.me, self.size = comm.Get_rank(), comm.Get_size()

    def post(self, sig: np.ndarray):
        views = np.empty((self.size, sig.size), dtype=np.int64)
        views[self.me] = sig
        peers = [p for p in range(self.size) if p != self.me]
        recvs = {p: self.comm.Irecv(views[p], source=p, tag=1) for p in peers}
        sends = [self.comm.Isend(sig, dest=p, tag=1) for p in peers]
        return (recvs, sends), views

    def done(self, handle) -> bool:
        recvs, sends = handle[0]
        return all(r.Test() for r in recvs.values()) and all(s.Test() for s in sends)

    def missing(self, handle) -> list[int]:
        """Group ranks whose signature has not arrived."""
        return [p for p, r in handle[0][0].items() if not r.Test()]

    def free(self) -> None:
        self.comm.Free()


class _GlooChannel:
    """The same exchange over a dedicated Gloo process group (no MPI world). Gloo's send
    and recv complete only through a plain wait(), so each is waited on a thread of its
    own (:class:`ThreadedWait`); a failed wait (Gloo's own timeout) never counts as
    arrived."""

    def __init__(self, pg, rank: int, ranks: tuple[int, ...]):
        self.pg, self.me, self.ranks, self.size = pg, rank, ranks, len(ranks)

    def post(self, sig: np.ndarray):
        views = torch.empty((self.size, sig.size), dtype=torch.int64)
        views[self.me] = torch.from_numpy(sig)
        peers = [p for p in range(self.size) if p != self.me]
        recvs = {p: ThreadedWait([self.pg.recv([views[p]], p, 1)], "mcrdl-debug-recv")
                 for p in peers}
        sends = ThreadedWait([self.pg.send([views[self.me]], p, 1) for p in peers],
                             "mcrdl-debug-send")
        return (recvs, sends), views

    def done(self, handle) -> bool:
        recvs, sends = handle[0]
        return sends.succeeded() and all(w.succeeded() for w in recvs.values())

    def missing(self, handle) -> list[int]:
        return [p for p, w in handle[0][0].items() if not w.succeeded()]

    def free(self) -> None:
        pass


class _Checked:
    """One collective in debug mode: its exchange, the deferred post, the outcome."""

    __slots__ = ("op", "group", "channel", "handle", "post", "work", "error", "posted")

    def __init__(self, op, group, channel, handle, post):
        self.op, self.group, self.channel, self.handle, self.post = op, group, channel, handle, post
        self.work = None
        self.error: BaseException | None = None
        self.posted = threading.Event()


class _Lane:
    """The debug lane of one (backend, group): its side channel, and a thread (started
    on first use) that checks each call's views in issue order, then posts the call."""

    def __init__(self, channel, backend: str, gid: int, timeout_of: Callable[[], float],
                 fail: Callable[[str], None]):
        self.channel = channel
        self._backend, self._gid = backend, gid
        self._timeout_of, self._fail = timeout_of, fail
        self._queue: queue.Queue[_Checked | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, call: _Checked) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name=f"mcrdl-debug-{self._backend}-{self._gid}",
                        daemon=True)
                    self._thread.start()
        self._queue.put(call)

    def stop(self, timeout: float) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
        self.channel.free()

    def _run(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            try:
                limit = self._timeout_of()
                if not poll_until(lambda c=call: c.channel.done(c.handle), limit):
                    gone = call.channel.missing(call.handle)
                    world = [call.channel.ranks[p] for p in gone]
                    self._fail(f"{call.op} timed out in debug mode")
                    raise CommTimeoutError(
                        f"{call.op} on backend '{self._backend}' (group {call.group}) did not "
                        f"start within {limit} s: group rank(s) {gone} (world rank(s) "
                        f"{world}) never called it (debug mode: their call signature "
                        "never arrived)")
                views = np.asarray(call.handle[1])
                bad = disagreement(views)
                if bad is not None:  # nothing was posted: the backend stays usable
                    raise DesyncError(f"{call.op}: ranks disagree on the {bad}:\n"
                                      + table(views, call.group, self._backend))
                if call.post is not None:
                    call.work = call.post()
            except BaseException as exc:  # delivered to the waiting caller
                call.error = exc
            finally:
                call.posted.set()


class DebugWork(Work):
    """Waits for the debug lane to have checked and posted the call, then for the op."""

    __slots__ = ("_call", "backend", "_timeout", "_what")

    def __init__(self, call: _Checked, backend: str, timeout: float, what: str):
        self._call, self.backend, self._timeout, self._what = call, backend, timeout, what

    def wait(self, timeout: float | None = None) -> bool:
        limit = self._timeout if timeout is None else timeout
        # A little longer than the lane's own deadline, so its precise error wins.
        if not self._call.posted.wait(limit + 2.0):
            raise CommTimeoutError(f"{self._what} did not pass the debug agreement check "
                                   f"within {limit} s: a rank of the group never called it")
        if self._call.error is not None:
            raise self._call.error
        w = self._call.work
        return w.wait(timeout) if w is not None else True

    def is_completed(self) -> bool:
        if not self._call.posted.is_set():
            return False
        if self._call.error is not None:
            raise self._call.error
        return self._call.work is None or self._call.work.is_completed()


class Debugged(Layer):
    """Wraps a backend: every collective goes through the agreement check.

    The caller validates locally and posts its signature; the debug lane of the call's
    (backend, group) completes each exchange in issue order and posts the real op only
    when the views agree, so a mismatched call is never sent (Gloo aborts the process on
    size mismatches; MPI may hang) and the backend stays usable after a DesyncError. A
    timeout of the exchange leaves the channel misaligned: the backend then refuses new
    ops.
    """

    def __init__(self, inner, rt):
        self._bootstrap = rt.bootstrap
        self._timeout_of = rt.timeout_of
        self._size_rank = rt.size_rank
        self._lanes: dict[int, _Lane] = {}  # group id -> lane (groups this rank is in)
        self._failed: str | None = None  # set with the first timeout or desync
        self._pending: list[_Checked] = []  # calls not yet known to be posted
        super().__init__(inner)
        self._make_lane(rt.world)

    def passthrough(self, spec: OpSpec, forward):
        if spec.p2p:  # matched by tag and peer, not by issue order: nothing to agree on
            return forward

        def call(*args):
            return self._call(spec.call(args), forward)

        return call

    def _make_lane(self, group: Group) -> None:
        """The side channel (collective over the world) and lane of a new group."""
        boot = self._bootstrap
        channel = None
        if boot.info.mpi_world:
            MPI = mpi_module()
            color = 0 if group.is_member else MPI.UNDEFINED
            comm = MPI.COMM_WORLD.Split(color, max(group.rank, 0))
            if group.is_member:
                channel = _MPIChannel(comm, group.ranks)
        elif group.is_member:
            import torch.distributed as dist

            store = dist.PrefixStore(f"debug/{self.name}/{group.id}", boot.store())
            pg = dist.ProcessGroupGloo(store, group.rank, group.size,
                                       datetime.timedelta(seconds=self._timeout_of()))
            channel = _GlooChannel(pg, group.rank, group.ranks)
        if channel is not None:
            self._lanes[group.id] = _Lane(channel, self.name, group.id, self._timeout_of,
                                          self._fail)

    def add_group(self, group: Group) -> None:
        self.inner.add_group(group)
        self._make_lane(group)

    def synchronize(self, timeout: float) -> None:
        """Wait until the debug lane posted every call so far, then for the backend's ops."""
        pending, self._pending = self._pending, []
        for call in pending:
            if not call.posted.wait(timeout + 2.0):
                raise CommTimeoutError(f"synchronize: {call.op} on backend '{self.name}' "
                                       f"(group {call.group}) did not pass the debug "
                                       f"agreement check within {timeout} s")
        self.inner.synchronize(timeout)

    def finalize(self) -> None:
        lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.stop(self._timeout_of())
        self.inner.finalize()

    def _call(self, call: Call, forward):
        op, group = call.op, call.group
        if self._failed is not None:
            raise BackendUnavailableError(
                f"{op}: backend '{self.name}' is unusable since {self._failed} (ranks no longer "
                "issue matching operations); finalize and restart the job")
        size, rank = self._size_rank(group)  # non-members and non-groups raise here
        lane = self._lanes.get(0 if group is None else group.id)
        if lane is None:
            raise bad_group_error(group)
        channel = lane.channel
        gname = "world" if group is None else group.describe()
        what = f"{op} on backend '{self.name}' (group {gname})"
        try:
            call = validate(call, size, rank)
        except Exception:
            # One signature per call keeps the channel aligned; the others see the error.
            sig = np.full(_HEADER + 2 * size, _LOCAL_ERROR, dtype=np.int64)
            checked = _Checked(op, gname, channel, channel.post(sig), None)
            lane.submit(checked)
            checked.posted.wait(self._timeout_of())
            raise
        posted = call.replace(async_op=True)
        checked = _Checked(op, gname, channel, channel.post(signature(call, size)),
                           lambda: posted.forward(forward))
        lane.submit(checked)
        self._pending = [p for p in self._pending if not p.posted.is_set()]
        self._pending.append(checked)
        work = DebugWork(checked, self.name, self._timeout_of(), what)
        if call.async_op:
            return work
        work.wait()
        return None

    def _fail(self, why: str) -> None:
        self._failed = self._failed or why
        self.inner.mark_failed(why)
