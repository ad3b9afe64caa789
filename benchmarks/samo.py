"""SAMO's memory and its pipeline consequence (dissertation ch. 4, Eq. 4.1-4.9): the same
pruned GPT at 8 ranks as (G_inter, G_data) = (4,2) dense against (2,4) and (1,8) with
SAMO, side by side in one run.

Usage::

    mpiexec -n 8 python benchmarks/samo.py                        # mini, bf16, p = 0.9
    mpiexec -n 8 python benchmarks/samo.py --model small --memory-limit 20

1. Memory (rank 0, one process): the whole model's model-state bytes for each
   --memory-sparsities p, measured by accounting SamoAdamW's state tensors, beside
   Eq. 4.2 (24 f phi + 2 phi) and the saving against Eq. 4.1 (20 phi) and against the
   repository's dense mixed-precision optimizer (OffloadedAdamW at its step: theta16,
   the autograd gradients and its flat copy, fp32 masters and moments, 18 phi).
2. Layouts: each of --layouts (G_inter x G_data : dense or samo) builds the trainer of the
   same pruned model (global magnitude pruning to --sparsity before step 0: the mask
   does not depend on the grid; dense is dense masked training) and accounts each
   rank's model-state bytes. A layout whose largest rank exceeds --memory-limit (MiB;
   default: that of the first layout, dense 4x2, the fewest stages at which the dense
   model fits) is reported as not fitting and not trained. The others train --steps
   steps (the first is warm-up): tokens/s, and the pipeline bubble per step measured
   (mean over stages of the time spent waiting for a message) beside Eq. 4.7,
   (t_f + t_b)(1 - 1/G_inter), with t_f + t_b the measured compute of one microbatch
   summed over the stages; and the point-to-point messages per rank, 4 B / (mbs G_data)
   (Eq. 4.8-4.9).

On a machine with fewer cores than ranks the ranks time-share the cores: absolute times
and the bubble are then indicative only; the ratios between layouts in one run are the
figure.
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
from training.core.optim import OffloadedAdamW, OptimConfig  # noqa: E402
from training.models.gpt import GPT, get_config  # noqa: E402
from training.pipeline.trainer import Trainer  # noqa: E402
from training.samo.optimizer import (  # noqa: E402
    SamoAdamW,
    bubble_seconds,
    default_bytes,
    dense_state_bytes,
    p2p_messages,
    samo_bytes,
    saving,
)
from training.samo.pruning import full_index, select  # noqa: E402
from training.train_gpt import (
    TrainConfig,  # noqa: E402
    run,  # noqa: E402
)

MiB = 2**20


def memory_table(model: str, sparsities: list[float]) -> None:
    """Part 1 (module doc), printed."""
    mcfg = get_config(model)
    dense_model = GPT(mcfg, seed=1).to(torch.bfloat16)
    dense = sum(dense_state_bytes(OffloadedAdamW(dense_model.parameters(),
                                                 OptimConfig())).values())
    phi = mcfg.n_params()
    print(f"\n## Model-state memory, {model} ({phi:,} parameters), bf16 with fp32 masters\n")
    print(f"Eq. 4.1 M_default = 20 phi = {default_bytes(phi):,} B; the repository's dense "
          f"optimizer (OffloadedAdamW at its step, accounted) = {dense:,} B "
          f"({dense / phi:g} phi)\n")
    print("| p | kept f phi | Eq. 4.2 (B) | measured (B) | equal | saved vs Eq. 4.1 "
          "(model) | saved vs OffloadedAdamW |")
    print("|---|---|---|---|---|---|---|")
    for p in sparsities:
        m = GPT(mcfg, seed=1).to(torch.bfloat16)
        named = list(m.named_parameters())
        params = [t for _, t in named]
        index = select([t.detach().view(-1) for t in params], full_index(params),
                       [t.numel() for t in params], p, "global")
        opt = SamoAdamW(named, OptimConfig(), index=index)
        measured = sum(opt.state_bytes().values())
        model_bytes = samo_bytes(phi, opt.kept())
        print(f"| {p} | {opt.kept():,} | {model_bytes:,} | {measured:,} | "
              f"{'yes' if measured == model_bytes else 'NO'} | "
              f"{1 - measured / default_bytes(phi):.1%} ({saving(p):.1%}) | "
              f"{1 - measured / dense:.1%} |")


def account(cfg: TrainConfig) -> list[int]:
    """Every rank's model-state bytes in the layout of `cfg` (collective)."""
    trainer = Trainer(cfg)
    opt = trainer.optimizer
    mine = sum((opt.state_bytes() if isinstance(opt, SamoAdamW)
                else dense_state_bytes(opt)).values())
    return mcrdl.all_gather_object(mine)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mini")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--dtype", type=dtype, default="bf16",
                    help="fp32, bf16, fp16 (or float32, bfloat16, float16)")
    ap.add_argument("--layouts", default="4x2:dense,2x4:dense,1x8:dense,2x4:samo,1x8:samo",
                    help="G_interxG_data:dense|samo, comma-separated")
    ap.add_argument("--memory-limit", type=float,
                    help="MiB of model states per rank (default: the first layout's)")
    ap.add_argument("--memory-sparsities", default="0.5,0.8,0.9,0.95")
    args = ap.parse_args(argv)
    mcrdl.init(["mpi"] if "mpi" in mcrdl.available_backends() else ["gloo"])
    n, rank = mcrdl.get_size(), mcrdl.get_rank()
    layouts = []
    for item in args.layouts.split(","):
        grid, _, kind = item.partition(":")
        gi, gd = (int(v) for v in grid.split("x"))
        if kind not in ("dense", "samo") or gi * gd != n:
            raise SystemExit(f"--layouts {item!r}: expected GxD:dense or GxD:samo with G x D "
                             f"= {n} ranks")
        layouts.append((gi, gd, kind))
    if rank == 0:
        print(f"# SAMO benchmark: {n} ranks, model {args.model}, {args.dtype} on cpu, sparsity "
              f"{args.sparsity}, global batch {args.global_batch_size}, micro-batch "
              f"{args.micro_batch_size}, {args.steps} steps (1 warm-up); torch "
              f"{torch.__version__}, {os.cpu_count()} cores, {platform.node()}", flush=True)
        memory_table(args.model, [float(p) for p in args.memory_sparsities.split(",")])
    limit = args.memory_limit * MiB if args.memory_limit else None
    # each process's run outputs (metrics), removed after the runs
    scratch = tempfile.TemporaryDirectory(prefix="mcrdl-samobench-")
    rows = []
    for gi, gd, kind in layouts:
        cfg = TrainConfig(model=args.model, steps=args.steps, G_inter=gi, G_data=gd,
                          micro_batch_size=args.micro_batch_size,
                          global_batch_size=args.global_batch_size, dtype=args.dtype,
                          prune_sparsity=args.sparsity, samo=kind == "samo", plot=False,
                          progress=False, quiet=True, log_interval=10**6,
                          out_dir=scratch.name)
        per_rank = account(cfg)
        peak = max(per_rank)
        if limit is None:
            limit = peak
        if peak > limit:
            rows.append((gi, gd, kind, peak, None))
            continue
        rows.append((gi, gd, kind, peak, run(cfg)))
    scratch.cleanup()
    if rank == 0:
        print(f"\n## Layouts under a memory limit of {limit / MiB:.2f} MiB of model states "
              "per rank\n")
        print("| G_inter x G_data | states | max rank MiB | tokens/s | bubble ms/step measured "
              "| Eq. 4.7 ms/step | bubble fraction measured / model | p2p msgs per rank "
              "(Eq. 4.8-4.9) |")
        print("|---|---|---|---|---|---|---|---|")
        m = args.global_batch_size // args.micro_batch_size
        for gi, gd, kind, peak, res in rows:
            head = f"| {gi}x{gd} | {kind} | {peak / MiB:.2f} |"
            if res is None:
                print(f"{head} does not fit: {peak / MiB:.2f} > {limit / MiB:.2f} MiB | - | "
                      "- | - | - |")
                continue
            stages = res.phases.values()
            bubble = sum(s["bubble"] for s in stages) / len(stages)
            micro = m // gd
            fwd_bwd = sum(s["compute"] for s in stages) / micro
            # Eq. 4.8-4.9 counts the sends and receives of an inner stage; one stage has none
            msgs = p2p_messages(args.global_batch_size, args.micro_batch_size, gd) \
                if gi > 1 else 0
            print(f"{head} {res.tokens_per_s:,.0f} | {bubble * 1e3:.1f} | "
                  f"{bubble_seconds(fwd_bwd, gi) * 1e3:.1f} | {res.bubble_measured:.3f} / "
                  f"{res.bubble_model:.3f} | {msgs:g} |")
        ran = [r for r in rows if r[4] is not None]
        dense = [r for r in ran if r[2] == "dense"]
        if dense:
            base = dense[0]
            for gi, gd, kind, _, res in ran:
                print(f"{gi}x{gd} {kind}: {res.tokens_per_s / base[4].tokens_per_s:.2f} x the "
                      f"tokens/s of {base[0]}x{base[1]} {base[2]}")
    mcrdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
