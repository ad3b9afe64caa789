"""Pipeline x data parallel GPT training: tokens/s and the per-phase breakdown for every
(G_inter, G_data) grid of the world, side by side in one run.

Usage::

    mpiexec -n 4 python benchmarks/pipeline.py                      # 4x1, 2x2, 1x4
    mpiexec -n 4 python benchmarks/pipeline.py --model small --steps 8 --plot pipe.png

Each grid trains the same model on the same data (``training.train_gpt.run``) for
``--steps`` steps; the first step is warm-up and the rest are timed. Per grid the
table gives tokens/s (global batch x block size x steps / wall time), the time per
step in each phase (ms, mean over ranks), and the pipeline bubble fraction measured
(time waiting for a message / time in the pipeline, mean over stages) beside the
model's (G_inter - 1) / (m + G_inter - 1), m = microbatches per step. On a machine
with fewer cores than ranks the ranks time-share the cores: absolute times and the
bubble are then indicative only; the ratios between grids in one run are the figure.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import mcrdl  # noqa: E402
from training.core.arguments import dtype  # noqa: E402
from training.core.timers import PHASES  # noqa: E402
from training.train_gpt import (
    TrainConfig,  # noqa: E402
    run,  # noqa: E402
)


def grids(n: int) -> list[tuple[int, int]]:
    out = []
    g = n
    while g >= 1:
        if n % g == 0:
            out.append((g, n // g))
        g -= 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mini")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--dtype", type=dtype, default="fp32",
                    help="fp32, bf16, fp16 (or float32, bfloat16, float16)")
    ap.add_argument("--offload-optimizer", action="store_true")
    ap.add_argument("--grids", help="e.g. 4x1,2x2,1x4 (default: every factorization)")
    ap.add_argument("--plot", help="PNG of the per-phase breakdown per grid")
    args = ap.parse_args(argv)
    mcrdl.init(["mpi"] if "mpi" in mcrdl.available_backends() else ["gloo"])
    n, rank = mcrdl.get_size(), mcrdl.get_rank()
    todo = ([tuple(int(v) for v in g.split("x")) for g in args.grids.split(",")]
            if args.grids else grids(n))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if rank == 0:
        print(f"# pipeline benchmark: {n} ranks, model {args.model}, {args.dtype} on {device}, "
              f"global batch {args.global_batch_size}, micro-batch {args.micro_batch_size}, "
              f"{args.steps} steps (1 warm-up); torch {torch.__version__}, "
              f"{os.cpu_count()} cores, {platform.node()}", flush=True)
    # each process's run outputs (metrics), removed after the runs
    scratch = tempfile.TemporaryDirectory(prefix="mcrdl-pipebench-")
    rows = []
    for gi, gd in todo:
        cfg = TrainConfig(model=args.model, steps=args.steps, G_inter=gi, G_data=gd,
                          micro_batch_size=args.micro_batch_size,
                          global_batch_size=args.global_batch_size, dtype=args.dtype,
                          offload_optimizer=args.offload_optimizer, plot=False, progress=False,
                          quiet=True,
                          log_interval=10**6, out_dir=scratch.name)
        res = run(cfg)
        if rank == 0:
            mean = {p: sum(s[p] for s in res.phases.values()) / len(res.phases)
                    for p in PHASES + ("wall",)}
            rows.append((f"{gi}x{gd}", res, mean))
    scratch.cleanup()
    if rank == 0:
        print("\n| G_inter x G_data | tokens/s | " + " | ".join(f"{p} ms" for p in PHASES)
              + " | step ms | bubble measured | bubble model |")
        print("|---" * (len(PHASES) + 5) + "|")
        for name, res, mean in rows:
            print(f"| {name} | {res.tokens_per_s:,.0f} | "
                  + " | ".join(f"{mean[p] * 1e3:.1f}" for p in PHASES)
                  + f" | {mean['wall'] * 1e3:.1f} | {res.bubble_measured:.3f} | "
                  f"{res.bubble_model:.3f} |")
        best = max(rows, key=lambda r: r[1].tokens_per_s)
        for name, res, _ in rows:
            print(f"{name}: {res.tokens_per_s / best[1].tokens_per_s:.2f} x the fastest grid "
                  f"({best[0]})")
        if args.plot:
            _plot(rows, args.plot)
    mcrdl.finalize()
    return 0


def _plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    bottom = [0.0] * len(rows)
    for p in PHASES:
        vals = [mean[p] * 1e3 for _, _, mean in rows]
        ax.bar([r[0] for r in rows], vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, (_, res, _) in enumerate(rows):
        ax.text(i, bottom[i], f"{res.tokens_per_s:,.0f} tok/s", ha="center", va="bottom",
                fontsize=8)
    ax.set_ylabel("ms per step (mean over ranks)")
    ax.set_xlabel("G_inter x G_data")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
