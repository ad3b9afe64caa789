"""One TED MoE training step with each fixed backend, with per-kind pinning, and with
"auto" (the MCR-DL experiment: mixing backends inside one step).

    mpiexec -n 4 python benchmarks/moe_step.py [--layout 2,2,2] [--steps 6] [--rounds 3]
    mpiexec -n 4 mcrdl-tune run --op all_reduce all_gather all_to_all_single \
        --max-bytes 1M --factor 4 --output t.json && \
        mpiexec -n 4 python benchmarks/moe_step.py --table t.json   # auto, freshly tuned

Each variant is a ``--backends`` setting of training/train_moe.py (every collective
kind on one backend, one kind on another, or "auto" for all); all run the same step
(moe-tiny by default, the layout's all_to_alls, Megatron all_reduces, DTD all_gathers
and ZeRO-1's gradient all_reduce and parameter all_gather) from the same weights.
Step time = max over ranks of one ``train_step``; each variant runs in blocks of
``--steps`` steps after a warm-up step, in ``--rounds`` rounds in a random order (the
same on every rank), and the median is printed with the ratio to the best fixed
backend (target for "auto": <= 1.02). Figures of the 2-core machine: README.md, MoE.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mcrdl  # noqa: E402


def variants(backends: list[str]) -> dict[str, str]:
    """Variant name -> --backends value: each backend alone, each kind moved to each
    other backend, and auto."""
    kinds = ("a2a", "allreduce", "allgather")
    out = {f"all {b}": ",".join(f"{k}={b}" for k in kinds) for b in backends}
    for b in backends:
        for other in backends:
            if other == b:
                continue
            for k in kinds:
                out[f"{b}, {k}={other}"] = ",".join(
                    f"{kk}={other if kk == k else b}" for kk in kinds)
    out["auto"] = ",".join(f"{k}=auto" for k in kinds)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="2,2,2", help="G_tensor,G_expert,G_data_nonexp")
    p.add_argument("--backends", default="mpi,gloo", help="fixed backends to compare")
    p.add_argument("--model", default="moe-tiny")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=None, help="width (overrides --model)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="timed steps per block")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-dtd", action="store_true")
    p.add_argument("--only", default=None, metavar="A;B",
                   help="time only these variants (';'-separated names as printed); the "
                   "fixed backends and auto are always timed")
    p.add_argument("--table", default=None, help="tuning table for \"auto\" (default: "
                   "$MCRDL_TUNING_TABLE or the one shipped for this system)")
    a = p.parse_args()

    from training.core.data import ByteCorpus
    from training.ted.trainer import MoETrainer
    from training.train_moe import MoETrainConfig

    fixed = a.backends.split(",")
    mcrdl.init(fixed, tuning_table=a.table)
    rank = mcrdl.get_rank()
    g_t, g_e, g_d = (int(x) for x in a.layout.split(","))
    data = ByteCorpus(max_bytes=1 << 20)
    trainers = {}
    chosen = variants(fixed)
    if a.only:
        keep = {n.strip() for n in a.only.split(";")}
        unknown = keep - set(chosen)
        if unknown:
            p.error(f"--only: unknown variants {sorted(unknown)}; known: {list(chosen)}")
        chosen = {n: s for n, s in chosen.items()
                  if n in keep or n == "auto" or n.startswith("all ")}
    for name, spec in chosen.items():
        cfg = MoETrainConfig(model=a.model, n_embd=a.n_embd, experts=a.experts, top_k=a.top_k,
                             G_tensor=g_t, G_expert=g_e, G_data=g_d, dtd=not a.no_dtd,
                             micro_batch_size=a.micro_batch_size,
                             global_batch_size=a.global_batch_size, backends=spec,
                             steps=10_000, quiet=True, plot=False, progress=False)
        trainers[name] = MoETrainer(cfg, dataset=data)
    names = list(trainers)
    times: dict[str, list[float]] = {n: [] for n in names}
    rng = random.Random(0)
    for _ in range(a.rounds):
        for n in rng.sample(names, len(names)):
            trainers[n].train_step()  # warm-up: the block's first step
            for _ in range(a.steps):
                mcrdl.barrier("mpi" if "mpi" in fixed else fixed[0])
                t0 = time.perf_counter()
                trainers[n].train_step()
                times[n].append(time.perf_counter() - t0)
    worst = torch.tensor([times[n] for n in names], dtype=torch.float64)
    mcrdl.all_reduce("mpi" if "mpi" in fixed else fixed[0], worst, op=mcrdl.ReduceOp.MAX)
    med = {n: statistics.median(row) for n, row in zip(names, worst.tolist(), strict=True)}
    if rank == 0:
        best_fixed = min((n for n in names if n.startswith("all ")), key=med.get)
        best = min(names, key=med.get)
        print(f"# one MoE training step, {mcrdl.get_size()} ranks, layout (G_tensor, "
              f"G_expert, G_data) = ({g_t}, {g_e}, {g_d}), DTD {'off' if a.no_dtd else 'on'}; "
              f"median of {a.rounds} x {a.steps} steps, max over ranks")
        print(f"{'variant':<28} {'ms/step':>9} {'/ best fixed':>12}")
        for n in sorted(names, key=med.get):
            print(f"{n:<28} {med[n] * 1e3:>9.2f} {med[n] / med[best_fixed]:>12.3f}")
        print(f"best fixed: {best_fixed}; fastest variant: {best}; auto / best fixed = "
              f"{med['auto'] / med[best_fixed]:.3f} (target <= 1.02)")
    mcrdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
