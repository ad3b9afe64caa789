"""mcrdl-tune: produce (``run``) and look at (``plot``) tuning tables.

    mpiexec -n 8 mcrdl-tune run --output mine.json
    mpiexec -n 8 mcrdl-tune run --output mine.json --resume   # after an interruption
    mcrdl-tune show mine.json
    mcrdl-tune plot mine.json --out-dir plots/

``run`` benchmarks every operation (default: all collectives of the API) on every
initialized backend over a size sweep (default powers of two, 8 B .. 64 MiB) at the
world size and sub-group sizes 2, 4, ...; rank 0 shows a progress bar and writes the
table atomically as it goes. On the mpi backends each collective with a blocking
variant is timed as the blocking MPI call, as the nonblocking one and (all_gather,
reduce_scatter) as one blocking MPI_Allreduce of the whole buffer; the table
records which one their blocking calls run, per op, group size and size. Point "auto"
and the mpi backends at the table with ``mcrdl.init(tuning_table=PATH)`` or
``MCRDL_TUNING_TABLE=PATH``. ``show`` prints a table's times, winners and variants.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from collections.abc import Sequence

from mcrdl.tuning.sizes import add_size_sweep_args, check_size_sweep, size_range

from .bench import DTYPES, non_negative_int, positive_int


def _sizes(args) -> list[int]:
    return size_range(args.min_bytes, args.max_bytes, args.factor)


def _overlap(text: str) -> int:
    value = int(text)
    if value == 1 or value < 0:
        raise argparse.ArgumentTypeError(
            f"expected 0 (off) or K >= 2 ops in flight at once, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .tuning_suite import DEFAULT_OPS

    p = argparse.ArgumentParser(prog="mcrdl-tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="measure and write a tuning table (run on every rank)")
    r.add_argument("--op", nargs="+", default=list(DEFAULT_OPS), choices=DEFAULT_OPS,
                   metavar="OP", help=f"operations (default: all of {', '.join(DEFAULT_OPS)})")
    r.add_argument("--backend", nargs="+", default=None, metavar="NAME",
                   help="backends (default: every backend usable here)")
    add_size_sweep_args(r, factor=2)
    r.add_argument("--group-sizes", type=int, nargs="+", default=None, metavar="S",
                   help="group sizes to measure (default 2, 4, ... and the world size)")
    r.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    r.add_argument("--iters", type=positive_int, default=20,
                   help="timed iterations up to 64 KiB, scaled down above (default 20)")
    r.add_argument("--warmup", type=non_negative_int, default=3,
                   help="untimed iterations (default 3)")
    r.add_argument("--overlap", type=_overlap, default=0, metavar="K",
                   help="also time K >= 2 concurrent async ops per point (paper's overlapped "
                        "mode; default 0: off)")
    r.add_argument("--confirm", type=non_negative_int, default=3, metavar="N",
                   help="re-measure isolated or close winners N more times, keep the median "
                        "(default 3; 0 turns the confirmation pass off)")
    r.add_argument("--confirm-margin", type=float, default=1.25, metavar="R",
                   help="a winner faster than the runner-up by less than R x is re-measured "
                        "(default 1.25)")
    r.add_argument("--output", required=True, help="table to write (JSON)")
    r.add_argument("--resume", action="store_true",
                   help="continue an interrupted run: keep the points already in --output")
    r.add_argument("--force", action="store_true", help="overwrite an existing --output")
    r.add_argument("--system", default="", help="system name stored in the provenance")
    mo = sub.add_parser("model", help="fit the alpha-beta model, print held-out error")
    mo.add_argument("table", help="tuning table (JSON)")
    sh = sub.add_parser("show", help="print the times, winners and MPI variants of a table")
    sh.add_argument("table", help="tuning table (JSON)")
    pl = sub.add_parser("plot", help="heatmap of winners and latency curves (PNG)")
    pl.add_argument("table", help="tuning table (JSON)")
    pl.add_argument("--out-dir", default=".", help="where to write the PNGs (default .)")
    return p


def _run(args) -> int:
    import mcrdl
    from mcrdl.tuning.table import TuningTable

    from .tuning_suite import SuiteConfig, default_group_sizes, run_suite

    mcrdl.init(args.backend)
    rank, world = mcrdl.get_rank(), mcrdl.get_size()
    backends = mcrdl.get_backends()
    group_sizes = sorted(set(args.group_sizes or default_group_sizes(world)))
    bad = [s for s in group_sizes if not 1 <= s <= world]
    if bad:
        if rank == 0:
            print(f"mcrdl-tune: --group-sizes {bad} outside 1..{world}", file=sys.stderr)
        mcrdl.finalize()
        return 2
    command = "mcrdl-tune " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    # Rank 0 decides and reads --output, and every rank takes its table: every rank must
    # make the same skip decisions, and --output need not be on a shared file system.
    error, doc = mcrdl.broadcast_object(_start(args, command) if rank == 0 else None)
    if error:
        if rank == 0:
            print(f"mcrdl-tune: {error}", file=sys.stderr)
        mcrdl.finalize()
        return 2
    table = TuningTable.from_dict(doc, source=args.output)
    cfg = SuiteConfig(ops=args.op, backends=backends, sizes=_sizes(args),
                      group_sizes=group_sizes, dtype=args.dtype, iters=args.iters,
                      warmup=args.warmup, overlap=args.overlap, confirm=args.confirm,
                      confirm_margin=args.confirm_margin)
    bar = _progress() if rank == 0 else None
    try:
        run_suite(cfg, table, lambda t: t.save(args.output), bar.update if bar else None)
    except KeyboardInterrupt:
        if rank == 0:
            table.save(args.output)
            print(f"\nmcrdl-tune: interrupted; partial table kept in {args.output} "
                  "(continue with --resume)", file=sys.stderr)
        return 130
    finally:
        if bar:
            bar.close()
    if rank == 0:
        print(f"mcrdl-tune: wrote {args.output} ({world} ranks on {socket.gethostname()}, "
              f"group sizes {group_sizes}, backends {backends})")
    mcrdl.finalize()
    return 0


def _start(args, command: str) -> tuple[str | None, dict | None]:
    """(why the run cannot start, None) or (None, the table to start from as a
    document): a new one, or --output's to --resume."""
    from mcrdl.tuning.provenance import current_provenance
    from mcrdl.tuning.schema import TuningTableError
    from mcrdl.tuning.table import TuningTable

    current = current_provenance(command)
    current["dtype"] = args.dtype
    current.update(_mpi_init_mode())
    if args.system:
        current["system"] = args.system
    # checked before measuring: rank 0 writes the table every few points, and a write
    # failing then ends that rank only, the others waiting for it until the timeout
    folder = os.path.dirname(os.path.abspath(args.output))
    if os.path.isdir(args.output):
        return f"--output {args.output} is a folder; name the table's file", None
    if not os.path.isdir(folder):
        return f"--output {args.output}: the folder {folder} does not exist", None
    if not os.access(folder, os.W_OK):
        return f"--output {args.output}: the folder {folder} is not writable", None
    if not os.path.exists(args.output) or args.force:
        if args.resume and not os.path.exists(args.output):
            print(f"mcrdl-tune: --resume: {args.output} does not exist yet; starting a new "
                  "table", file=sys.stderr)
        return None, TuningTable(current).to_dict()
    if not args.resume:
        return (f"{args.output} exists; pass --resume to continue it or --force to overwrite "
                "it"), None
    try:
        table = TuningTable.load(args.output)
    except TuningTableError as e:
        return f"cannot resume: {e}", None
    # points measured with other libraries or another dtype would mix into one table
    stale = table.stale_reasons(current)
    had = table.provenance.get("dtype", "float32")  # tables before the key: the default
    if had != args.dtype:
        stale.append(f"dtype: table measured with {had}, this run {args.dtype}")
    for key, now in _mpi_init_mode().items():  # the variants' times depend on it
        then = table.provenance.get(key, now)  # tables before the keys: not compared
        if then != now:
            stale.append(f"{key}: table measured with {then!r}, this run {now!r}")
    if stale:
        return (f"cannot resume {args.output}: {'; '.join(stale)}. Resume it with what it "
                "was measured with, or start over with --force"), None
    if args.system:
        table.provenance["system"] = args.system
    return None, table.to_dict()


def _mpi_init_mode() -> dict:
    """How MPI was initialized (mcrdl.backends.mpi.mpi_init_mode), when a backend of this
    run uses it: which blocking variant wins depends on it, and a table records it
    (a backend whose steps it reads ignores steps measured under another selection)."""
    import mcrdl
    from mcrdl.api import current_runtime

    for name in mcrdl.get_backends():
        mode = getattr(current_runtime().backend(name), "init_mode", None)
        if mode:
            return dict(mode)
    return {}


class _progress:
    """Rank 0's progress on stderr: a rich bar on a terminal; elsewhere (under mpiexec,
    into a log file) a plain line at the first point, then at every tenth of the plan or
    after 30 s, whichever comes first, and at the end."""

    _EVERY_S = 30.0

    def __init__(self):
        import time

        self._clock = time.monotonic
        self._task = None
        self._p = None
        self._last, self._last_tenth = None, -1
        if not sys.stderr.isatty():
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), TimeRemainingColumn(), transient=False,
                           console=Console(stderr=True))
        self._p.start()

    def update(self, done: int, total: int, what: str) -> None:
        if self._p is not None:
            if self._task is None:
                self._task = self._p.add_task("tuning", total=total)
            self._p.update(self._task, completed=done, description=f"tuning: {what:<48}")
            return
        now, tenth = self._clock(), (10 * done) // max(total, 1)
        if (self._last is None or tenth > self._last_tenth or done >= total
                or now - self._last >= self._EVERY_S):
            print(f"mcrdl-tune: {done}/{total} {what}", file=sys.stderr, flush=True)
            self._last, self._last_tenth = now, tenth

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


def _model(args) -> int:
    """Per (backend, op): alpha, beta and the relative error of the model on points it
    was not fitted on, twice: held-out sizes (every third size) and the largest group
    size (extrapolation in scale, what predictions for big machines rely on)."""
    from mcrdl.tuning import model
    from mcrdl.tuning.table import TuningTable

    table = TuningTable.load(args.table)
    print(f"# alpha-beta model of {args.table} (relative error |predicted - measured| / "
          "measured on held-out points)")
    print(f"# {'backend':<8} {'op':<20} {'alpha(us)':>10} {'beta(ns/B)':>11} "
          f"{'sizes: median':>14} {'max':>7} {'top group: median':>18} {'max':>7}")
    for backend in table.backends():
        for op in table.ops():
            samples = table.samples(op, backend)
            sizes = sorted({n for _, n, _ in samples})
            top = max((g for g, _, _ in samples), default=0)
            if len(sizes) < 3 or not model.is_modelled(op):
                continue
            third = set(sizes[1::3])
            by_size = model.holdout_error(op, samples, lambda g, n, t, third=third: n in third)
            groups = {g for g, _, _ in samples}
            by_group = (model.holdout_error(op, samples, lambda g, n, t, top=top: g == top)
                        if len(groups) > 1 else None)
            full = model.fit(op, samples)
            row = (f"  {backend:<8} {op:<20} {full.alpha * 1e6:>10.2f} "
                   f"{full.beta * 1e9:>11.4f} {by_size['median_rel_err']:>14.1%} "
                   f"{by_size['max_rel_err']:>7.1%}")
            if by_group is not None:
                row += (f" {by_group['median_rel_err']:>18.1%} "
                        f"{by_group['max_rel_err']:>7.1%}")
            print(row)
    return 0


def _show(args) -> int:
    """Per op and group size: the time of every backend (us) at each size (* where the
    confirmation pass re-measured it), the time of each MPI variant and which one the
    backend's blocking calls run, the winners."""
    from mcrdl.tuning.schema import VARIANTS, step_variant
    from mcrdl.tuning.sizes import format_size
    from mcrdl.tuning.table import TuningTable

    table = TuningTable.load(args.table)
    prov = table.provenance
    print(f"# {args.table}: host {prov.get('host', '?')}, {prov.get('date', '?')}, "
          f"{prov.get('command', '?')}")

    def us(t):
        return "-" if t is None else f"{t * 1e6:.2f}"

    for op in table.ops():
        for g in table.group_sizes(op):
            backends = table.backends(op)
            per_b = {b: table.times(op, g, b) for b in backends}
            per_v = {b: table.variant_times(op, g, b) for b in backends}
            per_v = {b: v for b, v in per_v.items() if v}
            steps = {b: table.blocking_steps(op, g, b) for b in backends}
            names = [v for v in VARIANTS if any(v in pv for pv in per_v.values())]
            cols = [*backends, *(f"{b}:{v}" for b in per_v for v in names)]
            print(f"\n{op}, {g} ranks (us)")
            w = [max(10, len(c)) for c in cols]
            print(f"  {'size':>8} " + " ".join(f"{c:>{x}}" for c, x in zip(cols, w, strict=True)))
            sizes = sorted({n for pts in per_b.values() for n in pts})
            for n in sizes:
                row = [us(per_b[b].get(n)) for b in backends]
                row += [us(per_v[b].get(v, {}).get(n)) for b in per_v for v in names]
                mark = "*" if table.is_confirmed(op, g, n) else " "
                print(f"  {format_size(n):>8}{mark}"
                      + " ".join(f"{c:>{x}}" for c, x in zip(row, w, strict=True)))
            if any(table.is_confirmed(op, g, n) for n in sizes):
                print("  *: re-measured by the confirmation pass")
            print("  winners: " + ", ".join(f"{b} from {format_size(n)}"
                                            for n, b in table.winners(op, g)))
            for b, st in steps.items():
                if st:
                    parts = [f"{step_variant(v)} "
                             + (f"up to {format_size(hi)} B" if hi >= 0
                                else "above" if i else "at every size")
                             for i, (hi, v) in enumerate(st)]
                    if st[-1][0] >= 0:  # past the last step: the nonblocking call
                        parts.append("nonblocking above")
                    print(f"  {b} blocking calls run: " + ", ".join(parts))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        check_size_sweep(parser, args)
        return _run(args)
    from mcrdl.tuning.schema import TuningTableError

    try:  # a table that cannot be read: one line naming it and the fix, exit 2
        if args.command == "model":
            return _model(args)
        if args.command == "show":
            return _show(args)
        from mcrdl.tuning.plot import plot_table

        for path in plot_table(args.table, args.out_dir):
            print(path)
        return 0
    except TuningTableError as e:
        parser.exit(2, f"mcrdl-tune {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
