"""PCCL's hierarchical collectives against flat MPI and Gloo, ring vs recursive inter-node
phases, C++ vs Python, and the cost model at the PCCL paper's scales.

    MCRDL_RANKS_PER_NODE=4 mpiexec -n 8 python benchmarks/pccl.py     # 2 simulated nodes
    MCRDL_RANKS_PER_NODE=4 mpiexec -n 16 python benchmarks/pccl.py    # 4 simulated nodes

Printed (rank 0; time per call: median over samples of the per-sample max over ranks,
a sample being up to 20 calls back to back after a barrier):
1. all_gather and reduce_scatter, bytes per rank from --min-bytes to --max-bytes:
   pccl with a ring and with a recursive (rd) inter-node phase, flat MPI, Gloo.
2. The inter-node algorithms alone, flat over the world (C++): ring vs rd, the measured
   crossover (the size from which ring wins at every larger size: an isolated win of
   either at small sizes is noise of oversubscribed ranks), and the crossover the
   alpha-beta model fitted to these measurements (relative least squares) predicts.
3. C++ vs the mpi4py reference (mcrdl/backends/pccl_ref.py) of the same algorithm,
   small messages: the speedup of C++.
4. PREDICTIONS for 32..4096 ranks (8 per node), 16 KiB and 1 MiB per rank, by the model
   fitted in 2 and by the model "auto" routes with (CostModel's defaults or
   MCRDL_PCCL_MODEL): flat ring vs PCCL (rd inter-node + ring intra-node) all_gather.
   Not measurements.
"""

# Every lambda below is timed within the loop iteration that builds it:
# ruff: noqa: B023
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import mcrdl
from mcrdl import _C
from mcrdl.backends import pccl_ref
from mcrdl.backends.pccl import initialized, use_algorithms
from mcrdl.backends.pccl_cost_model import CostModel
from mcrdl.launch import usable_cores
from mcrdl.tuning.sizes import format_size, parse_size, size_range


def timed(fn, iters: int, back: int = 1, warmup: int = 2) -> float:
    """Seconds per call: each of `iters` samples times `back` calls issued back to back
    after a barrier (the barrier's exit skew, milliseconds with 16 ranks on 2 cores,
    would swamp microsecond differences of single calls); median over samples of the
    per-sample maximum over ranks."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        mcrdl.barrier("mpi")
        t0 = time.perf_counter()
        for _ in range(back):
            fn()
        ts.append((time.perf_counter() - t0) / back)
    worst = torch.tensor(ts, dtype=torch.float64)
    mcrdl.all_reduce("mpi", worst, op=mcrdl.ReduceOp.MAX)
    return statistics.median(worst.tolist())


def iters_for(nbytes: int, base: int) -> int:
    return max(3, min(base, int(base * (64 << 10) / max(nbytes, 1))))


def back_for(nbytes: int) -> int:
    """Calls per sample: 20 for small messages, down to 1 from 1 MiB on."""
    return max(1, min(20, (1 << 20) // max(nbytes, 1)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", type=parse_size, default=1 << 10)
    p.add_argument("--max-bytes", type=parse_size, default=16 << 20)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-gloo", action="store_true", help="skip Gloo (slow when oversubscribed)")
    args = p.parse_args()
    backends = ["mpi", "pccl"] + ([] if args.no_gloo else ["gloo"])
    mcrdl.init(backends)
    rank, world = mcrdl.get_rank(), mcrdl.get_size()
    lay = initialized().layouts[0]
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# pccl benchmark: {world} ranks, {lay.nodes} nodes x {lay.per_node} per node "
        f"({'hierarchical' if lay.hierarchical else 'flat'}), torch {torch.__version__}, "
        f"{mcrdl.bootstrap.mpi_module().Get_library_version().splitlines()[0].strip()}")
    sizes = size_range(args.min_bytes, args.max_bytes, args.factor)

    def check(op: str, backend: str, algo, n: int) -> None:
        """One call on rank-dependent data into a sentinel output, against numpy (the
        timed calls move ones, which an all_gather that moves nothing leaves right)."""
        mine = (torch.arange(n * world) % 5 + rank).float()
        ref = np.stack([np.arange(n * world) % 5 + r for r in range(world)]).astype(np.float32)
        if op == "all_gather":
            out = torch.full((n * world,), -1.0)
            mcrdl.all_gather(backend, out, mine[:n].clone())
            want = ref[:, :n].reshape(-1)
        else:
            out = torch.full((n,), -1.0)
            mcrdl.reduce_scatter(backend, out, mine)
            want = ref.sum(0)[rank * n:(rank + 1) * n]
        if not np.array_equal(out.numpy(), want):
            raise SystemExit(f"pccl benchmark: {op} on {backend} ({algo}) at {n} floats a "
                             "rank gave a wrong result")

    # 1. the backends side by side
    variants = [("pccl ring", "pccl", "ring"), ("pccl rd", "pccl", "rd"), ("mpi", "mpi", None)]
    if not args.no_gloo:
        variants.append(("gloo", "gloo", None))
    for op in ("all_gather", "reduce_scatter"):
        say(f"\n## {op}, bytes per rank; time (us) per variant; best marked *")
        say(f"# {'size':>8} " + " ".join(f"{v[0]:>11}" for v in variants))
        for nbytes in sizes:
            n = nbytes // 4
            small = torch.ones(n)
            big = torch.ones(n * world)
            row = []
            for _, b, algo in variants:
                if op == "all_gather":
                    fn = lambda b=b: mcrdl.all_gather(b, big, small)  # noqa: E731
                else:
                    fn = lambda b=b: mcrdl.reduce_scatter(b, small, big)  # noqa: E731
                with use_algorithms(inter=algo or "auto"):
                    row.append(timed(fn, iters_for(nbytes * world, args.iters),
                                     back_for(nbytes * world)))
                    check(op, b, algo, n)
            best = min(row)
            say(f"  {format_size(nbytes):>8} " + " ".join(
                f"{t * 1e6:>10.1f}{'*' if t == best else ' '}" for t in row))

    # 2. inter-node algorithms alone, flat over the world, C++
    MPI = mcrdl.bootstrap.mpi_module()
    comm_c, comm_py = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
    lane = _C.Lane("pccl-bench")
    flat = _C.PcclComm(comm_c.handle, rank, world, 0, 0, 1, [], "world (bench)", lane, 300.0)
    say(f"\n## inter-node algorithm alone: all_gather flat over {world} ranks (C++), "
        "bytes per rank")
    say(f"# {'size':>8} {'ring(us)':>10} {'rd(us)':>10} {'winner':>7}")
    meas = {"ring": [], "rd": []}
    for nbytes in sizes:
        n = nbytes // 4
        mine, out = torch.ones(n), torch.empty(n * world)
        t = {a: timed(lambda a=a: flat.all_gather(out, mine, a, "mpi", False),
                      iters_for(nbytes * world, args.iters), back_for(nbytes * world))
             for a in ("ring", "rd")}
        for a in t:
            meas[a].append((nbytes, t[a]))
        say(f"  {format_size(nbytes):>8} {t['ring'] * 1e6:>10.1f} {t['rd'] * 1e6:>10.1f} "
            f"{min(t, key=t.get):>7}")
    ring_wins = [tr < td for (_, tr), (_, td) in zip(meas["ring"], meas["rd"], strict=True)]
    measured = next((meas["ring"][i][0] for i in range(len(ring_wins)) if all(ring_wins[i:])),
                    None)
    model = CostModel.fit(world, [b for b, _ in meas["ring"]], [t for _, t in meas["ring"]],
                          [t for _, t in meas["rd"]])
    predicted = model.crossover(world)
    say(f"# measured crossover (ring wins from this size on): "
        f"{format_size(measured) if measured else 'none in range'}")
    say(f"# model fitted here: alpha {model.alpha * 1e6:.2f} us, beta_ring "
        f"{model.beta_ring * 1e9:.3f} ns/B, beta_rd {model.beta_rd * 1e9:.3f} ns/B -> predicted "
        f"crossover {format_size(int(predicted)) if predicted else 'none (rd always)'}"
        f"  (export MCRDL_PCCL_MODEL={model.alpha:.3g},{model.beta_ring:.3g},"
        f"{model.beta_rd:.3g})")

    # 3. C++ vs Python, small messages
    say(f"\n## C++ vs mpi4py reference, same algorithm, {world} ranks, all_gather and "
        "reduce_scatter (sum)")
    say("# MPI lib: the MPI library's own collective, called through mpi4py from these same "
        "processes; Python/MPI lib is the speedup an implementation as fast as the MPI "
        "library's would show (the machine's floor, not a bound on C++)")
    say(f"# {'size':>8} {'algo':>5} {'op':>14} {'C++(us)':>9} {'Python(us)':>11} {'speedup':>8}"
        f" {'MPI lib(us)':>12} {'C++/MPI lib':>12} {'Python/MPI lib':>15}")
    # per algorithm, small messages (<= 4 KiB per rank): C++ speedup, C++ and Python / lib
    small: dict[str, dict[str, list[float]]] = {}
    for nbytes in [s for s in sizes if s <= 64 << 10] or sizes[:1]:
        n = nbytes // 4
        buf = np.zeros(n * world, dtype=np.float32)
        npiece = np.empty(n, dtype=np.float32)
        lib = {"all_gather": timed(lambda: comm_py.Allgather(MPI.IN_PLACE, buf), args.iters,
                                   back_for(nbytes * world)),
               "reduce_scatter": timed(lambda: comm_py.Reduce_scatter_block(buf, npiece,
                                                                            op=MPI.SUM),
                                       args.iters, back_for(nbytes * world))}
        for algo in ("ring", "rd"):
            mine, out = torch.ones(n), torch.empty(n * world)
            src = torch.ones(n * world)
            piece = torch.empty(n)
            rows = (
                ("all_gather", lambda: flat.all_gather(out, mine, algo, "mpi", False),
                 lambda: pccl_ref.all_gather(comm_py, buf, n, algo)),
                ("reduce_scatter",
                 lambda: flat.reduce_scatter(piece, src, int(mcrdl.ReduceOp.SUM), algo, "mpi",
                                             False),
                 lambda: pccl_ref.reduce_scatter(comm_py, buf.copy(), npiece, n, "sum", algo)),
            )
            for op, cpp, py in rows:
                tc = timed(cpp, args.iters, back_for(nbytes * world))
                tp = timed(py, args.iters, back_for(nbytes * world))
                if nbytes <= 4 << 10:
                    acc = small.setdefault(algo, {"speedup": [], "cpp": [], "py": []})
                    acc["speedup"].append(tp / tc)
                    acc["cpp"].append(tc / lib[op])
                    acc["py"].append(tp / lib[op])
                say(f"  {format_size(nbytes):>8} {algo:>5} {op:>14} {tc * 1e6:>9.1f} "
                    f"{tp * 1e6:>11.1f} {tp / tc:>7.2f}x {lib[op] * 1e6:>12.1f} "
                    f"{tc / lib[op]:>11.2f}x {tp / lib[op]:>14.2f}x")
    if small:
        med = statistics.median
        say(f"# small messages (<= 4 KiB per rank), C++ speedup over Python: median "
            f"{med([x for a in small.values() for x in a['speedup']]):.2f}x over both "
            "algorithms (target >= 3x at 16 ranks); " + "; ".join(
                f"{algo} {med(a['speedup']):.2f}x (min {min(a['speedup']):.2f}x), C++ at "
                f"{med(a['cpp']):.2f}x and Python at {med(a['py']):.2f}x the MPI library's time"
                for algo, a in small.items()))
    cores = usable_cores()
    if world > cores:
        say(f"# {world} ranks on {cores} cores: every step waits for the scheduler, which both "
            "implementations pay alike: where C++ is at ~1x the MPI library's own collective it "
            "is at the floor this machine gives, and its speedup cannot exceed Python/MPI lib; "
            "the speedups above understate C++'s (run with one core per rank for the real "
            "figure)")
    lane.shutdown("benchmark done", 30.0)
    comm_c.Free()
    comm_py.Free()

    # 4. predictions at scale, by the model fitted here and by the one "auto" routes with
    per_node = 8
    models = {"fitted here": model, "routing": CostModel.from_env()}
    say(f"\n## PREDICTION (alpha-beta models, not measured): all_gather, {per_node} ranks per "
        "node; flat ring vs PCCL (rd inter-node over the nodes, then ring intra-node)")
    for label, m in models.items():
        say(f"# {label}: alpha {m.alpha * 1e6:.2f} us, beta_ring {m.beta_ring * 1e9:.3f} ns/B, "
            f"beta_rd {m.beta_rd * 1e9:.3f} ns/B"
            + ("  (the model 'auto' uses: defaults or MCRDL_PCCL_MODEL)" if m is not model
               else ""))
    say(f"# {'ranks':>6} {'bytes/rank':>10}" + "".join(
        f" {'ring/pccl(ms) ' + label:>32} {'speedup':>8}" for label in models))
    for b in (16 << 10, 1 << 20):
        for ranks in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            nodes = ranks // per_node
            row = f"  {ranks:>6} {format_size(b):>10}"
            for m in models.values():
                ring = m.ring(ranks, b)
                hier = m.rd(nodes, b) + m.ring(per_node, b * nodes)
                row += f" {f'{ring * 1e3:.2f}/{hier * 1e3:.2f}':>32} {ring / hier:>7.2f}x"
            say(row)
    say("# the model has no network contention or per-NIC limits: it predicts latency "
        "scaling (log p vs p), not absolute times on a real interconnect; the fitted one "
        "carries this machine's costs (shared memory, oversubscribed cores)")
    mcrdl.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
