"""Set-up traffic between ranks: object collectives (init, new_group, the public
``mcrdl.all_gather_object`` / ``broadcast_object``) and the TCP store that Gloo (and
third-party backends) rendezvous on. Main thread only; never on the hot path.

Objects are pickled and moved as bytes over the MPI world when there is one (its own
duplicated communicators, nonblocking calls polled under the timeout), else over the
TCP store (whose own timeout applies). Every wait is bounded: a rank that never joins
an object collective makes the others raise CommTimeoutError.
"""

from __future__ import annotations

import atexit
import datetime
import ipaddress
import os
import pickle
import socket
import sys
import time
import weakref

import numpy as np

from .errors import BackendUnavailableError, CommTimeoutError, DesyncError, InvalidArgumentError
from .groups import Group, bad_group_error
from .launch import LaunchInfo, detect, node_cores_for_ranks, node_id, oversubscribed

# MPICH's shared-memory ("release_gather") blocking bcast, barrier, allreduce and reduce
# are several times faster than its point-to-point algorithms at small sizes, but its
# built-in selection (maint/tuning/coll/ch4/posix_generic.json) takes them only when MPI
# is not initialized with MPI_THREAD_MULTIPLE ("is_multi_threaded=no"), which mcrdl's lanes
# need. mcrdl/tuning/mpich_posix_coll.json is that selection without the condition up to
# the measured crossovers, handed to MPICH through its CVAR before MPI_Init: allreduce
# and reduce up to 4 KiB, bcast up to 16 KiB at 2 ranks a node, every size on more. Above
# them it keeps MPICH's own tree (the condition fails under MULTIPLE, and MPICH runs its
# generic algorithms, 1.3-4x faster there: docs/performance.md). Sound because under
# ch4's default per-VCI locking a thread waiting inside one of these collectives holds no
# MPICH lock (other threads' MPI calls proceed), and the algorithms' state is per
# communicator, which MPI already forbids two concurrent collectives on (mcrdl's Issuer
# orders them). A value the user set wins; the empty string restores MPICH's own
# selection. Other MPI libraries ignore the variable. Only when the node's ranks fit its
# cores: these algorithms spin on shared memory, and a rank spinning while the peer it
# waits for is descheduled costs whole time slices (4 ranks on 2 cores: 8 B all_reduce
# 6.8 ms against 0.3 ms, 16 MiB 16.8 s against 20 ms).
MPICH_POSIX_COLL_CVAR = "MPIR_CVAR_CH4_POSIX_COLL_SELECTION_TUNING_JSON_FILE"
# MPICH reads the variable in MPI_Init only, and a program may initialize MPI itself
# before mcrdl.init (`from mpi4py import MPI` after `import mcrdl`): mcrdl sets it when it
# is imported (select_mpich_collectives). Under MPI_THREAD_MULTIPLE nothing restores the
# fast path later: the csel tree is built from the file in MPI_Init, communicators prune
# it when made, and forcing the algorithm through its MPI_T control variable
# (MPIR_CVAR_ALLREDUCE_POSIX_INTRA_ALGORITHM=release_gather) falls back to the generic
# algorithm when the library is multi-threaded (src/mpid/ch4/shm/posix/posix_coll.h:
# MPII_COLLECTIVE_FALLBACK_CHECK(!MPIR_IS_THREADED ...)). init() warns then.
# MCRDL_MPICH_SELECTION holds the value mcrdl set, so that a child process (mpiexec from
# a test) tells it from a value its user set, and decides for its own node again.
_MCRDL_SET = "MCRDL_MPICH_SELECTION"


def mpich_posix_coll_json() -> str:
    """The path of the shipped MPICH shared-memory collective selection (see above)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning",
                        "mpich_posix_coll.json")


def mpich_selection_default(local_size: int, cores: int) -> str | None:
    """The value mcrdl gives MPICH_POSIX_COLL_CVAR for a node running `local_size` ranks
    on `cores` cores (None: leave MPICH's own selection); see above."""
    return None if oversubscribed(local_size, cores) else mpich_posix_coll_json()


def select_mpich_collectives() -> None:
    """Give MPICH mcrdl's shared-memory selection (mpich_selection_default) unless MPI may
    already be initialized (mpi4py.MPI imported) or the user set the variable: at `import
    mcrdl`, and again before mcrdl initializes MPI. A value an earlier mcrdl (a parent
    process) set is decided again here, for this node's ranks."""
    if "mpi4py.MPI" in sys.modules:
        return
    env = os.environ
    value = env.get(MPICH_POSIX_COLL_CVAR)
    if value is not None and value != env.get(_MCRDL_SET):
        return  # the user's
    default = mpich_selection_default(detect().local_size, node_cores_for_ranks())
    if default is None:
        for key in (MPICH_POSIX_COLL_CVAR, _MCRDL_SET):
            env.pop(key, None)
    else:
        env[MPICH_POSIX_COLL_CVAR] = env[_MCRDL_SET] = default


def mpich_selection_is_users() -> bool:
    """Whether MPICH_POSIX_COLL_CVAR holds a value the user set (not mcrdl)."""
    value = os.environ.get(MPICH_POSIX_COLL_CVAR)
    return value is not None and value != os.environ.get(_MCRDL_SET)


#: Whether mcrdl initialized MPI (imported mpi4py.MPI first); None before it asked.
initialized_mpi: bool | None = None


def mpi_module():
    """mpi4py's MPI module, initialized with MPI_THREAD_MULTIPLE (lanes need it)."""
    global initialized_mpi
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.thread_level = "multiple"
        select_mpich_collectives()
        atexit.register(_before_mpi_finalize)  # runs before mpi4py's MPI_Finalize
        initialized_mpi = True
    elif initialized_mpi is None:
        initialized_mpi = False
    from mpi4py import MPI

    if not MPI.Is_initialized():
        raise BackendUnavailableError(
            "mpi4py was imported with rc.initialize=False and MPI is not initialized; "
            "let mcrdl initialize MPI or call MPI.Init_thread(MPI.THREAD_MULTIPLE) first"
        )
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise BackendUnavailableError(
            "MPI was initialized without MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level was "
            "changed before importing mpi4py.MPI); mcrdl's lanes need it: import mcrdl "
            "before mpi4py.MPI or leave rc.thread_level at 'multiple'"
        )
    return MPI


#: The lanes whose threads make MPI calls (the mpi backends'), stopped at exit.
_MPI_LANES: weakref.WeakSet = weakref.WeakSet()


def track_mpi_lane(lane) -> None:
    """Have `lane` (an ``_C.Lane`` whose thread calls MPI) stopped at exit, before MPI
    is finalized, should the program end without ``mcrdl.finalize()``."""
    _MPI_LANES.add(lane)


def _before_mpi_finalize() -> None:
    """At exit, before mpi4py finalizes MPI: end the job if an MPI call cannot end
    (_abort_if_mpi_busy), else stop the lanes still polling MPI. A program that ends
    without mcrdl.finalize() (an uncaught CommTimeoutError, sys.exit) with an op in
    flight left its lane thread testing requests under and after MPI_Finalize, which
    crashed the process (SIGSEGV in the progress engine)."""
    _abort_if_mpi_busy()
    for lane in list(_MPI_LANES):
        lane.shutdown("the process is exiting without mcrdl.finalize()", 0.0)


def _abort_if_mpi_busy(grace: float = 1.0) -> None:
    """At exit, before MPI is finalized: an MPI call still running on one of mcrdl's
    issue threads after `grace` seconds is a blocking collective that a rank never
    joined (an async call of the blocking variant; its wait raised CommTimeoutError).
    It cannot be interrupted, and MPI_Finalize under it crashes the process (MPICH's
    progress engine is torn down beneath the call), so end the job with MPI_Abort."""
    from . import _C

    deadline = time.monotonic() + grace
    while _C.issuer_tasks_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    running = _C.issuer_tasks_running()
    mpi = sys.modules.get("mpi4py.MPI")
    if not running or mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    sys.stderr.write(
        f"mcrdl: {running} MPI call(s) still running at exit on an issue thread: a blocking "
        "collective that a rank never joined (its wait raised CommTimeoutError). MPI cannot "
        "be finalized under it; ending the job with MPI_Abort\n")
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(0.3)  # the launcher forwards what was printed before the abort's kill
    mpi.COMM_WORLD.Abort(1)


#: What an object collective is for, when mcrdl makes it (the user's: ""): each rank's
#: header carries the index, so that a rank whose object collectives went out of step
#: with the others' (one skipped after catching an error) is told, not handed the object
#: of another call. Names only: the same list on every rank.
PURPOSES = ("", "init", "new_group", "the tuning table", "the node ids", "the mpi backend",
            "finalize", "the store's address")
_ALL_GATHER, _BCAST = 1, 2


class Bootstrap:
    """Object collectives over the world and the groups of :meth:`add_group`.

    On MPI every object collective starts with an all_gather of each member's header
    (the group's object collective number, the op, src, purpose, byte count): members
    that disagree all raise DesyncError before any payload moves. A timeout, or a failure
    partway through one, makes the group's object collectives refuse from then on (an
    abandoned MPI request would be matched by the next call)."""

    def __init__(self, info: LaunchInfo, timeout: float):
        self.info = info
        self.timeout = timeout
        self._comms: dict[int, object] = {}  # group id -> MPI communicator (members only)
        self._seqs: dict[int, int] = {}  # group id -> object collectives so far (store)
        self._written: dict[int, list[str]] = {}  # group id -> this rank's live store keys
        self._broken: dict[int, str] = {}  # group id -> why its object collectives refuse
        self._store = None
        self._session = ""  # which session of a launcher's store (_make_store), for errors
        self._single_node: bool | None = None  # single_node(), once asked
        #: whether a backend on MPI warned of an oversubscribed node (once an init)
        self.warned_oversubscribed = False
        if info.mpi_world:
            self._comms[0] = self._dup_world()
        self.world = Group(range(self.size), self.rank, 0)
        self._groups: dict[int, Group] = {0: self.world}

    def _dup_world(self):
        """COMM_WORLD duplicated within the timeout (the first collective of init): a rank
        that never calls init, or calls it too late, gives the others CommTimeoutError
        instead of a wait without end in MPI_Comm_dup. Once every rank is past it, the
        blocking collectives of the rest of init have every rank in init."""
        world = mpi_module().COMM_WORLD
        try:
            comm, request = world.Idup()
        except NotImplementedError:  # an MPI before 3.0: no bound
            return world.Dup()
        self._wait([request], "init", Group(range(world.Get_size()), world.Get_rank(), 0))
        return comm

    @property
    def mpi(self) -> bool:
        return self.info.mpi_world

    @property
    def rank(self) -> int:
        comm = self._comms.get(0)
        return comm.Get_rank() if comm is not None else self.info.rank

    @property
    def size(self) -> int:
        comm = self._comms.get(0)
        return comm.Get_size() if comm is not None else self.info.size

    def add_group(self, group: Group) -> None:
        """Make `group` usable for object collectives (collective over the world)."""
        self._groups[group.id] = group
        if self.mpi:
            MPI = mpi_module()
            comm = self._comms[0].Split(0 if group.is_member else MPI.UNDEFINED,
                                        max(group.rank, 0))
            if group.is_member:
                self._comms[group.id] = comm

    def single_node(self) -> bool:
        """Whether every rank of the world runs on this node, by node id: the launcher's
        local size is missing under some launchers and then reads as the world's.
        Collective the first time, then cached; every rank asks at the same points (init
        builds the same backends on every rank)."""
        if self._single_node is None:
            self._single_node = self.size == 1 or len(set(
                self.all_gather_object(node_id(), purpose="the node ids"))) == 1
        return self._single_node

    # -- object collectives -------------------------------------------------------------
    def all_gather_object(self, obj: object, group: Group | None = None,
                          purpose: str = "") -> list:
        """Every member's `obj`, in group rank order (collective over the group).
        `purpose`: one of PURPOSES, for mcrdl's own calls."""
        g = self._member_group(group, "all_gather_object")
        data = pickle.dumps(obj)
        if self.mpi:
            blocks = self._guarded(g, "all_gather_object",
                                   lambda: self._mpi_all_gather(g, data, purpose))
            return [_unpickle(b, "all_gather_object", g) for b in blocks]
        seq = self._next(g)
        store = self.store()
        key = f"obj/{g.id}/{seq}/{g.rank}"
        store.set(key, data)
        out = [pickle.loads(self._store_get(store, f"obj/{g.id}/{seq}/{r}", g, seq,
                                            "all_gather_object"))
               for r in range(g.size)]
        # Every member has written this op's key, so every member has read all it needed
        # of the group's earlier ops: this rank's keys of those go (the store, on rank 0
        # or torchrun's agent, would otherwise keep every object for the whole job).
        written = self._written.setdefault(g.id, [])
        for old in written:
            store.delete_key(old)
        written[:] = [key]
        return out

    def broadcast_object(self, obj: object, src: int = 0, group: Group | None = None,
                         purpose: str = "") -> object:
        """`obj` of group rank `src` on every member (collective over the group).
        `purpose`: one of PURPOSES, for mcrdl's own calls."""
        g = self._member_group(group, "broadcast_object")
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < g.size:
            raise InvalidArgumentError(
                f"broadcast_object: 'src' is {src!r}; expected a group rank in "
                f"[0, {g.size - 1}]")
        data = pickle.dumps(obj) if g.rank == src else b""
        if self.mpi:
            data = self._guarded(g, "broadcast_object",
                                 lambda: self._mpi_bcast(g, data, src, purpose))
            return _unpickle(data, "broadcast_object", g)
        seq = self._next(g)
        store = self.store()
        key = f"obj/{g.id}/{seq}/bcast"
        if g.rank == src:
            store.set(key, data)
            self._written.setdefault(g.id, []).append(key)  # read by the others: kept
            return obj                                       # until a later all_gather
        return pickle.loads(self._store_get(store, key, g, seq, "broadcast_object"))

    def _member_group(self, group: Group | None, op: str) -> Group:
        if group is None:
            g = self.world
        else:
            known = self._groups.get(getattr(group, "id", None))
            if known is not group or not group.is_member:
                raise bad_group_error(group)
            g = group
        if g.id in self._broken:
            raise BackendUnavailableError(
                f"{op}: the object collectives of group {g.describe()} are unusable since an "
                f"earlier one failed (the members are out of step); finalize and restart the "
                f"job. Earlier: {self._broken[g.id]}")
        return g

    def _guarded(self, g: Group, op: str, run):
        """run() (an MPI object collective of `g`); any failure but a DesyncError that
        every member raised alike breaks the group's object collectives."""
        try:
            return run()
        except BaseException as exc:
            if not getattr(exc, "in_step", False):  # set on _mpi_header's DesyncError
                self._broken[g.id] = f"{type(exc).__name__}: {exc}"
            raise

    def _next(self, g: Group) -> int:
        seq = self._seqs.get(g.id, 0) + 1
        self._seqs[g.id] = seq
        return seq

    def _timed_out(self, op: str, g: Group, seconds: float | None = None) -> CommTimeoutError:
        what = ("" if op in ("init", "finalize")
                else f", object collective number {self._seqs.get(g.id, 0)}")
        hint = ("; every rank must call mcrdl.init, and init's timeout must cover the "
                "ranks' start-up (imports, data loading before init)") if op == "init" else ""
        return CommTimeoutError(
            f"{op} (group {g.describe()}{what}) did not complete within "
            f"{self.timeout if seconds is None else seconds} s; a rank of the group may never "
            f"have called it, may be stuck, or may have died{self._session}{hint}")

    def _wait(self, requests: list, op: str, g: Group, seconds: float | None = None) -> None:
        """Poll MPI requests until done (sleeping back-off), CommTimeoutError past the
        timeout (`seconds`, else the bootstrap's). Object collectives are set-up traffic:
        latency does not matter here."""
        MPI = mpi_module()
        seconds = self.timeout if seconds is None else seconds
        deadline = time.monotonic() + seconds
        delay = 1e-6
        while not MPI.Request.Testall(requests):
            if time.monotonic() > deadline:
                raise self._timed_out(op, g, seconds)
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)

    def _mpi_header(self, g: Group, op: str, kind: int, src: int, nbytes: int,
                    purpose: str) -> np.ndarray:
        """The members' headers (rows: number, kind, src, purpose, bytes), gathered; raises
        DesyncError on every member when they are not the same call."""
        seq = self._next(g)
        comm = self._comms[g.id]
        mine = np.array([seq, kind, src, PURPOSES.index(purpose), nbytes], dtype=np.int64)
        rows = np.zeros((g.size, 5), dtype=np.int64)
        self._wait([comm.Iallgather(mine, rows)], op, g)
        if (rows[:, :4] == rows[0, :4]).all():
            return rows

        def call(row) -> str:
            n, k, s, p = (int(v) for v in row[:4])
            name = ("all_gather_object" if k == _ALL_GATHER
                    else f"broadcast_object(src={s})" if k == _BCAST else f"op code {k}")
            what = f" for {PURPOSES[p]}" if 0 < p < len(PURPOSES) else ""
            return f"{name}{what}, its object collective number {n}"

        exc = DesyncError(
            f"{op} (group {g.describe()}): the members made different object collectives:\n"
            + "\n".join(f"  rank {r}: {call(row)}" for r, row in enumerate(rows))
            + "\nevery member must make the same object collectives in the same order (a "
            "rank that caught an error and went on may have skipped one)")
        # numbers that agree: every member raised this and they are still in step
        exc.in_step = bool((rows[:, 0] == rows[0, 0]).all())
        raise exc

    def _mpi_all_gather(self, g: Group, data: bytes, purpose: str) -> list[bytes]:
        comm = self._comms[g.id]
        rows = self._mpi_header(g, "all_gather_object", _ALL_GATHER, -1, len(data), purpose)
        sizes = rows[:, 4].copy()
        displs = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        out = bytearray(int(sizes.sum()))
        send = np.frombuffer(data, dtype=np.uint8) if data else np.zeros(0, np.uint8)
        req = comm.Iallgatherv(send, [out, (sizes.tolist(), displs.tolist()), mpi_module().BYTE])
        self._wait([req], "all_gather_object", g)
        return [bytes(out[d:d + n]) for d, n in zip(displs.tolist(), sizes.tolist(), strict=True)]

    def _mpi_bcast(self, g: Group, data: bytes, src: int, purpose: str) -> bytes:
        comm = self._comms[g.id]
        rows = self._mpi_header(g, "broadcast_object", _BCAST, src, len(data), purpose)
        buf = bytearray(data) if g.rank == src else bytearray(int(rows[src, 4]))
        if buf:
            self._wait([comm.Ibcast([buf, mpi_module().BYTE], root=src)], "broadcast_object", g)
        return bytes(buf)

    def _store_get(self, store, key: str, g: Group, seq: int, op: str) -> bytes:
        try:
            return store.get(key)
        except RuntimeError as exc:  # the store's own timeout
            if "imeout" in str(exc) or "timed out" in str(exc):
                err = self._timed_out(op, g)
                self._broken[g.id] = f"CommTimeoutError: {err}"
                raise err from None
            raise

    # -- the TCP store ------------------------------------------------------------------
    def store(self):
        """A torch.distributed store shared by all ranks (created on first use)."""
        if self._store is None:
            self._store = self._make_store()
        return self._store

    def _make_store(self):
        import torch.distributed as dist

        td = datetime.timedelta(seconds=self.timeout)
        env = os.environ
        comm = self._comms.get(0)
        if comm is not None:
            single = self.single_node()  # collective: before anything only rank 0 does
            host = env.get("MASTER_ADDR") or ("127.0.0.1" if single else _host_address())
            store = None
            if self.rank == 0:
                store = _hosted_store(host, 0, self.size, td, many_nodes=not single,
                                      wait_for_workers=False)
                addr = (host, store.port)
            else:
                addr = None
            host, port = self.broadcast_object(addr, purpose="the store's address")
            if store is None:
                store = dist.TCPStore(host, port, self.size, False, td)
        elif self.info.store is not None:
            # torch's, made for one process group (torch prefixes it per group and per
            # init_process_group): nothing else uses these keys
            store = self.info.store
        elif self.info.launcher == "single":
            store = _hosted_store("127.0.0.1", 0, 1, td, many_nodes=False, wait_for_workers=False)
        else:
            if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
                raise BackendUnavailableError(
                    f"launched by {self.info.launcher} without MASTER_ADDR/MASTER_PORT: set both "
                    "(the address and a free port of rank 0's node) or launch with mpiexec"
                )
            agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            addr = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
            if self.rank == 0 and not agent:
                store = _hosted.get(addr)
                if store is None:
                    store = _hosted[addr] = _hosted_store(*addr, self.size, td, many_nodes=True)
                else:  # this session's timeout on the server an earlier one made
                    store.set_timeout(td)
            else:
                store = dist.TCPStore(*addr, self.size, False, td)
            # This store outlives an init/finalize session (torchrun's agent hosts it, or
            # rank 0 keeps it in _hosted), and the agent's outlives a restart of the
            # workers: each session of each restart gets keys of its own, or it would read
            # an earlier one's object collectives and rendezvous as its own. Every rank
            # adds 1 once a session, and none adds for the next before all have added for
            # this one (closing is collective), so the count says which session this is.
            restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
            session = (store.add(f"mcrdl-sessions-{restart}", 1) - 1) // self.size
            self._session = (f"; this rank is in mcrdl session {session + 1} of the launcher's "
                             f"store (worker restart {restart}): every rank must call "
                             "mcrdl.init and mcrdl.finalize alike, or the ranks' sessions differ")
            if session or restart != "0":
                return dist.PrefixStore(f"mcrdl-{restart}-{session}", store)
        return dist.PrefixStore("mcrdl", store)

    def close(self, grace: float = 0.0) -> None:
        """Collective: rank 0 hosts the store, so it leaves only after every rank is done.
        Bounded like every wait here, by the timeout plus `grace` (the time the other
        ranks may spend before they get here: draining their backends' ops in flight,
        up to the timeout a backend): a rank that does not finalize by then makes the
        others raise CommTimeoutError (the world's communicator is then left to
        MPI_Finalize, its barrier still posted for the late rank to complete)."""
        world = self._comms.pop(0, None)
        for comm in self._comms.values():
            comm.Free()
        self._comms.clear()
        if world is not None:
            self._wait([world.Ibarrier()], "finalize", self.world, self.timeout + grace)
            world.Free()
        elif self._store is not None and self.size > 1:
            self.all_gather_object(None, purpose="finalize")
            if self.rank == 0:
                self._store.wait([f"bootstrap/closed/{r}" for r in range(1, self.size)])
            else:
                self._store.set(f"bootstrap/closed/{self.rank}", b"1")
        self._store = None


# The stores rank 0 hosts at a launcher-given address (MASTER_ADDR, MASTER_PORT), by
# address, kept for the process: the port is fixed, so a later session must reuse the
# server, and the other ranks may still be reading from it when this session closes.
_hosted: dict[tuple[str, int], object] = {}


def _hosted_store(host: str, port: int, size: int, timeout: datetime.timedelta, *,
                  many_nodes: bool, **kw):
    """Rank 0's TCPStore server, listening on `host`'s address alone (the launcher's
    MASTER_ADDR, or the address rank 0 broadcasts over MPI). torch's own server listens on
    every interface whatever host_name says, and every rank unpickles what the store
    carries (object collectives), so nothing outside the job may reach it: a socket bound
    to that address is handed to torch (master_listen_fd; torch closes it with the store).
    Only where `host` is a name that resolves to a loopback address in a job that may span
    nodes (a hosts file mapping the node's name to 127.0.1.1, which the other nodes
    resolve to its real address) does torch's server keep every interface: bound to
    loopback, the other nodes could not connect."""
    import torch.distributed as dist

    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM)[0]
    try:
        ipaddress.ip_address(host)
        literal = True
    except ValueError:
        literal = False
    if many_nodes and not literal and ipaddress.ip_address(sockaddr[0]).is_loopback:
        return dist.TCPStore(host, port, size, True, timeout, **kw)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, port, size, True, timeout, master_listen_fd=sock.detach(), **kw)


def _unpickle(data: bytes, op: str, g: Group) -> object:
    try:
        return pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - a class the receiver cannot import, say
        raise InvalidArgumentError(
            f"{op} (group {g.describe()}): could not unpickle an object a member sent "
            f"({type(exc).__name__}: {exc}); objects must be picklable and importable on "
            "every rank") from exc


def _host_address() -> str:
    """This host's address as other nodes reach it."""
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return socket.gethostname()
