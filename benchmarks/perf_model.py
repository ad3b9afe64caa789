"""Validate the 4D communication model: replay each grid's collectives and compare.

    mpiexec -n 8 python benchmarks/perf_model.py [--model small] [--n-embd 256] [--batch 16]
        [--steps 3] [--rounds 4] [--table T.json] [--plot fig.png]

For every grid (G_x, G_y, G_z, G_data) of the world that fits the model, one training
step's collectives, exactly the list ``training.parallel4d.perf_model.collectives`` gives, are
replayed without compute on the grid's axis groups (``ProcessGrid`` with X innermost)
through mcrdl's "auto"; the step time is the median over steps of the maximum over
ranks. Grids run in blocks, in a shuffled order each round (the same on every rank), so
that slow drift of this shared machine hits every grid alike.

Three models predict each grid's time and are compared with the measurement by Spearman
rank correlation and by how many of the model's 3 fastest grids are among the 3 fastest
measured:

- ``paper``: Eq. 5.1-5.7 as the dissertation has them: bandwidth only (alpha = 0), one
  bandwidth inside the node, every op at that bandwidth.
- ``table``: alpha and relative bandwidth per op from the tuning table's fits
  (``Network.from_tuning_table``; the shipped table of this machine unless --table),
  the bandwidth its all_reduce fit.
- ``measured``: this machine measured just before the replay: concurrent collectives on
  every (inner degrees, G) group layout of the world (Eq. 5.7's intra-node table),
  alpha and relative bandwidth per op fitted to them (``mcrdl.tuning.model.fit``).

Rank 0 prints the environment, one line per grid, the correlations and the replay's
agreement with itself (odd against even rounds: the noise ceiling on this shared
machine); ``--plot`` writes measured against predicted time (as the dissertation's
Figure 5.2). ``measure_step_time`` is where the 4D engine's measured step time joins
the comparison once the engine exists.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

import mcrdl
from mcrdl.tuning.model import fit
from mcrdl.tuning.provenance import SHIPPED_TABLES, current_provenance, find_shipped_table
from mcrdl.tuning.table import TuningTable
from training.core.topology import Axis, ProcessGrid
from training.models.gpt import CONFIGS, get_config
from training.parallel4d.perf_model import (
    AXES,
    WORLD,
    Collective,
    Grid4D,
    Network,
    TrainingStep,
    collectives,
    predict,
    rank_grids,
)
from training.parallel4d.perf_model.collectives import OPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("forward", "backward", "gradients", "step")
CALIBRATION_BYTES = (4 << 10, 64 << 10, 512 << 10, 2 << 20)


def measure_step_time(run_step: Callable[[], None], steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``run_step`` (after ``warmup`` untimed ones),
    each the maximum over ranks; every rank calls it with the same arguments.

    The replay times its collectives with this; the 4D engine's measured step time (issue
    18: measured step time beside replayed communication) is to be taken with the same
    function, passing the engine's training step as ``run_step``."""
    for _ in range(warmup):
        run_step()
    times = []
    for _ in range(steps):
        mcrdl.barrier("mpi")
        t0 = time.perf_counter()
        run_step()
        times.append(time.perf_counter() - t0)
    worst = torch.tensor(times, dtype=torch.float64)
    mcrdl.all_reduce("mpi", worst, op=mcrdl.ReduceOp.MAX)
    return worst.tolist()


# -- the replay -------------------------------------------------------------------------

def replay_step(entries: list[Collective], groups: dict) -> Callable[[], None]:
    """A function issuing one step's collectives: phase by phase, round-robin over the
    phase's entries (the first call of each, then the second, ...), so that a layer's
    calls interleave as the engine's do."""
    calls = [(e, _call(e, groups[e.axis])) for e in entries]
    order = []
    for phase in PHASES:
        mine = [(e, f) for e, f in calls if e.phase == phase]
        for i in range(max((e.count for e, _ in mine), default=0)):
            order += [f for e, f in mine if i < e.count]

    def run() -> None:
        for f in order:
            f()

    return run


def _call(e: Collective, group) -> Callable[[], None]:
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[
        e.dtype_bytes]
    p = mcrdl.get_size() if group is None else group.size
    if e.op == "all_reduce":
        t = torch.ones(e.elements, dtype=dtype)
        return lambda: mcrdl.all_reduce("auto", t, group=group)
    if e.op == "all_gather":
        inp, out = torch.ones(e.elements // p, dtype=dtype), torch.empty(e.elements, dtype=dtype)
        return lambda: mcrdl.all_gather("auto", out, inp, group=group)
    inp, out = torch.ones(e.elements, dtype=dtype), torch.empty(e.elements // p, dtype=dtype)
    return lambda: mcrdl.reduce_scatter("auto", out, inp, group=group)


class SharedGroups:
    """One mcrdl group per distinct line of ranks, shared by every grid that has it.

    ``ProcessGrid`` lays the grid out (X innermost, as the engine will); its lines depend
    only on (product of the inner degrees, axis degree), so the 8-rank grids have 17
    lines in all. Creating each grid's own groups instead would leave ~6 more idle lane
    threads per grid in every process, and their wake-ups slow every grid replayed after
    them on 2 cores. Collective: every rank asks for the same grids in the same order."""

    def __init__(self, world: int):
        self.world = world
        self.groups: dict[tuple[int, ...], mcrdl.Group] = {}

    def of(self, grid: Grid4D) -> dict:
        """This rank's group of each axis of ``grid`` (None for degree 1 and the world)."""
        layout = ProcessGrid(grid.sizes(), order=list(AXES), world_size=self.world,
                             rank=mcrdl.get_rank())
        out = {WORLD: None}
        for axis in AXES:
            out[axis] = self.line(layout, axis) if grid.degree(axis) > 1 else None
        return out

    def line(self, layout: ProcessGrid, axis: str) -> mcrdl.Group:
        for ranks in sorted({tuple(layout.line(axis, r)) for r in range(self.world)}):
            if ranks not in self.groups:
                self.groups[ranks] = mcrdl.new_group(list(ranks))
        return self.groups[tuple(layout.line(axis))]


# -- measuring the machine --------------------------------------------------------------

def measure_network(groups: SharedGroups, steps: int) -> Network:
    """Eq. 5.7's intra-node table and alpha per op from concurrent collectives on this
    machine. For each layout (inner, G) with inner * G dividing the world, every group of
    G ranks at stride ``inner`` runs each op at once at CALIBRATION_BYTES, and
    ``mcrdl.tuning.model.fit`` fits alpha and beta to each (op, layout). alpha(op) is the
    median of the op's fits over layouts, the bandwidth of a layout all_reduce's 1 / beta
    there, rate(op) the median over layouts of the op's 1 / beta relative to all_reduce's;
    the whole world is one node."""
    world = groups.world
    fits = {}
    for inner in _divisors(world):
        for g in _divisors(world // inner):
            if g == 1:
                continue
            # the Y axis of (inner, g, 1, world / (inner g)) is the layout (inner, g)
            group = groups.of(Grid4D(inner, g, 1, world // (inner * g)))["y"]
            for op in OPS:
                samples = []
                for nbytes in CALIBRATION_BYTES:
                    e = Collective(op, "y", nbytes // 4 // g * g, 4, 1, "step", "calibration")
                    seconds = statistics.median(measure_step_time(_call(e, group), steps, 2))
                    samples.append((g, e.nbytes, seconds))
                fits[op, inner, g] = fit(op, samples)
    layouts = sorted({(inner, g) for _, inner, g in fits})
    speed = {key: 1 / max(f.beta, 1e-15) for key, f in fits.items()}
    latency = {op: statistics.median(fits[op, i, g].alpha for i, g in layouts) for op in OPS}
    rate = {op: statistics.median(speed[op, i, g] / speed["all_reduce", i, g]
                                  for i, g in layouts) for op in OPS}
    table = {(i, g): speed["all_reduce", i, g] for i, g in layouts}
    return Network(world, intra_node_bandwidth=statistics.median(table.values()),
                   latency=latency, op_rate=rate, intra_node_table=table)


def table_network(table: TuningTable, world: int) -> Network:
    """alpha per op from the table's fits, bandwidth the best all_reduce fit (bytes/s)."""
    fits = [table.model("all_reduce", b) for b in table.backends("all_reduce")]
    bandwidth = max(1 / f.beta for f in fits if f.beta > 0)
    return Network.from_tuning_table(table, world, intra_node_bandwidth=bandwidth)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- comparing ---------------------------------------------------------------------------

def ranks_of(values: list[float]) -> np.ndarray:
    """1-based ranks, ties sharing their mean rank."""
    v = np.asarray(values, dtype=np.float64)
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(1, len(v) + 1)
    for x in np.unique(v):
        tied = v == x
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (Pearson's of the ranks)."""
    ra, rb = ranks_of(a), ranks_of(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def top_overlap(predicted: list[float], measured: list[float], k: int = 3) -> int:
    """How many of the k grids predicted fastest are among the k measured fastest."""
    return len(set(np.argsort(predicted, kind="stable")[:k])
               & set(np.argsort(measured, kind="stable")[:k]))


def plot(path: str, labels: list[str], measured: list[float],
         predicted: dict[str, list[float]], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    order = np.argsort(predicted["measured"], kind="stable")
    x = np.arange(len(order))
    left.bar(x, [measured[i] * 1e3 for i in order], color="#9ab", label="replayed (measured)")
    left.plot(x, [predicted["measured"][i] * 1e3 for i in order], "o-", color="#c30",
              label="model (measured network)")
    left.set_xticks(x, [labels[i] for i in order], rotation=70, fontsize=7)
    left.set_xlabel("grid (Gx,Gy,Gz,Gdata), in the model's order")
    left.set_ylabel("communication per step (ms)")
    left.legend()
    for name, marker in zip(predicted, "os^", strict=False):
        rho = spearman(predicted[name], measured)
        right.scatter([p * 1e3 for p in predicted[name]], [m * 1e3 for m in measured],
                      marker=marker, label=f"{name} network (Spearman {rho:.2f})")
    for i, label in enumerate(labels):
        right.annotate(label, (predicted["measured"][i] * 1e3, measured[i] * 1e3), fontsize=6)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("predicted (ms; the paper's model has no latency, so its scale differs)")
    right.set_ylabel("replayed (ms)")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- main ---------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=sorted(CONFIGS),
                   help="GPT shape (default small)")
    for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"override the model's {name}")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--micro-batches", type=int, default=1, help="passes per step (default 1)")
    p.add_argument("--steps", type=int, default=3,
                   help="timed steps per grid and round (default 3)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps per grid and round (default 1)")
    p.add_argument("--rounds", type=int, default=4, help="rounds over all grids (default 4)")
    p.add_argument("--calibration-steps", type=int, default=6,
                   help="timed calls per calibration point (default 6)")
    p.add_argument("--table", default=None, help="tuning table (default: the shipped one)")
    p.add_argument("--seed", type=int, default=0, help="grid order seed (default 0)")
    p.add_argument("--backends", nargs="+", default=["mpi", "gloo"],
                   help="backends 'auto' chooses from (default mpi gloo)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the figure here")
    p.add_argument("--engine", action="store_true",
                   help="also train each grid with the 4D engine (training/parallel4d) on "
                        "the byte corpus and time its steps (compute + communication)")
    p.add_argument("--overlap", default="none", choices=("none", "oar", "oar+ors", "all"),
                   help="the engine's --overlap (default none)")
    args = p.parse_args()

    mcrdl.init(args.backends, tuning_table=args.table)
    rank, world = mcrdl.get_rank(), mcrdl.get_size()
    model = get_config(args.model, n_layer=args.n_layer, n_head=args.n_head,
                       n_embd=args.n_embd, block_size=args.block_size,
                       vocab_size=args.vocab_size)
    step = TrainingStep(model, args.batch, args.micro_batches)
    table_path = args.table or find_shipped_table(SHIPPED_TABLES,
                                                  current_provenance())
    t0 = time.perf_counter()
    groups = SharedGroups(world)
    measured_net = measure_network(groups, args.calibration_steps)
    networks = {"measured": measured_net, "paper": Network(world, latency=0.0)}
    if table_path is not None:
        networks["table"] = table_network(TuningTable.load(table_path), world)
    calibration_s = time.perf_counter() - t0

    feasible = [pr.grid for pr in rank_grids(step, world, networks["paper"]).ranked]
    feasible.sort(key=Grid4D.as_tuple)
    axis_groups = {g: groups.of(g) for g in feasible}
    times: dict[Grid4D, list[list[float]]] = {g: [] for g in feasible}  # per round
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    for i in range(args.rounds):
        for g in rng.sample(feasible, len(feasible)):
            run = replay_step(collectives(step, g), axis_groups[g])
            times[g].append(measure_step_time(run, args.steps, args.warmup))
        if rank == 0:
            print(f"# round {i + 1}/{args.rounds} done after {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    replay_s = time.perf_counter() - t0

    engine_times = measure_engine(args, model, feasible, axis_groups) if args.engine else None
    if rank == 0:
        measured = [statistics.median(t for r in times[g] for t in r) for g in feasible]
        predicted = {name: [predict(step, g, net).seconds for g in feasible]
                     for name, net in networks.items()}
        report(args, step, world, feasible, times, measured, predicted, networks,
               table_path, calibration_s, replay_s)
        if engine_times is not None:
            report_engine(args, step, feasible, engine_times, measured, predicted)
        if args.plot:
            title = (f"{args.model} {model.n_layer}x{model.n_embd} (heads {model.n_head}, "
                     f"vocab {model.vocab_size}, seq {model.block_size}), batch {args.batch}, "
                     f"{world} ranks: replayed communication vs the model")
            plot(args.plot, [str(g) for g in feasible], measured, predicted, title)
            print(f"# plot: {args.plot}")
    mcrdl.finalize()
    return 0


class SharedLayout:
    """The grid Trainer4D runs on, with SharedGroups' groups: a trainer per grid making
    its own groups would leave ~6 more idle lane threads per grid in every process, and
    with 19 grids their wake-ups made the last grids' steps seconds long on 2 cores."""

    world = None  # the whole world

    def __init__(self, grid: Grid4D, groups: dict):
        self.sizes = {Axis(a): grid.degree(a) for a in AXES}
        self.groups = {Axis(a): groups[a] for a in AXES}

    def group(self, axis) -> mcrdl.Group | None:
        return self.groups[Axis(axis)]


def measure_engine(args, model, feasible: list[Grid4D],
                   axis_groups: dict) -> dict[Grid4D, list[float]]:
    """Seconds per step of the 4D engine on each grid (``measure_step_time``: the
    maximum over ranks of each timed step), training on the byte corpus."""
    from training.parallel4d.trainer import Trainer4D
    from training.train_gpt import TrainConfig
    out = {}
    for g in feasible:
        micro = args.batch // (g.z * g.data * args.micro_batches)
        cfg = TrainConfig(model=args.model, n_layer=model.n_layer, n_head=model.n_head,
                          n_embd=model.n_embd, block_size=model.block_size, G_x=g.x, G_y=g.y,
                          G_z=g.z, G_data=g.data, engine="4d", global_batch_size=args.batch,
                          micro_batch_size=max(1, micro), overlap=args.overlap, quiet=True,
                          plot=False, progress=False)
        trainer = Trainer4D(cfg, grid=SharedLayout(g, axis_groups[g]))
        out[g] = measure_step_time(trainer.train_step, args.steps, args.warmup)
    return out


def report_engine(args, step, feasible, engine_times, replayed, predicted) -> None:
    """The engine's measured step time per grid beside the replay and the models."""
    tokens = step.batch * step.model.block_size
    measured = [statistics.median(engine_times[g]) for g in feasible]
    print(f"# the 4D engine, --overlap {args.overlap}: median step time over {args.steps} "
          "steps (max over ranks)")
    print(f"{'grid':>12} {'step(ms)':>10} {'tokens/s':>10} {'replay(ms)':>11}")
    for i in np.argsort(measured, kind="stable"):
        print(f"{str(feasible[i]):>12} {measured[i] * 1e3:>10.1f} {tokens / measured[i]:>10.0f} "
              f"{replayed[i] * 1e3:>11.2f}")
    print(f"# engine step time vs replayed communication: Spearman "
          f"{spearman(replayed, measured):+.3f}")
    for name, pred in predicted.items():
        print(f"# engine step time vs the {name} model: Spearman {spearman(pred, measured):+.3f};"
              f" model's top 3 in the engine's top 3: {top_overlap(pred, measured)}")


def _describe(net: Network) -> str:
    return ", ".join(f"{op} alpha {net.latency[op] * 1e6:.1f} us rate {net.op_rate[op]:.2f}"
                     for op in OPS)


def report(args, step, world, feasible, times, measured, predicted, networks, table_path,
           calibration_s, replay_s) -> None:
    m = step.model
    print(f"# 4D communication model vs replay: {world} ranks on {os.cpu_count()} cores "
          f"({platform.node()}), mcrdl 'auto', torch {torch.__version__}")
    print(f"# {args.model}: n_layer {m.n_layer}, n_embd {m.n_embd}, n_head {m.n_head}, "
          f"vocab {m.vocab_size}, seq {m.block_size}; batch {step.batch} x "
          f"{step.micro_batches} micro-batch(es), float32; {len(feasible)} grids fit; "
          f"{args.rounds} rounds x {args.steps} steps per grid")
    net = networks["measured"]
    print(f"# measured network (calibration, {calibration_s:.0f} s): {_describe(net)}")
    print("#   all_reduce bandwidth MB/s per (inner, G): " + ", ".join(
        f"{k}: {v / 1e6:.0f}" for k, v in net.intra_node_table.items()))
    if "table" in networks:
        tnet = networks["table"]
        print(f"# table network ({table_path}): {_describe(tnet)}; all_reduce bandwidth "
              f"{tnet.intra_node_bandwidth / 1e6:.0f} MB/s")
    else:
        print("# table network: no tuning table for this system (pass --table)")
    print(f"# replay: {replay_s:.0f} s")
    names = list(predicted)
    rank_of = {name: ranks_of(predicted[name]) for name in names}
    measured_rank = ranks_of(measured)
    print(f"{'grid':>12} {'calls':>6} {'replay(ms)':>11} {'spread(ms)':>15} {'rank':>5} "
          + " ".join(f"{name + '(ms)':>13} {'rank':>5}" for name in names))
    for i in np.argsort(measured, kind="stable"):
        g = feasible[i]
        lo, hi = min(map(min, times[g])) * 1e3, max(map(max, times[g])) * 1e3
        calls = sum(c.count for c in collectives(step, g))
        print(f"{str(g):>12} {calls:>6} {measured[i] * 1e3:>11.2f} {f'{lo:.1f}-{hi:.1f}':>15} "
              f"{measured_rank[i]:>5.0f} "
              + " ".join(f"{predicted[name][i] * 1e3:>13.3f} {rank_of[name][i]:>5.0f}"
                         for name in names))
    for name in names:
        print(f"# {name:>8} network: Spearman {spearman(predicted[name], measured):+.3f}; "
              f"model's top 3 in the measured top 3: {top_overlap(predicted[name], measured)}")
    if args.rounds >= 2:  # how well the measurement agrees with itself: the noise ceiling
        halves = [[statistics.median(t for r in times[g][k::2] for t in r) for g in feasible]
                  for k in (0, 1)]
        print(f"# the replay against itself (odd vs even rounds): Spearman "
              f"{spearman(*halves):+.3f}; top 3 shared: {top_overlap(*halves)}")


if __name__ == "__main__":
    raise SystemExit(main())
