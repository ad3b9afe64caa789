"""The "mpi" backend: mpi4py communicators, operations in C++ (mcrdl._C.MpiComm).

Each op is one nonblocking MPI call on a communicator owned by this backend (a Dup of
the world, or a Split per group), posted from the caller's thread in issue order.
Blocking ops are driven to completion by the caller under the timeout; async ops by
the backend's lane thread, so they progress while the caller computes or waits on
another backend. CPU tensors are used in place (zero-copy).

A blocking call of a collective may run as the blocking MPI collective instead (much
faster for small messages with MPICH): which one, per (op, group size, bytes), comes
from :func:`blocking_steps` (docs/api.md, MCRDL_MPI_BLOCKING): the steps of the tuning
table in use when it has them for this backend, else the shipped measurements. Its
timeout is then kept by a watchdog that ends the job with MPI_Abort (csrc/watchdog.h).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from functools import cache
from importlib import resources

from .. import _C, bootstrap
from ..bootstrap import (
    MPICH_POSIX_COLL_CVAR,
    mpi_module,
    mpich_posix_coll_json,
    mpich_selection_is_users,
    track_mpi_lane,
)
from ..errors import DesyncError
from ..groups import Group, bad_group_error
from ..launch import (
    affinity_bits,
    node_cores_for_ranks,
    node_id,
    node_layout,
    oversubscribed,
)
from ..ops import OPS
from ..tuning.schema import (
    VARIANT_CODES,
    TuningTableError,
    check_steps,
    op_variants,
    step_variant,
)
from .base import Backend, Capabilities, InitContext

log = logging.getLogger("mcrdl")


def poll_spins(ranks_on_node: int, cores: int | None = None) -> int:
    """Polls before yielding: spin when this node's ranks fit the `cores` they spread over
    (default: launch.node_cores_for_ranks()), else yield at once (MCRDL_POLL_SPINS
    overrides). See csrc/lane.cpp for the measurements."""
    if os.environ.get("MCRDL_POLL_SPINS"):
        return int(os.environ["MCRDL_POLL_SPINS"])
    return 0 if oversubscribed(ranks_on_node, cores or node_cores_for_ranks()) else 64


def idle_sleep(ranks_on_node: int, cores: int | None = None) -> bool:
    """Whether waiters sleep after 100 us without progress (instead of yielding until done)
    and idle lane threads in slices growing to 1 ms (instead of 50 us): when this node's
    ranks outnumber the `cores` they spread over (as poll_spins), a rank waiting for busy
    peers must leave them the cores (MCRDL_IDLE_SLEEP=0/1 overrides). See csrc/lane.cpp
    (Backoff) for the policy and its measurements."""
    v = os.environ.get("MCRDL_IDLE_SLEEP", "")
    if v:
        if v not in ("0", "1"):
            raise ValueError(f"MCRDL_IDLE_SLEEP must be 0 or 1, got {v!r}")
        return v == "1"
    return oversubscribed(ranks_on_node, cores or node_cores_for_ranks())


def _env_mode(var: str, modes: tuple[str, ...]) -> str:
    """The value of `var`, one of `modes` (unset or empty: the first)."""
    v = os.environ.get(var, "") or modes[0]
    if v not in modes:
        raise ValueError(f"{var} must be one of {', '.join(modes)}, got {v!r}")
    return v


HOLD_GIL_MODES = ("auto", "never")


def hold_gil_mode() -> str:
    """MCRDL_HOLD_GIL: "auto" (default: a blocking MPI call keeps the GIL when nothing of
    this process can need it meanwhile, csrc/gil.h) or "never" (always release it)."""
    return _env_mode("MCRDL_HOLD_GIL", HOLD_GIL_MODES)


#: The collectives with a blocking variant (csrc/mpi_comm.cpp, BlockOp).
BLOCKING_OPS = tuple(op for op in OPS if _C.MpiComm.has_blocking(op))
BLOCKING_MODES = ("auto", "never", "always", "allreduce")


def blocking_mode() -> str:
    """MCRDL_MPI_BLOCKING: "auto" (default: by the measurements), "never" (always post the
    nonblocking call and wait on it), "always" (the blocking MPI collective) or
    "allreduce" (as "always", but all_gather and reduce_scatter as the blocking
    MPI_Allreduce of the whole buffer: the variant small calls of those take by "auto"
    at some sizes, forced for every size, e.g. to test it)."""
    return _env_mode("MCRDL_MPI_BLOCKING", BLOCKING_MODES)


_THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")


def mpi_init_mode(MPI) -> dict[str, str | None]:
    """How MPI was initialized, as far as it changes which variant is faster (the keys a
    tuning table's provenance records them under): ``mpi_initialized_by`` "mcrdl" or
    "the program" (mpi4py.MPI imported before mcrdl.init), ``mpi_thread_level``, and
    ``mpich_selection``, MPICH's shared-memory collective selection in effect: "mcrdl"
    (mcrdl/tuning/mpich_posix_coll.json), "mpich" (its built-in one), another file's
    path, or None for another MPI library. The selection is the environment's value:
    MPI_Init read it there, after `import mcrdl` set it or before mcrdl was imported
    (select_mpich_collectives leaves it then). MPI_T cannot read it back: MPICH's
    MPI_T_cvar_read of a string variable copies the bytes of its pointer."""
    selection = None
    if "MPICH" in MPI.Get_library_version():
        value = os.environ.get(MPICH_POSIX_COLL_CVAR)
        selection = "mcrdl" if value == mpich_posix_coll_json() else value or "mpich"
    return {"mpi_initialized_by": "mcrdl" if bootstrap.initialized_mpi else "the program",
            "mpi_thread_level": _THREAD_LEVELS[MPI.Query_thread()],
            "mpich_selection": selection}


def shared_memory_path(mode: dict) -> bool:
    """Whether the shipped blocking steps hold for MPI initialized as `mode`
    (mpi_init_mode): they were measured with mcrdl's MPICH selection. Under MPICH's own
    selection and MPI_THREAD_MULTIPLE its small blocking collectives take the generic
    algorithms, as its nonblocking ones do, and then wait in a progress loop that yields
    the core: no faster than the nonblocking variant for a blocking call, and an async
    call queued on the issue thread waits for that thread's turns (docs/api.md)."""
    return mode.get("mpich_selection") in (None, "mcrdl") or \
        mode.get("mpi_thread_level") != "multiple"


@cache
def shipped_blocking() -> dict:
    """mcrdl/tuning/mpi_blocking.json: per op and group size, the (largest bytes,
    variant) steps measured on the reference machine (benchmarks/c_floor.py)."""
    src = "mcrdl/tuning/mpi_blocking.json"
    doc = json.loads(resources.files("mcrdl.tuning").joinpath("mpi_blocking.json").read_text())
    return {op: {int(g): check_steps(steps, src, f"$.ops.{op}.{g}", op)
                 for g, steps in by_g.items()}
            for op, by_g in doc["ops"].items()}


def blocking_steps(op: str, group_size: int, mode: str, table: dict | None = None,
                   oversubscribed: bool = False, shared_memory: bool = True) -> list:
    """The (largest bytes, variant) steps of `op` at `group_size` (-1 bytes: no limit; the
    variant True: blocking, False: nonblocking, or "allreduce"): `mode`
    "always"/"never"/"allreduce" fix the variant; "auto" takes `table` (op -> group size ->
    steps, from a tuning table), else the shipped measurements, at the nearest measured
    group size (the largest one not above `group_size`, else the smallest).

    `oversubscribed` (some node runs more ranks than it has cores): "auto" without table
    steps stays nonblocking. MPICH's blocking calls poll without ever yielding, so a rank
    waiting in one takes a core from the peer it waits for, where mcrdl's own waits back
    off (csrc/lane.cpp); the shipped steps were measured on ranks that fit the cores. An
    isolated call can still win blocking, but a training step loses (benchmarks/moe_step.py,
    4 ranks on 2 cores: with the shipped blocking steps all mpi 44-76 ms, auto 1.08-1.28x
    the best fixed choice, load average 36; without, 44-48 ms and 0.95-0.98x).

    Without `shared_memory` (MPI initialized without mcrdl's MPICH selection:
    shared_memory_path) "auto" without table steps stays nonblocking too."""
    if mode == "allreduce":
        return [(-1, "allreduce" if "allreduce" in op_variants(op) else True)]
    if mode != "auto":
        return [(-1, mode == "always")]
    shipped = shipped_blocking() if shared_memory and not oversubscribed else {}
    for source in (table or {}, shipped):
        by_g = source.get(op)
        if by_g:
            below = [g for g in by_g if g <= group_size]
            return by_g[max(below) if below else min(by_g)]
    return [(-1, False)]


def step_codes(steps: list, allreduce: bool = True) -> list[tuple[int, int]]:
    """`steps` (file form: True, False or "allreduce") as the C++ communicators take them,
    (largest bytes, variant code); without `allreduce` (pccl's phases, which have no such
    variant) an "allreduce" step runs the blocking collective."""
    codes = []
    for hi, value in steps:
        v = step_variant(value)
        codes.append((hi, VARIANT_CODES["blocking" if v == "allreduce" and not allreduce
                                        else v]))
    return codes


class MPILaneBackend(Backend):
    """What the backends whose ops run in mcrdl._C over mpi4py communicators share
    ("mpi", "cray-mpich", "pccl"): the MPI checks, the lane, one C++ communicator per
    group in ``self._comms`` (the world under id 0), timeouts, failure, synchronize."""

    @classmethod
    def availability(cls, launch) -> str | None:
        if not launch.mpi_world:
            return launch.why_no_mpi
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return "mpi4py is not installed (pip install mpi4py, plus an MPI such as mpich)"
        return None

    def __init__(self, ctx: InitContext):
        super().__init__(ctx)
        MPI = mpi_module()
        self._MPI = MPI
        linked = _C.mpi_library_version().strip()
        loaded = MPI.Get_library_version().strip()
        if linked != loaded:
            raise RuntimeError(
                "mcrdl._C was built against a different MPI than mpi4py uses:\n"
                f"  mcrdl._C: {linked.splitlines()[0]}\n  mpi4py:   {loaded.splitlines()[0]}\n"
                "rebuild mcrdl (pip install --no-build-isolation .) with the same MPI"
            )
        self.library_version = loaded
        local, cores = ctx.bootstrap.info.local_size, node_cores_for_ranks()
        _C.set_poll_spins(poll_spins(local, cores))
        _C.set_idle_sleep(idle_sleep(local, cores))
        _C.set_hold_gil(1 if hold_gil_mode() == "auto" else 0)
        self._lane = _C.Lane(self.name)
        track_mpi_lane(self._lane)
        self._comms: dict[int, object] = {}
        self._blocking_table: dict = {}  # op -> group size -> steps, from the tuning table
        # this node's ranks outnumber its cores (as this rank sees it); made exact and the
        # same on every rank (any node) by use_tuning_table, which the runtime calls
        # before any operation
        self._oversubscribed = oversubscribed(local, cores)
        #: how MPI was initialized (mpi_init_mode); compared across ranks with the steps
        self.init_mode = mpi_init_mode(MPI)
        self._shared_memory = shared_memory_path(self.init_mode)

    #: Whose steps of the tuning table choose the variants (the MPI library's collectives
    #: as the backend of that name measured them).
    blocking_source = "mpi"

    @staticmethod
    def _blocking_mode() -> str:
        """MCRDL_MPI_BLOCKING, except that debug mode keeps the nonblocking path: its
        checks rely on every wait being bounded and raising CommTimeoutError."""
        from ..runtime import debug_enabled

        return "never" if debug_enabled() else blocking_mode()

    def use_tuning_table(self, table) -> None:
        """Blocking calls run the variants of `table`'s steps for `blocking_source` where it
        has them, else the shipped ones (blocking_steps). Every rank must run the same variant
        of each call (MPI never matches a blocking collective with a nonblocking one), so
        the ranks compare their choice (mode and steps) and raise DesyncError when it
        differs."""
        steps = {} if table is None else table.blocking_table(self.blocking_source)
        if steps and not self._table_init_matches(table):
            steps = {}
        odd = sorted(op for op in steps if op not in BLOCKING_OPS)
        if odd:  # a hand-made table: these steps would never be read
            raise TuningTableError(
                f"tuning table: blocking steps for {odd} on backend {self.blocking_source!r}, "
                f"which have no blocking MPI variant (those that have: {list(BLOCKING_OPS)}); "
                "remove them from the table")
        mine = (self._blocking_mode(), steps, self._shared_memory)
        gathered = self.ctx.bootstrap.all_gather_object((mine, (node_id(), affinity_bits())),
                                                        purpose="the mpi backend")
        self._settle_oversubscription([where for _, where in gathered])
        views = [v for v, _ in gathered]
        differ = [r for r, v in enumerate(views) if v != views[0]]
        if differ:
            raise DesyncError(
                f"init: backend {self.name!r} would run other blocking variants on ranks "
                f"{differ} than on rank 0 (MCRDL_MPI_BLOCKING, MCRDL_DEBUG, the tuning "
                "table, e.g. MCRDL_TUNING_TABLE, and whether MPICH's shared-memory selection "
                "is in effect, i.e. MPIR_CVAR_CH4_POSIX_COLL_SELECTION_TUNING_JSON_FILE and "
                "whether mpi4py.MPI is imported before mcrdl, must be the same on every "
                "rank); (mode, table steps, shared-memory selection) on rank 0: "
                f"{views[0]}, on rank {differ[0]}: {views[differ[0]]}")
        self._blocking_table = steps
        self._warn_lost_selection()
        for c in self._cpp_comms():
            self._choose_blocking(c)

    def _settle_oversubscription(self, masks: list) -> None:
        """The exact oversubscription, from every rank's (node id, affinity bit mask): a
        node whose ranks outnumber the CPUs their masks cover together (before init each
        rank could only assume that a launcher binding it gave it cores of its own). The
        same on every rank; this node's waiters poll accordingly, and its first rank warns
        when it is oversubscribed."""
        layout = node_layout(masks)
        self._oversubscribed = any(oversubscribed(n, cpus) for n, cpus in layout.values())
        me = masks[self.ctx.bootstrap.rank][0]
        ranks, cpus = layout[me]
        _C.set_poll_spins(poll_spins(ranks, cpus))
        _C.set_idle_sleep(idle_sleep(ranks, cpus))
        first = next(r for r, (node, _) in enumerate(masks) if node == me)
        # once an init (the bootstrap's), not once per backend on MPI (mpi, pccl, ...)
        boot = self.ctx.bootstrap
        if oversubscribed(ranks, cpus) and first == boot.rank and not getattr(
                boot, "warned_oversubscribed", False):
            boot.warned_oversubscribed = True
            selection = os.environ.get(MPICH_POSIX_COLL_CVAR) == mpich_posix_coll_json()
            log.warning(
                "mcrdl: %d ranks of node %s run on %d CPU(s) (their affinity masks together): "
                "waiters yield and sleep, and the shipped blocking steps give way to "
                "nonblocking calls%s. Bind each rank to cores of its own (mpiexec -bind-to "
                "core, srun --cpu-bind=cores) or to none.", ranks, me.split("/")[0], cpus,
                "; MPICH's shared-memory collectives, selected before MPI_Init when each rank "
                f"seemed to have cores of its own, spin (set {MPICH_POSIX_COLL_CVAR}= to leave "
                "them out)" if selection else "")

    def _table_init_matches(self, table) -> bool:
        """Whether `table`'s variant steps were measured with MPI initialized as now (its
        provenance's mpich_selection; tables without it were measured with mcrdl's)."""
        had = table.provenance.get("mpich_selection", "mcrdl")
        now = self.init_mode["mpich_selection"]
        if now is None or had == now or (had == "mcrdl") == self._shared_memory:
            return True
        log.info("mcrdl: the tuning table's variant steps were measured with MPICH's "
                 "selection %r, this run has %r: the %s backend runs the default steps",
                 had, now, self.name)
        return False

    def _warn_lost_selection(self) -> None:
        """Once an init, on rank 0: MPI was initialized without mcrdl's MPICH selection
        (nor one the user set), on ranks that fit their cores, where mcrdl would have set
        it: the small blocking collectives lost MPICH's shared-memory path."""
        boot = self.ctx.bootstrap
        if (self.init_mode["mpich_selection"] != "mpich" or mpich_selection_is_users()
                or self._oversubscribed or boot.rank != 0
                or getattr(boot, "warned_mpich_selection", False)):
            return
        boot.warned_mpich_selection = True
        log.warning(
            "mcrdl: MPI was initialized before mcrdl could select MPICH's shared-memory "
            "collectives (mpi4py.MPI imported before mcrdl): under MPI_THREAD_MULTIPLE "
            "MPICH then runs its generic algorithms for small blocking collectives, and "
            "nothing restores the fast path after MPI_Init (at 2 ranks an 8 B all_reduce "
            "took 1.97 us instead of 0.42 us). MCRDL_MPI_BLOCKING=auto runs the %s "
            "backend's nonblocking variant then. Fix: import mcrdl before mpi4py.MPI (or "
            "before any module that imports it), or set %s=%s in the job's environment.",
            self.name, MPICH_POSIX_COLL_CVAR, mpich_posix_coll_json())

    def _cpp_comms(self):
        """Every C++ communicator of this backend: use_tuning_table sets their variants
        and set_timeout their timeouts."""
        return self._comms.values()

    def _choose_blocking(self, c) -> None:
        """Set which variant the blocking calls of C++ communicator `c` run."""
        raise NotImplementedError

    def comm(self, group: Group | None):
        try:
            return self._comms[0 if group is None else group.id]
        except (KeyError, AttributeError):
            # after finalize (the communicators are gone): the lane says so
            self._lane.check_open("a call on " + ("the world" if group is None else
                                                  f"group {getattr(group, 'id', group)!r}"))
            raise bad_group_error(group) from None

    def set_timeout(self, timeout: float) -> None:
        super().set_timeout(timeout)
        for c in self._cpp_comms():
            c.set_timeout(timeout)

    def mark_failed(self, why: str) -> None:
        self._lane.fail(why)

    def synchronize(self, timeout: float) -> None:
        self._lane.synchronize(timeout)

    def finalize(self) -> None:
        """Drain and stop the lane; subclasses then free their MPI communicators."""
        self._lane.shutdown(f"the {self.name!r} backend was finalized", self.ctx.timeout)
        self._comms.clear()


class MPIBackend(MPILaneBackend):
    name = "mpi"
    blocking_source = property(lambda self: self.name)  # its own steps (cray-mpich too)
    capabilities = Capabilities(
        notes={"float16/bfloat16": "moved as 16-bit words; reduced in float32, rounded once"}
    )
    validates_arguments = True

    def __init__(self, ctx: InitContext):
        super().__init__(ctx)
        self._mpi_comms: dict[int, object] = {}
        # The hot ops as C functions over these methods (csrc/mpi_comm.cpp, FastOps): the
        # front calls them directly; what they do not handle goes to the methods below.
        fast = _C.mpi_fast_ops({op: getattr(self, op) for op in OPS})
        self._add_fast, self._clear_fast = fast.pop("__add__"), fast.pop("__clear__")
        self._fast_names = (*fast, "_add_fast", "_clear_fast")
        self.__dict__.update(fast)
        self._world = self._make(ctx.world, self._MPI.COMM_WORLD.Dup())
        self._add_fast(None, self._world)

    def _make(self, group: Group, comm) -> _C.MpiComm:
        self._mpi_comms[group.id] = comm
        c = _C.MpiComm(comm.handle, comm.Get_rank(), comm.Get_size(), group.describe(),
                       self._lane, self.ctx.timeout, self.name)
        self._choose_blocking(c)
        self._comms[group.id] = c
        self._add_fast(group, c)
        return c

    def _choose_blocking(self, c: _C.MpiComm, ops=BLOCKING_OPS) -> None:
        """Which variant blocking calls of `c` run."""
        mode = self._blocking_mode()
        for op in ops:
            c.set_blocking(op, step_codes(blocking_steps(op, c.size, mode, self._blocking_table,
                                                         self._oversubscribed,
                                                         self._shared_memory)))

    @contextlib.contextmanager
    def variant(self, op: str, variant: str | bool):
        """Within the block, blocking calls of `op` on every communicator of this backend
        run `variant` (mcrdl.tuning.schema.op_variants: "blocking", the blocking MPI
        collective, also given as True; "nonblocking", the nonblocking one and a bounded
        wait, also False; "allreduce" for all_gather and reduce_scatter); then the chosen
        steps again. Every member of a group calling `op` inside must force the same
        variant (mcrdl-tune measures them this way)."""
        name = variant if isinstance(variant, str) else step_variant(bool(variant))
        if name not in op_variants(op):
            raise ValueError(f"variant: {op} has the variants {', '.join(op_variants(op))}, "
                             f"got {variant!r}")
        for c in self._comms.values():
            c.set_blocking(op, [(-1, VARIANT_CODES[name])])
        try:
            yield
        finally:
            for c in self._comms.values():
                self._choose_blocking(c, (op,))

    def add_group(self, group: Group) -> None:
        self._lane.check_open("add_group")  # after finalize the world communicator is gone
        MPI = self._MPI
        world = self._mpi_comms[0]
        color = 0 if group.is_member else MPI.UNDEFINED
        comm = world.Split(color, group.rank if group.is_member else 0)
        if group.is_member:
            self._make(group, comm)

    def finalize(self) -> None:
        # The C functions forget the communicators first: a kept `backend.all_reduce` then
        # reaches the methods below, and the closed lane refuses the call.
        self.__dict__.get("_clear_fast", lambda: None)()  # gone on a second finalize
        # The C functions hold the bound methods: with them in __dict__ the backend sits in
        # a cycle through their table, which the GC cannot see (a backend per session kept).
        for name in self._fast_names:
            self.__dict__.pop(name, None)
        super().finalize()
        for comm in self._mpi_comms.values():
            if comm != self._MPI.COMM_NULL:
                comm.Free()
        self._mpi_comms.clear()

    # -- operations: argument handling and validation happen in C++ -------------------
    def all_reduce(self, tensor, op, group, async_op):
        return (self._world if group is None else self.comm(group)).all_reduce(tensor, op, async_op)

    def reduce(self, tensor, dst, op, group, async_op):
        return self.comm(group).reduce(tensor, dst, op, async_op)

    def bcast(self, tensor, src, group, async_op):
        return (self._world if group is None else self.comm(group)).bcast(tensor, src, async_op)

    def all_gather(self, output, input, group, async_op):
        return (self._world if group is None else self.comm(group)).all_gather(output, input,
                                                                                async_op)

    def gather(self, output, input, dst, group, async_op):
        return self.comm(group).gather(output, input, dst, async_op)

    def scatter(self, output, input, src, group, async_op):
        return self.comm(group).scatter(output, input, src, async_op)

    def reduce_scatter(self, output, input, op, group, async_op):
        return self.comm(group).reduce_scatter(output, input, op, async_op)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, group,
                          async_op):
        return (self._world if group is None else self.comm(group)).all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, async_op)

    def all_to_all(self, output_list, input_list, group, async_op):
        return self.comm(group).all_to_all(output_list, input_list, async_op)

    def gatherv(self, output, input, counts, displs, dst, group, async_op):
        return self.comm(group).gatherv(output, input, counts, displs, dst, async_op)

    def scatterv(self, output, input, counts, displs, src, group, async_op):
        return self.comm(group).scatterv(output, input, counts, displs, src, async_op)

    def all_gatherv(self, output, input, counts, displs, group, async_op):
        return self.comm(group).all_gatherv(output, input, counts, displs, async_op)

    def all_to_allv(self, output, input, send_counts, recv_counts, send_displs, recv_displs,
                    group, async_op):
        return self.comm(group).all_to_allv(output, input, send_counts, recv_counts, send_displs,
                                            recv_displs, async_op)

    def send(self, tensor, dst, tag, group, async_op):
        return self.comm(group).send(tensor, dst, tag, async_op)

    def recv(self, tensor, src, tag, group, async_op):
        return self.comm(group).recv(tensor, src, tag, async_op)

    def barrier(self, group, async_op):
        return self.comm(group).barrier(async_op)
