"""Communication logging: the record of what each rank sent and how long it took.

With logging on, a :class:`Logged` wrapper in front of each backend records every call:
operation, resolved backend, group, group size and bytes (the size convention of
mcrdl-bench and the tuning tables: the largest buffer one rank touches) at issue, and
the completion time when the call returns (blocking) or when its Work is waited or
polled and found complete, or at synchronize/finalize (async: the end is when this rank
*observed* completion). Level "call" is what the program called; with fusion or
compression on, level "wire" is what went to the backend (fusion agreements and fused
buffers, compressed size exchanges and payloads).

The reports of the records (summary table, JSON/CSV export, Chrome trace) are
comm_report.py's.

A long run's log stays bounded: per row at most :data:`MAX_SAMPLES` latencies (then a
uniform sample, from which the medians are estimated; count, bytes, min and max stay
exact) and per collective row as many arrivals (then every 2nd, 4th, ... call by issue
index, the same calls on every rank).

Timestamps are this host's clock (time.time_ns at the first call, advanced by
perf_counter_ns), so ranks on one node share a time base; across nodes their skew adds
to the arrival skew.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from ..layers import Layer
from ..ops import OPS, OpSpec
from ..work import ChainedWork
from .config import LoggingConfig


def bucket_of(nbytes: int) -> int:
    """Lower bound of the power-of-two size bucket of `nbytes` (0 for 0)."""
    return 0 if nbytes <= 0 else 1 << (nbytes.bit_length() - 1)


class Record:
    """One logged call."""

    __slots__ = ("level", "op", "backend", "gid", "gsize", "nbytes", "seq", "t0", "t1",
                 "async_op")

    def __init__(self, level, op, backend, gid, gsize, nbytes, seq, t0, async_op):
        self.level, self.op, self.backend, self.gid = level, op, backend, gid
        self.gsize, self.nbytes, self.seq, self.t0 = gsize, nbytes, seq, t0
        self.t1 = 0
        self.async_op = async_op


#: Latencies kept per row, and collective arrivals kept per (level, backend, group, op,
#: group size): a long run's log must not grow without bound (a Python int per call is
#: about 36 bytes, an arrival about 100). Past the cap the latencies are a uniform
#: sample (reservoir sampling; count, min and max stay exact) and the arrivals keep the
#: calls whose issue index is a multiple of a stride that doubles at each overflow: the
#: index is the same on every rank, so every rank keeps the same calls and the skew
#: still matches them across ranks.
MAX_SAMPLES = 1 << 16


class _Row:
    __slots__ = ("count", "bytes", "lat_ns", "completed", "lat_min", "lat_max")

    def __init__(self):
        self.count = 0
        self.bytes = 0
        self.lat_ns: list[int] = []  # every latency, or a uniform sample of MAX_SAMPLES
        self.completed = 0
        self.lat_min = self.lat_max = 0


class CommLogger:
    """The records of this process (one logger per process, see :func:`logger`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.runtime = None
        self.rank = 0
        self.trace = True
        self.max_events = 1_000_000
        self.epoch_ns = time.time_ns()
        self.perf0_ns = time.perf_counter_ns()
        self.reset()

    def reset(self) -> None:
        """Forget every record (statistics, events, arrivals)."""
        with self._lock:
            self.rows: dict[tuple, _Row] = {}
            self.events: list[Record] = []
            self.dropped = 0
            #: (level, backend, group id, op, group size) -> [(issue index, issue time,
            #: size bucket)]: collectives are matched across ranks by their issue index
            self.arrivals: dict[tuple, list[tuple[int, int, int]]] = {}
            self.strides: dict[tuple, int] = {}  # arrivals kept: index % stride == 0
            self.sampler = random.Random(0)
            self.seqs: dict[tuple, int] = {}
            #: collectives issued per (level, backend, group id): the arrivals' index,
            #: which p2p calls (as many on a rank as it sends or receives) must not shift
            self.coll_seqs: dict[tuple, int] = {}
            self.pending: list[Record] = []

    def attach(self, runtime) -> None:
        """The runtime whose ranks :func:`summary` and the exports gather (None: none)."""
        self.runtime = runtime

    def configure(self, config: LoggingConfig, rank: int) -> None:
        self.rank = rank
        self.trace = config.trace
        self.max_events = config.max_events

    # -- recording (hot path when logging is on) -----------------------------------
    def start(self, level: str, op: str, backend: str, group, gsize: int, nbytes: int,
              t0: int, async_op: bool) -> Record:
        gid = 0 if group is None else group.id
        with self._lock:
            lane = (level, backend, gid)
            seq = self.seqs.get(lane, 0) + 1
            self.seqs[lane] = seq
            rec = Record(level, op, backend, gid, gsize, nbytes, seq, t0, async_op)
            key = (level, op, backend, bucket_of(nbytes), gsize)
            row = self.rows.get(key)
            if row is None:
                row = self.rows[key] = _Row()
            row.count += 1
            row.bytes += nbytes
            if not OPS[op].p2p:
                cseq = self.coll_seqs.get(lane, 0) + 1
                self.coll_seqs[lane] = cseq
                self._arrive((level, backend, gid, op, gsize), cseq, t0, key[3])
            if async_op:
                if len(self.pending) >= 1024:
                    self.pending = [r for r in self.pending if not r.t1]
                self.pending.append(rec)
        return rec

    def finish(self, rec: Record, t1: int) -> None:
        """Close `rec` at time `t1` (once: later calls are ignored)."""
        with self._lock:
            if rec.t1:
                return
            rec.t1 = t1
            row = self.rows[(rec.level, rec.op, rec.backend, bucket_of(rec.nbytes), rec.gsize)]
            lat = t1 - rec.t0
            row.completed += 1
            if row.completed == 1 or lat < row.lat_min:
                row.lat_min = lat
            if row.completed == 1 or lat > row.lat_max:
                row.lat_max = lat
            if len(row.lat_ns) < MAX_SAMPLES:
                row.lat_ns.append(lat)
            else:  # reservoir sampling: each latency so far is kept with equal chance
                j = self.sampler.randrange(row.completed)
                if j < MAX_SAMPLES:
                    row.lat_ns[j] = lat
            if self.trace:
                if len(self.events) < self.max_events:
                    self.events.append(rec)
                else:
                    self.dropped += 1

    def _arrive(self, key: tuple, cseq: int, t0: int, bucket: int) -> None:
        """Keep collective `cseq`'s issue time (with the lock held; see MAX_SAMPLES)."""
        stride = self.strides.get(key, 1)
        if cseq % stride:
            return
        kept = self.arrivals.setdefault(key, [])
        kept.append((cseq, t0, bucket))
        if len(kept) > MAX_SAMPLES:
            stride *= 2
            self.strides[key] = stride
            kept[:] = [a for a in kept if a[0] % stride == 0]

    def finish_pending(self, backends: set | None = None) -> None:
        """Close the records of async calls that completed without being observed
        (after synchronize/finalize): their end is now."""
        now = time.perf_counter_ns()
        with self._lock:
            pending, self.pending = self.pending, []
        keep = []
        for rec in pending:
            if rec.t1:
                continue
            if backends is None or rec.backend in backends:
                self.finish(rec, now)
            else:
                keep.append(rec)
        with self._lock:
            self.pending.extend(keep)

    def host_ns(self, t_ns: int) -> int:
        """A perf_counter_ns time as nanoseconds of this host's clock (an int: as a float
        in microseconds since 1970 it would keep only a quarter microsecond)."""
        return self.epoch_ns + (t_ns - self.perf0_ns)

    # -- summaries -------------------------------------------------------------------
    def records(self) -> list[Record]:
        """The records kept for the trace, in the order the calls were issued."""
        with self._lock:
            return sorted(self.events, key=lambda r: r.t0)

    def local_view(self) -> dict:
        """This rank's statistics, in a form other ranks can merge (pickled by gather)."""
        with self._lock:
            rows = {k: (r.count, r.bytes, list(r.lat_ns), r.completed, r.lat_min, r.lat_max)
                    for k, r in self.rows.items()}
            arrivals = {k: [(s, self.host_ns(t), b) for s, t, b in v]
                        for k, v in self.arrivals.items()}
        return {"rank": self.rank, "rows": rows, "arrivals": arrivals}


_LOGGER: CommLogger | None = None
_LOGGER_LOCK = threading.Lock()


def logger() -> CommLogger:
    """The process's logger (created on first use)."""
    global _LOGGER
    if _LOGGER is None:
        with _LOGGER_LOCK:
            if _LOGGER is None:
                _LOGGER = CommLogger()
    return _LOGGER


class Logged(Layer):
    """The layer recording every call in the logger (see the module docstring)."""

    def __init__(self, inner, log: CommLogger, level: str, world_size: int):
        self._log, self._level, self._world_size = log, level, world_size
        super().__init__(inner)

    def passthrough(self, spec: OpSpec, forward: Callable) -> Callable:
        log, level, name, world_size = self._log, self._level, self.name, self._world_size
        perf = time.perf_counter_ns

        def call(*args):
            t0 = perf()
            result = forward(*args)
            c = spec.call(args)
            gsize = world_size if c.group is None else c.group.size
            rec = log.start(level, c.op, name, c.group, gsize, c.nbytes(gsize), t0, c.async_op)
            if not c.async_op:
                log.finish(rec, perf())
                return result
            # the record ends when this rank sees the call complete
            return ChainedWork([result], lambda: log.finish(rec, perf()),
                               getattr(result, "backend", name))

        return call

    def synchronize(self, timeout: float) -> None:
        self.inner.synchronize(timeout)
        self._log.finish_pending({self.name})


def reset() -> None:
    """Forget every logged call."""
    logger().reset()
