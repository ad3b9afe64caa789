"""The tuning suite: time every operation on every initialized backend over a message
size sweep, at the world size and at sub-group sizes, and record a tuning table.

Run by ``mcrdl-tune run`` on every rank (under mpiexec, torchrun or srun). Sub-groups
are the first ``s`` world ranks, so one run covers several scales; ranks outside the
group being measured wait without spinning. Each point is the median over iterations of
the per-iteration maximum over ranks (``mcrdl.tools.bench.time_call``). With ``overlap=K``
each op is also timed as K async ops in flight at once (time per op), as the MCR-DL
paper does; those rows are stored under ``"<op>@overlap<K>"``.

On the mpi backends (those with a ``variant`` method: "mpi", "cray-mpich") each
collective with a blocking variant is measured once per variant: as the blocking MPI
collective, as the nonblocking one with a bounded wait, and for all_gather and
reduce_scatter as the blocking MPI_Allreduce of the whole buffer (each forced per
communicator for the measurement); the table keeps every variant's times, records the
backend's time as the fastest one, and derives from them the (largest bytes, variant) steps its
blocking calls run (``TuningTable.add_variant``, ``blocking_steps``). Overlapped rows
run the async calls with the variants chosen when the run started.

Then a confirmation pass: on an oversubscribed or shared machine a single point can be
an outlier, and one outlier flips a routing decision. Every point whose winner differs
from the winners of both neighbouring sizes, or wins by less than ``confirm_margin``, is
re-measured ``confirm`` more times on every backend (each backend in its own block, the
blocks in a random order); the stored time is the median of all measurements.

Rank 0 writes the table atomically every few points, so an interrupted run keeps what
it measured and ``--resume`` continues from there.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import mcrdl
from mcrdl.ops import COLLECTIVES
from mcrdl.tuning.table import TuningTable, variant_winners

from .bench import DTYPES, barrier_backend, device_for, element_count, make_call, time_call

#: Operations tuned by default: every collective (point to point is not tuned).
DEFAULT_OPS = COLLECTIVES


@dataclass
class SuiteConfig:
    ops: Sequence[str]
    backends: Sequence[str]
    sizes: Sequence[int]  # bytes
    group_sizes: Sequence[int]
    dtype: str = "float32"
    iters: int = 20
    min_iters: int = 3
    warmup: int = 3
    overlap: int = 0  # K > 1: also time K concurrent async ops
    save_every: int = 10
    confirm: int = 3  # re-measure rounds for suspicious winners (0: none)
    confirm_margin: float = 1.25  # a winner by less than this ratio is re-measured


def default_group_sizes(world: int) -> list[int]:
    """2, 4, 8, ... below the world size, then the world size itself."""
    sizes, s = [], 2
    while s < world:
        sizes.append(s)
        s *= 2
    return sizes + [world] if world > 1 else [1]


def iters_for(nbytes: int, cfg: SuiteConfig) -> int:
    """Fewer iterations for large messages (time per point stays bounded)."""
    if nbytes <= 1 << 16:
        return cfg.iters
    return max(cfg.min_iters, int(cfg.iters * (1 << 16) / nbytes))


def _quiet_barrier(backend: str) -> None:
    """World barrier whose waiters sleep instead of polling (idle ranks must not steal
    CPU from the ranks being measured); on another backend when `backend` has none."""
    work = mcrdl.barrier(barrier_backend(backend), async_op=True)
    while not work.is_completed():
        time.sleep(0.002)
    work.wait()


def overlapped_call(op: str, backend: str, count: int, dtype, device, rank: int, n: int,
                    group, k: int) -> Callable[[], None]:
    """K copies of an op in flight at once; one call issues all and waits for all."""
    calls = [make_call(op, backend, count, dtype, device, rank, n, group, async_op=True)
             for _ in range(k)]

    def run() -> None:
        works = [c() for c in calls]
        for w in works:
            w.wait()

    return run


def variants_of(backend: str, op: str, k: int) -> tuple[str, ...]:
    """The variants measured for a point: those of the op (schema.op_variants) for a single
    blocking call of an op with a blocking variant on an mpi backend, else ("",): the
    backend as configured. The same on every rank (the plan must be)."""
    from mcrdl.api import current_runtime
    from mcrdl.backends.mpi import BLOCKING_OPS
    from mcrdl.tuning.schema import op_variants

    if k != 1 or op not in BLOCKING_OPS:
        return ("",)
    return op_variants(op) if hasattr(current_runtime().backend(backend), "variant") else ("",)


def forced(backend: str, op: str, variant: str):
    """A context in which `backend` runs blocking calls of `op` as `variant` ("": as
    configured)."""
    if not variant:
        return contextlib.nullcontext()
    from mcrdl.api import current_runtime

    return current_runtime().backend(backend).variant(op, variant)


def measure_point(cfg: SuiteConfig, op: str, k: int, backend: str, count: int, rank: int,
                  s: int, group) -> float:
    """Seconds per call of `op` on `backend` over the first `s` ranks (`group`), `count`
    elements of cfg.dtype per rank; with k > 1, per op of k concurrent async ops."""
    dtype = DTYPES[cfg.dtype]
    device = device_for(backend)
    if k > 1:
        call = overlapped_call(op, backend, count, dtype, device, rank, s, group, k)
    else:
        call = make_call(op, backend, count, dtype, device, rank, s, group)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return time_call(call, backend, device, iters_for(nbytes, cfg), cfg.warmup,
                     group=group) / k


def run_suite(cfg: SuiteConfig, table: TuningTable, save: Callable[[TuningTable], None],
              progress: Callable[[int, int, str], None] | None = None) -> TuningTable:
    """Measure every missing point of the plan into `table` (rank 0's copy is the one
    that matters); `save` is called on rank 0 every cfg.save_every points and at the end."""
    rank, world = mcrdl.get_rank(), mcrdl.get_size()
    dtype = DTYPES[cfg.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    sync_backend = cfg.backends[0]
    groups = {s: (None if s == world else mcrdl.new_group(list(range(s))))
              for s in cfg.group_sizes}
    rows = [(op, op, 1) for op in cfg.ops]
    if cfg.overlap > 1:
        rows += [(f"{op}@overlap{cfg.overlap}", op, cfg.overlap)
                 for op in cfg.ops if op != "barrier"]
    # One point per distinct real size (requested sizes round to whole elements per
    # rank, so two can coincide), and skip decisions from the table as loaded: rank 0
    # adds points as it goes, and every rank must make the same decisions.
    plan = []
    from mcrdl.backends.registry import backend_class

    supports = {b: backend_class(b).supported_ops() for b in cfg.backends}
    for s in cfg.group_sizes:
        for name, base, k in rows:
            for b in cfg.backends:
                if base not in supports[b]:
                    continue  # e.g. pccl has all_gather, reduce_scatter, all_reduce only
                wanted = cfg.sizes if base != "barrier" else cfg.sizes[:1]
                counts = sorted({element_count(base, n, itemsize, s) for n in wanted})
                plan += [(name, base, k, s, b, count, v) for count in counts
                         for v in variants_of(b, base, k)]
    already = {p for p in plan if (table.has_variant(p[0], p[3], p[4], p[5] * itemsize, p[6])
                                   if p[6] else table.has(p[0], p[3], p[4], p[5] * itemsize))}
    done = 0
    unsaved = 0
    current_size = None
    for point in plan:
        name, base, k, s, backend, count, variant = point
        if s != current_size:
            _quiet_barrier(sync_backend)
            current_size = s
        real_bytes = count * itemsize
        done += 1
        if point in already:
            continue
        if progress is not None and rank == 0:
            how = f" ({variant})" if variant else ""
            progress(done, len(plan), f"{name} on {backend}{how}, {s} ranks, {real_bytes} B")
        if rank >= s:
            continue  # not in this group: wait at the next quiet barrier
        with forced(backend, base, variant):
            seconds = measure_point(cfg, base, k, backend, count, rank, s, groups[s])
        if rank == 0:
            if variant:
                table.add_variant(name, s, backend, real_bytes, variant, seconds)
            else:
                table.add(name, s, backend, real_bytes, seconds)
            unsaved += 1
            if unsaved >= cfg.save_every:
                save(table)
                unsaved = 0
    _quiet_barrier(sync_backend)
    if rank == 0:
        save(table)
    if progress is not None and rank == 0:
        progress(len(plan), len(plan), "measured")
    if cfg.confirm > 0:
        confirm_points(cfg, table, groups, save, progress)
    if progress is not None and rank == 0:
        progress(len(plan), len(plan), "done")
    return table


def suspicious_points(table: TuningTable, backends: Sequence[str],
                      margin: float) -> list[tuple[str, int, int]]:
    """(op, group size, bytes) whose winner among ``backends`` is an isolated flip (it
    differs from the winners at both neighbouring sizes) or beats the runner-up by less
    than ``margin``, or where the faster MPI variant of one of ``backends`` is an isolated
    flip. An end point that differs from its one neighbour may be a regime change: only
    the margin test applies there."""
    def flip(win: list, i: int) -> bool:  # an interior point unlike both neighbours
        return 0 < i < len(win) - 1 and win[i - 1] != win[i] != win[i + 1]

    out = []
    for op in table.ops():
        for g in table.group_sizes(op):
            for b in backends:
                wins = variant_winners(table.variant_times(op, g, b))
                win = [v for _, v in wins]
                out += [(op, g, n) for i, (n, _) in enumerate(wins)
                        if flip(win, i) and (op, g, n) not in out]
            per_b = {b: table.times(op, g, b) for b in backends}
            per_b = {b: pts for b, pts in per_b.items() if pts}
            if len(per_b) < 2:
                continue
            sizes = sorted(set.intersection(*(set(p) for p in per_b.values())))
            ranked = [sorted((per_b[b][n], b) for b in per_b) for n in sizes]
            win = [r[0][1] for r in ranked]
            for i, n in enumerate(sizes):
                close = ranked[i][1][0] < margin * ranked[i][0][0]
                if (flip(win, i) or close) and (op, g, n) not in out:
                    out.append((op, g, n))
    return out


def confirm_points(cfg: SuiteConfig, table: TuningTable, groups: dict,
                   save: Callable[[TuningTable], None],
                   progress: Callable[[int, int, str], None] | None = None) -> None:
    """Re-measure rank 0's suspicious points that no earlier pass confirmed, on every
    rank; each is recorded as confirmed and (rank 0) saved as it ends, so that an
    interrupted pass keeps what it did and a resumed one does not redo it."""
    import random

    from mcrdl.backends.registry import backend_class

    rank = mcrdl.get_rank()
    dtype = DTYPES[cfg.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    points = None
    if rank == 0:
        points = [p for p in suspicious_points(table, cfg.backends, cfg.confirm_margin)
                  if not table.is_confirmed(*p)]
    points = mcrdl.broadcast_object(points)
    rng = random.Random(len(points))
    for i, (name, s, nbytes) in enumerate(points):
        base, _, k = name.partition("@overlap")
        k = int(k or 1)
        if base not in cfg.ops or s not in groups or nbytes % itemsize:
            continue
        _quiet_barrier(cfg.backends[0])
        if progress is not None and rank == 0:
            progress(i, len(points), f"confirming {name} ({i + 1}/{len(points)}), {s} ranks, "
                                     f"{nbytes} B")
        here = [b for b in cfg.backends if base in backend_class(b).supported_ops()]
        # Every rank draws the orders, members of the point's group or not, so that all
        # ranks' generators stay in step and agree on the order of later points.
        orders = [rng.sample(here, len(here)) for _ in range(cfg.confirm)]
        if rank >= s:
            continue
        count = nbytes // itemsize
        measured = {(b, v): [] for b in here for v in variants_of(b, base, k)}
        for order in orders:
            for b in order:
                for v in variants_of(b, base, k):
                    with forced(b, base, v):
                        measured[b, v].append(
                            measure_point(cfg, base, k, b, count, rank, s, groups[s]))
        if rank == 0:
            for (b, v), more in measured.items():
                old = (table.variant_times(name, s, b).get(v, {}) if v
                       else table.times(name, s, b)).get(nbytes)
                seconds = statistics.median(more + ([old] if old is not None else []))
                if v:
                    table.add_variant(name, s, b, nbytes, v, seconds)
                else:
                    table.add(name, s, b, nbytes, seconds)
            table.mark_confirmed(name, s, nbytes)
            save(table)
    _quiet_barrier(cfg.backends[0])
