"""mcrdl's training engines against what a user would pick instead, side by side.

Usage::

    python benchmarks/engines.py --ranks 2                      # 3 rounds, table + PNG
    python benchmarks/engines.py --ranks 2 --steps 2 --warmup 0 --rounds 1 --parity-steps 2

Each row (``ROWS``) is one mcrdl engine and its peers on the same model (training's
``--model``, default ``mini``), data, seed, optimizer (AdamW, the engine's
hyper-parameters, learning-rate schedule and global-norm clipping) and global batch.
Every contender runs as its own ``mpiexec -n R`` job of this script (``--worker NAME``),
with ``OMP_NUM_THREADS=1``, so no contender inherits another's process state.

1. Parity: every contender trains ``--parity-steps`` steps from the same initial weights
   (one serial GPT, saved once and loaded by each) on the same batches; the losses of
   each peer must equal the engine's within ``PARITY_RTOL`` (relative). Step 0's losses
   are computed from identical weights and data in the same order, so they agree to the
   last bit or nearly; later steps differ only by the gradient's summation order (the
   engine all-reduces one flat buffer and sums the norm in float64, DDP all-reduces
   buckets and clip_grad_norm_ sums in float32): a few fp32 ulps (~1e-7 relative) per
   step, which Adam's normalized update carries into the weights at about lr x that; a
   few steps stay far below 1e-4. A larger gap means the two do not compute the same
   step, and the row is reported as not comparable (no ratio).
2. Timing: ``--rounds`` rounds, each launching every contender once (the order reverses
   every round, as this machine's speed drifts); each job trains ``--warmup`` + ``--steps``
   steps, and its figure is the median over the timed steps of the slowest rank's step.
   Reported per contender: median tokens/s over rounds, spread (min-max), ratio to the
   best peer, peak RSS per rank (ru_maxrss); a PNG bar chart; one final line per engine
   ``engines: <engine> <ratio>x best peer (<peer>)``.

Rows to add (issue: engines vs peers): 4D against FSDP2 / DTensor TP, TED MoE against
DeepSpeed MoE, SAMO against dense AdamW: a row is an engine worker and peer workers
registered in ``WORKERS`` with the same (cfg, rank, world) -> Contender interface.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARITY_RTOL = 1e-4  # see the module doc, step 1


# --- workers (inside an mpiexec job) ---------------------------------------------------
@dataclass
class Contender:
    """One launched contender on this rank: `step(i)` trains step i and returns the
    global batch's mean loss; `barrier()` aligns the ranks (untimed); `max_over_ranks`
    reduces a list of floats elementwise by MAX over the world; `gather` collects one
    float per rank on every rank."""
    step: Callable[[int], float]
    barrier: Callable[[], None]
    max_over_ranks: Callable[[list[float]], list[float]]
    gather: Callable[[float], list[float]]


def _train_argv(args) -> list[str]:
    return ["--model", args.model, "--global-batch-size", str(args.global_batch),
            "--micro-batch-size", str(args.micro_batch), "--seed", str(args.seed),
            "--steps", str(args.parity_steps + args.warmup + args.steps)]


def engine_pipeline_data(args, rank: int, world: int) -> Contender:
    """training.train_gpt's pipeline x data engine at pure data parallelism."""
    import torch

    import mcrdl
    from training.pipeline.trainer import Trainer
    from training.train_gpt import parse_args

    cfg = parse_args(_train_argv(args) + ["--G-inter", "1", "--G-data", str(world)],
                     world_size=world)
    trainer = Trainer(cfg)
    trainer.model_stage.load_state_dict(torch.load(args.init, weights_only=True))

    def reduce(values, op):
        t = torch.tensor(values, dtype=torch.float64)
        mcrdl.all_reduce("auto", t, op=op)
        return t

    return Contender(step=lambda i: trainer.train_step()[0],
                     barrier=lambda: reduce([0.0], mcrdl.ReduceOp.SUM),
                     max_over_ranks=lambda v: reduce(v, mcrdl.ReduceOp.MAX).tolist(),
                     gather=lambda x: _gather_by_sum(x, rank, world,
                                                     lambda v: reduce(v, mcrdl.ReduceOp.SUM)))


def _gather_by_sum(x: float, rank: int, world: int, sum_fn) -> list[float]:
    v = [0.0] * world
    v[rank] = x
    return list(map(float, sum_fn(v)))


def _ddp(backend: str) -> Callable:
    def make(args, rank: int, world: int) -> Contender:
        """torch.nn.parallel.DistributedDataParallel over torch.distributed `backend`,
        the unmodified training step (no_sync on all but the last microbatch)."""
        import contextlib

        import torch
        import torch.distributed as dist

        import mcrdl  # noqa: F401  (registers the "mcrdl" torch backend, the store)
        from training.core.data import Batches, load_dataset
        from training.core.optim import param_groups
        from training.models.gpt import GPT, lm_loss
        from training.train_gpt import parse_args

        cfg = parse_args(_train_argv(args) + ["--G-data", str(world)], world_size=world)
        dist.init_process_group(backend)
        torch.manual_seed(cfg.seed)
        dataset = load_dataset(cfg.data, cfg.vocab_size)
        mcfg = _model_config(cfg, dataset)
        model = GPT(mcfg, seed=cfg.seed)
        model.load_state_dict(torch.load(args.init, weights_only=True))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        oc = cfg.optim()
        opt = torch.optim.AdamW(param_groups(model.parameters(), oc.weight_decay), lr=oc.lr,
                                betas=(oc.beta1, oc.beta2), eps=oc.eps)
        batches = Batches(dataset, mcfg.block_size, cfg.global_batch_size,
                          cfg.micro_batch_size, rank, world, seed=cfg.seed)

        def step(i: int) -> float:
            for group in opt.param_groups:
                group["lr"] = oc.lr_at(i)
            mbs = batches.microbatches(i)
            total = torch.zeros((), dtype=torch.float64)
            for k, (x, y) in enumerate(mbs):
                sync = ddp.no_sync() if k < len(mbs) - 1 else contextlib.nullcontext()
                with sync:
                    loss = lm_loss(ddp(x), y) / len(mbs)
                    loss.backward()
                total += loss.detach().double()
            if oc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.all_reduce(total)
            return float(total) / world

        def reduce(values, op):
            t = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(t, op=op)
            return t

        return Contender(step=step, barrier=dist.barrier,
                         max_over_ranks=lambda v: reduce(v, dist.ReduceOp.MAX).tolist(),
                         gather=lambda x: _gather_by_sum(
                             x, rank, world, lambda v: reduce(v, dist.ReduceOp.SUM)))
    return make


WORKERS: dict[str, Callable] = {
    "pipeline-data": engine_pipeline_data,
    "ddp-gloo": _ddp("gloo"),
    "ddp-mcrdl": _ddp("mcrdl"),
}


@dataclass(frozen=True)
class Row:
    """One mcrdl engine (a worker name) against its peers (worker names)."""
    engine: str
    peers: tuple[str, ...]


ROWS = [Row("pipeline-data", ("ddp-gloo", "ddp-mcrdl"))]


def worker(args) -> int:
    from mcrdl.launch import detect

    info = detect()
    rank, world = info.rank, info.size
    c = WORKERS[args.worker](args, rank, world)
    losses, times = [], []
    for i in range(args.parity_steps + args.warmup + args.steps):
        c.barrier()
        t0 = time.perf_counter()
        loss = c.step(i)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    slowest = c.max_over_ranks(times)
    rss = c.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # MiB
    if rank == 0:
        Path(args.out).write_text(json.dumps(
            {"losses": losses, "step_s": slowest, "rss_mib": rss}))
    return 0


# --- launcher ----------------------------------------------------------------------------
def launch(args, name: str, out: Path, *, parity: bool) -> dict:
    """Run contender `name` as its own mpiexec job; its rank 0's record."""
    cmd = ["mpiexec", "-n", str(args.ranks), sys.executable, str(Path(__file__).resolve()),
           "--worker", name, "--out", str(out), "--init", str(args.init),
           "--model", args.model, "--global-batch", str(args.global_batch),
           "--micro-batch", str(args.micro_batch), "--seed", str(args.seed)]
    cmd += (["--parity-steps", str(args.parity_steps), "--warmup", "0", "--steps", "0"]
            if parity else
            ["--parity-steps", "0", "--warmup", str(args.warmup), "--steps", str(args.steps)])
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                        os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: `{' '.join(cmd)}` exited {proc.returncode}:\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def parity(args, row: Row, tmp: Path) -> dict[str, str | None]:
    """Per peer: None when its first losses match the engine's, else the reason."""
    ref = launch(args, row.engine, tmp / f"parity-{row.engine}.json", parity=True)["losses"]
    print(f"parity {row.engine}: losses {', '.join(f'{x:.6f}' for x in ref)}")
    verdict = {}
    for peer in row.peers:
        got = launch(args, peer, tmp / f"parity-{peer}.json", parity=True)["losses"]
        worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got, strict=True))
        ok = worst <= PARITY_RTOL
        verdict[peer] = None if ok else (f"losses differ by {worst:.2e} relative "
                                         f"(> {PARITY_RTOL:g})")
        print(f"parity {peer}: max relative loss difference {worst:.2e} over "
              f"{len(ref)} steps (tolerance {PARITY_RTOL:g}): "
              f"{'ok' if ok else 'NOT COMPARABLE'}")
    return verdict


def save_initial_weights(args, path: Path) -> None:
    import torch

    from training.core.data import load_dataset
    from training.models.gpt import GPT
    from training.train_gpt import parse_args
    cfg = parse_args(_train_argv(args))
    mcfg = _model_config(cfg, load_dataset(cfg.data, cfg.vocab_size))
    torch.save(GPT(mcfg, seed=args.seed).state_dict(), path)


def _model_config(cfg, dataset):
    """The GPT's shape as the engine builds it (training/pipeline/trainer.py)."""
    from training.models.gpt import get_config
    return get_config(cfg.model, vocab_size=dataset.vocab_size, n_layer=cfg.n_layer,
                      n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size)


def plot(results: dict, rows: list[Row], path: Path, ranks: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for row in rows for n in (row.engine, *row.peers)]
    med = [results[n]["median"] for n in names]
    lo = [results[n]["median"] - results[n]["min"] for n in names]
    hi = [results[n]["max"] - results[n]["median"] for n in names]
    colors = ["tab:blue" if n in {r.engine for r in rows} else "tab:gray" for n in names]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
    ax.bar(names, med, yerr=[lo, hi], color=colors, capsize=4)
    ax.set_ylabel("tokens/s (median; bars: min-max over rounds)")
    ax.set_title(f"engines vs peers, {ranks} ranks, OMP_NUM_THREADS=1")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model", default="mini")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parity-steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=10, help="timed steps per job")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--png", default="engines.png")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    rows = ROWS
    with tempfile.TemporaryDirectory(prefix="engines-") as tmpdir:
        tmp = Path(tmpdir)
        args.init = tmp / "init.pt"
        save_initial_weights(args, args.init)
        verdicts = {row.engine: parity(args, row, tmp) for row in rows}
        order = [n for row in rows for n in (row.engine, *row.peers)]
        samples: dict[str, list[float]] = {n: [] for n in order}
        rss: dict[str, list[float]] = {}
        tokens = args.global_batch * _block_size(args)
        for r in range(args.rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                rec = launch(args, name, tmp / f"{name}-{r}.json", parity=False)
                timed = rec["step_s"][args.warmup:] or rec["step_s"]
                samples[name].append(tokens / statistics.median(timed))
                rss[name] = [max(a, b) for a, b in zip(rss.get(name, rec["rss_mib"]),
                                                       rec["rss_mib"], strict=True)]
    results = {n: {"median": statistics.median(s), "min": min(s), "max": max(s),
                   "rounds": s, "peak_rss_mib": rss[n]} for n, s in samples.items()}
    print(f"\n{args.model} GPT, {args.ranks} ranks, global batch {args.global_batch} "
          f"({args.micro_batch} per microbatch), {args.steps} timed steps after "
          f"{args.warmup}, {args.rounds} alternating rounds, OMP_NUM_THREADS=1")
    print(f"{'contender':16} {'tokens/s':>9} {'min':>9} {'max':>9} {'vs best peer':>13} "
          f"{'peak RSS/rank (MiB)':>20}")
    lines = []
    for row in rows:
        ok = [p for p in row.peers if verdicts[row.engine][p] is None]
        best = max(ok, key=lambda n: results[n]["median"]) if ok else None
        for name in (row.engine, *row.peers):
            res = results[name]
            why = verdicts[row.engine].get(name)
            ratio = (f"{res['median'] / results[best]['median']:.3f}x" if best and not why
                     else "not comparable")
            res["vs_best_peer"] = ratio
            print(f"{name:16} {res['median']:9.0f} {res['min']:9.0f} {res['max']:9.0f} "
                  f"{ratio:>13} {'/'.join(f'{x:.0f}' for x in res['peak_rss_mib']):>20}")
        if best is None:
            lines.append(f"engines: {row.engine} not comparable (no peer passed parity: "
                         + "; ".join(f"{p}: {verdicts[row.engine][p]}" for p in row.peers)
                         + ")")
        else:
            ratio = results[row.engine]["median"] / results[best]["median"]
            lines.append(f"engines: {row.engine} {ratio:.2f}x best peer ({best})")
    plot(results, rows, Path(args.png), args.ranks)
    print(f"chart: {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    for line in lines:
        print(line)
    return 0


def _block_size(args) -> int:
    from training.models.gpt import get_config
    return get_config(args.model).block_size


if __name__ == "__main__":
    sys.exit(main())
