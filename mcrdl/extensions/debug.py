"""Debug mode (``MCRDL_DEBUG=1``): cross-rank agreement on every collective.

Before each collective, every rank sends its view of the call (op, dtype, element
counts, root, reduce op) as a small int64 vector on a side channel of its own per
(backend, group), waits for the other ranks' views, compares them and only then posts
the op itself. A mismatch raises DesyncError on every rank (each rank sees all views)
with a table of them, instead of a hang or garbage. Each call is one task of the
(backend, group)'s IssueQueue (mcrdl.ordering): posted inline when the queue is idle,
else by the queue's worker, so an async call never blocks its caller on other ranks,
and exchanges follow the ordering rule of the ops themselves: programs that interleave
backends, or groups of one backend, differently on each rank do not deadlock.

The side channel is a duplicated MPI communicator when there is an MPI world, else a
dedicated Gloo process group.
"""

from __future__ import annotations

import contextlib
import datetime
import time

import numpy as np
import torch

from ..bootstrap import mpi_module
from ..errors import BackendUnavailableError, CommTimeoutError, DesyncError
from ..groups import Group, bad_group_error
from ..layers import Layer
from ..ops import DTYPES, OPS, Agreement, Call, Kind, OpSpec, ReduceOp
from ..ordering import LOCAL_ERRORS, IssueQueue
from ..validate import validate
from ..work import ChainedWork, ThreadedWait, poll_until

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


class _Agreement:
    """The side channel of one (backend, group) and the queue its calls are checked and
    posted in."""

    __slots__ = ("channel", "queue", "gname", "calls")

    def __init__(self, channel, queue: IssueQueue, gname: str):
        self.channel, self.queue, self.gname = channel, queue, gname
        self.calls = 0  # collectives checked so far: a call's sequence number


class Debugged(Layer):
    """Wraps a backend: every collective goes through the agreement check.

    The caller validates locally; the call's task on its (backend, group) queue sends
    the signature, completes the exchange and posts the real op only when the views
    agree, so a mismatched call is never sent (Gloo aborts the process on size
    mismatches; MPI may hang) and the backend stays usable after a DesyncError. A timeout
    of the exchange leaves the channel misaligned: the backend then refuses new ops.
    """

    def __init__(self, inner, rt):
        self._bootstrap = rt.bootstrap
        self._timeout_of = rt.timeout_of
        self._size_rank = rt.size_rank
        self._groups: dict[int, _Agreement] = {}  # group id -> (groups this rank is in)
        self._failed: str | None = None  # set with the first timeout
        super().__init__(inner)
        self._make_agreement(rt.world)

    def passthrough(self, spec: OpSpec, forward):
        if spec.p2p:  # matched by tag and peer, not by issue order: nothing to agree on
            return forward

        def call(*args):
            return self._call(spec.call(args), forward)

        return call

    def _make_agreement(self, group: Group) -> None:
        """The side channel (collective over the world) and queue of a new group."""
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
            gname = group.describe()
            queue = IssueQueue(f"debug {self.name} group {gname}", self._timeout_of,
                               (*LOCAL_ERRORS, DesyncError))
            self._groups[group.id] = _Agreement(channel, queue, gname)

    def add_group(self, group: Group) -> None:
        self.inner.add_group(group)
        self._make_agreement(group)

    def synchronize(self, timeout: float) -> None:
        """Post every queued call and complete it, then wait for the backend's ops."""
        deadline = time.monotonic() + timeout
        for agreement in list(self._groups.values()):
            agreement.queue.drain(timeout)
            agreement.queue.complete_all(max(deadline - time.monotonic(), 0.0))
        self.inner.synchronize(max(deadline - time.monotonic(), 0.0))

    def finalize(self) -> None:
        agreements, self._groups = list(self._groups.values()), {}
        for agreement in agreements:
            agreement.queue.close(self._timeout_of())
            agreement.channel.free()
        self.inner.finalize()

    def _call(self, call: Call, forward):
        op, group = call.op, call.group
        if self._failed is not None:
            raise BackendUnavailableError(
                f"{op}: backend '{self.name}' is unusable since {self._failed} (ranks no longer "
                "issue matching operations); finalize and restart the job")
        size, rank = self._size_rank(group)  # non-members and non-groups raise here
        agreement = self._groups.get(0 if group is None else group.id)
        if agreement is None:
            raise bad_group_error(group)
        agreement.calls += 1
        seq = agreement.calls
        try:
            call = validate(call, size, rank)
        except Exception:
            # One signature per call keeps the channel aligned; the others see the error.
            sig = np.full(_HEADER + 2 * size, _LOCAL_ERROR, dtype=np.int64)
            with contextlib.suppress(CommTimeoutError, DesyncError):
                agreement.queue.run_task(lambda: self._agree(op, agreement, sig, seq),
                                         self.name, False)
            raise
        sig = signature(call, size)
        posted = call.replace(async_op=True)

        def post():
            self._agree(op, agreement, sig, seq)
            return ChainedWork([posted.forward(forward)], backend=self.name)

        return agreement.queue.run_task(post, self.name, call.async_op)

    def _agree(self, op: str, agreement: _Agreement, sig: np.ndarray, seq: int) -> None:
        """Exchange `sig` (of call `seq`) with the group and compare every rank's view (a
        task step)."""
        channel = agreement.channel
        handle = channel.post(sig)
        limit = self._timeout_of()
        if not poll_until(lambda: channel.done(handle), limit):
            gone = channel.missing(handle)
            world = [channel.ranks[p] for p in gone]
            self._fail(f"{op} timed out in debug mode")
            raise CommTimeoutError(
                f"{op} on backend '{self.name}' (group {agreement.gname}, sequence number "
                f"{seq}) did not start within "
                f"{limit} s: group rank(s) {gone} (world rank(s) {world}) never called it "
                "(debug mode: their call signature never arrived)")
        views = np.asarray(handle[1])
        bad = disagreement(views)
        if bad is not None:  # nothing was posted: the backend stays usable
            raise DesyncError(f"{op}: ranks disagree on the {bad}:\n"
                              + table(views, agreement.gname, self.name))

    def _fail(self, why: str) -> None:
        self._failed = self._failed or why
        self.inner.mark_failed(why)
