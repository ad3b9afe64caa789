"""GFLOP/s of each matmul operand layout (NN, NT, TN) on a 4D grid's local blocks.

    python benchmarks/matmul_modes.py [--model small] [--batch 16] [--grid 2,2,2,1 ...]
        [--dtype float32] [--threads N] [--repeats 7] [--plot fig.png]

Each Linear layer of the GPT runs three matmuls per rank (training.parallel4d.tuning):
the forward I W^T, the input gradient dO W and the weight gradient dO^T I, on the local
blocks the grid gives it (``training.parallel4d.perf_model.linear_layers``: t = m / G_z tokens,
in-features over Y and out-features over X, swapped for a T-layer). For every distinct
(phase, t, n, k) of each grid this script times the three operand layouts the tuner
chooses from (``--tune-matmul``), copies of re-laid-out operands included, exactly as
the tuner's ``matmul`` runs them: one warm-up, then the fastest of ``--repeats`` runs
(as the tuner's own timer: on a shared machine preemption only ever adds time).
Columns: GFLOP/s per mode (2 t n k flops), the layout torch uses untuned (natural), the
fastest, and fastest / natural. Every mode's result is compared with the natural one
(the largest relative difference is printed; the tuner relies on them agreeing).

One process: the kernels are what is measured; a rank of a real run sees the same
shapes. Run it on the machine (and thread count) the training will use.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from training.models.gpt import CONFIGS  # noqa: E402
from training.parallel4d.perf_model import Grid4D, TrainingStep, check_grid, linear_layers  # noqa: E402
from training.parallel4d.tuning import MODES, NATURAL, PHASES, matmul  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def parse_grid(text: str) -> Grid4D:
    try:
        degrees = [int(v) for v in text.split(",")]
    except ValueError:
        degrees = []
    if len(degrees) != 4:
        raise argparse.ArgumentTypeError(
            f"--grid {text!r}: expected four comma-separated degrees G_x,G_y,G_z,G_data "
            "(e.g. 2,2,2,1)")
    return Grid4D(*degrees)


def operands(phase: str, t: int, k: int, n: int, dtype, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) of `phase` in the layouts the engine hands the tuner (training.parallel4d
    .tuning.MatmulTuner): forward (I, W^T view), input gradient (dO, W), weight gradient
    (dO^T view, I)."""
    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)
    if phase == "forward":
        return rand(t, k), rand(n, k).t()
    if phase == "input_grad":
        return rand(t, n), rand(n, k)
    return rand(t, n).t(), rand(t, k)


def time_mode(a: torch.Tensor, b: torch.Tensor, mode: str, repeats: int) -> float:
    """Seconds of the fastest of `repeats` runs of the tuner's matmul in `mode` (after a
    warm-up)."""
    matmul(a, b, mode)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a, b, mode)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(step: TrainingStep, grid: Grid4D, dtype, repeats: int, seed: int = 0) -> list[dict]:
    """One row per distinct (phase, t, n, k) of the grid's Linear layers."""
    tokens = step.tokens_per_replica(grid)
    gen = torch.Generator().manual_seed(seed)
    rows, seen = [], {}
    for layer in linear_layers(step.model):
        t, k, n = layer.local(grid, tokens)
        for phase in PHASES:
            a, b = operands(phase, t, k, n, dtype, gen)
            shape = (phase, a.shape[0], b.shape[1], a.shape[1])  # the tuner's key (m, n, k)
            if shape in seen:
                seen[shape]["layers"].append(layer.name)
                continue
            natural = matmul(a, b, NATURAL[phase]).double()
            scale = natural.abs().max().item() or 1.0
            flops = 2 * shape[1] * shape[2] * shape[3]
            secs = {m: time_mode(a, b, m, repeats) for m in MODES}
            diff = max((matmul(a, b, m).double() - natural).abs().max().item() / scale
                       for m in MODES)
            row = {"phase": phase, "shape": shape[1:], "layers": [layer.name],
                   "gflops": {m: flops / s / 1e9 for m, s in secs.items()},
                   "natural": NATURAL[phase], "best": min(MODES, key=lambda m: secs[m]),
                   "max_rel_diff": diff}
            seen[shape] = row
            rows.append(row)
    return rows


def print_rows(grid: Grid4D, rows: list[dict]) -> None:
    print(f"\n# grid (G_x,G_y,G_z,G_data) = {grid}")
    head = (f"{'layers':<28} {'phase':<11} {'m x n x k':>18} "
            + " ".join(f"{m + ' GF/s':>9}" for m in MODES)
            + f" {'natural':>7} {'best':>5} {'best/nat':>8} {'max rel diff':>12}")
    print(head)
    for r in rows:
        g = r["gflops"]
        print(f"{','.join(r['layers']):<28} {r['phase']:<11} "
              f"{'x'.join(map(str, r['shape'])):>18} "
              + " ".join(f"{g[m]:>9.2f}" for m in MODES)
              + f" {r['natural']:>7} {r['best']:>5} {g[r['best']] / g[r['natural']]:>8.2f}"
              f" {r['max_rel_diff']:>12.1e}")


def plot(results: list[tuple[Grid4D, list[dict]]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.2 * len(results)), squeeze=False)
    for ax, (grid, rows) in zip(axes[:, 0], results, strict=True):
        width = 0.8 / len(MODES)
        for i, mode in enumerate(MODES):
            ax.bar([j + i * width for j in range(len(rows))],
                   [r["gflops"][mode] for r in rows], width, label=mode)
        ax.set_xticks([j + width for j in range(len(rows))])
        ax.set_xticklabels([f"{r['layers'][0]}\n{r['phase']}" for r in rows], fontsize=6)
        ax.set_ylabel("GFLOP/s")
        ax.set_title(f"grid {grid}: local matmuls per operand layout")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"# plot: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=sorted(CONFIGS),
                    help="GPT size (training.models.gpt.CONFIGS)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per optimizer step")
    ap.add_argument("--grid", type=parse_grid, action="append",
                    help="G_x,G_y,G_z,G_data (repeatable; default 1,1,1,1 and 2,2,2,1)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=7,
                    help="timed runs per mode (the fastest counts)")
    ap.add_argument("--plot", default=None, help="write a bar chart of GFLOP/s here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: expected at least 1")
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads {args.threads}: expected at least 1")
        torch.set_num_threads(args.threads)
    step = TrainingStep(CONFIGS[args.model], batch=args.batch)
    grids = args.grid or [Grid4D(1, 1, 1, 1), Grid4D(2, 2, 2, 1)]
    for grid in grids:
        check_grid(step, grid)
    print(f"# matmul_modes: model {args.model} batch {args.batch} {args.dtype}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or '?'}"
          f", {os.cpu_count()} cpus; fastest of {args.repeats} runs after a warm-up")
    results = []
    for grid in grids:
        rows = measure(step, grid, DTYPES[args.dtype], args.repeats)
        print_rows(grid, rows)
        results.append((grid, rows))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
