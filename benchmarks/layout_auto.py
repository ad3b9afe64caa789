"""--layout auto against every layout measured one after another, in one run.

Usage::

    python benchmarks/layout_auto.py --ranks 4 --runs 3          # table per run + summary
    python benchmarks/layout_auto.py --ranks 4 --runs 1 --steps 4 --model tiny

Each run trains every layout train_gpt can run at ``--ranks`` R for the model (the
planner's runnable candidates, ``training/plan/auto.py``: pipeline G_inter x G_data and
the 4D grids) as its own ``mpiexec -n R`` job, ``--steps`` steps each, in an order
rotated from run to run (this machine's speed drifts), and takes each layout's median
step time after the first step. Then, in the same run, ``--layout auto
--layout-trials 3`` and plain ``--layout auto`` jobs say which layout they choose. It
reports, per run, the chosen layout's measured time over the best layout's (goal:
within 10%) and the rank of the model's first choice among the measured layouts (goal:
top 3), and saves a PNG of the measured times with the choices marked (``--plot``).
Every job has ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _flags(degrees: dict[str, int]) -> list[str]:
    return [x for name, v in degrees.items() for x in (f"--{name.replace('_', '-')}", str(v))]


def _grid(degrees: dict[str, int]) -> str:
    shown = {k: v for k, v in degrees.items() if v != 1} or {"G_data": 1}
    return " ".join(f"{k}={v}" for k, v in shown.items())


def layouts(args) -> list[dict[str, int]]:
    """The degree options of every runnable layout, in the planner's order."""
    import torch

    from training import train_gpt
    from training.plan import auto

    cfg = train_gpt.parse_args([*_common(args), "--layout", "auto"], world_size=args.ranks)
    problem = auto._problem(cfg, args.ranks, torch.device("cpu"), float(1 << 40))
    return [auto.degree_options_of(c) for c, _ in
            auto._runnable(cfg, auto.plan(problem), args.ranks, ("pipeline", "4d"))]


def _common(args) -> list[str]:
    return ["--model", args.model, "--global-batch-size", str(args.global_batch_size),
            "--micro-batch-size", "1", "--quiet", "--no-plot", "--no-progress"]


def _job(args, extra: list[str], metrics: Path, steps: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = ["mpiexec", "-n", str(args.ranks), sys.executable, "-m", "training.train_gpt",
           *_common(args), "--steps", str(steps), "--metrics", str(metrics), *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n"
                           f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def measure(args, degrees: dict[str, int], tmp: Path) -> float:
    records = _job(args, _flags(degrees), tmp / "m.jsonl", args.steps)
    return statistics.median(r["time_s"] for r in records if r.get("step", 0) >= 2)


def chosen(args, extra: list[str], tmp: Path) -> dict:
    """The layout_choice record of a --layout auto job (degrees, and with trials the
    trials' own measured step times)."""
    return _job(args, ["--layout", "auto", *extra], tmp / "auto.jsonl", 1)[0]["layout_choice"]


def one_run(args, index: int, candidates: list[dict[str, int]], tmp: Path) -> dict:
    order = candidates[index % len(candidates):] + candidates[:index % len(candidates)]
    times = {}
    for degrees in order:
        times[_grid(degrees)] = measure(args, degrees, tmp)
        print(f"  {_grid(degrees):<28} {times[_grid(degrees)] * 1e3:8.2f} ms", flush=True)
    trial_record = chosen(args, ["--layout-trials", "3"], tmp)
    trials = _grid(trial_record["degrees"])
    for t in trial_record.get("trials", []):  # the trials' times, measured inside the job
        print(f"    trial {t['grid']:<26} {t['measured_step_s'] * 1e3:8.2f} ms", flush=True)
    model = _grid(chosen(args, [], tmp)["degrees"])
    best = min(times.values())
    ranked = sorted(times, key=times.get)
    result = {"times_s": times, "trials_choice": trials, "model_choice": model,
              "trials_ratio": times[trials] / best,
              "model_rank": ranked.index(model) + 1, "best": ranked[0]}
    print(f"  --layout-trials 3 chose {trials}: {result['trials_ratio']:.3f}x the best "
          f"({ranked[0]}); the model's first choice {model} is #{result['model_rank']} "
          f"of {len(ranked)} measured", flush=True)
    return result


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grids = list(results[0]["times_s"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        xs = [g + i * width for g in range(len(grids))]
        ax.bar(xs, [r["times_s"][g] * 1e3 for g in grids], width, label=f"run {i + 1}")
        for mark, name in (("*", "trials_choice"), ("o", "model_choice")):
            g = grids.index(r[name])
            ax.plot(g + i * width, r["times_s"][r[name]] * 1e3 * 1.05, mark, color="k")
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(grids))], grids, rotation=30,
                  ha="right", fontsize=8)
    ax.set_ylabel("median step (ms)")
    ax.set_title("every layout measured; * --layout-trials 3's choice, o the model's")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="steps per layout (first untimed)")
    p.add_argument("--model", default="mini")
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300, help="seconds per job")
    p.add_argument("--plot", default="layout_auto.png", help="PNG path ('' for none)")
    args = p.parse_args(argv)
    candidates = layouts(args)
    print(f"{len(candidates)} layouts of {args.model} at {args.ranks} ranks, {args.steps} "
          f"steps each, {args.runs} runs", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            print(f"run {i + 1}:", flush=True)
            results.append(one_run(args, i, candidates, Path(tmp)))
    ratios = [r["trials_ratio"] for r in results]
    ranks = [r["model_rank"] for r in results]
    print(f"summary: trials' choice / best {', '.join(f'{x:.3f}' for x in ratios)} "
          f"(goal <= 1.10); model's first choice ranked {ranks} (goal <= 3)")
    print(json.dumps({"trials_ratio": ratios, "model_rank": ranks}))
    if args.plot:
        plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
