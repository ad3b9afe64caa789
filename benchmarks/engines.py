"""mcrdl's training engines against what a user would pick instead, side by side.

Usage::

    python benchmarks/engines.py --ranks 2                  # every row, 3 rounds, table + PNG
    python benchmarks/engines.py --ranks 4                  # the 4-rank rows, 2 rounds
    python benchmarks/engines.py --ranks 4 --rows dp,pipe,4d-xz --rounds 3
    python benchmarks/engines.py --ranks 2 --steps 2 --warmup 0 --rounds 1 --parity-steps 2

Rows (``rows_for``): one mcrdl engine, its layout at ``--ranks`` R, and its peers, each
peer once over torch.distributed's Gloo and once over mcrdl's torch backend ("mcrdl"):

==========  ==========================================  ====================================
row         mcrdl engine                                peers
==========  ==========================================  ====================================
dp          train_gpt --G-data R (pipeline x data)      DDP
pipe        train_gpt --G-inter R, 4 samples/microbatch  torch.distributed.pipelining
                                                        ScheduleGPipe, Schedule1F1B (same
                                                        stage split and microbatches)
4d-z        train_gpt --G-z R (4D, weights sharded)     FSDP2 (fully_shard per unit)
4d-x        train_gpt --G-x R (4D, tensor parallel)     DTensor TP (parallelize_module:
                                                        Colwise c_attn/c_fc, Rowwise c_proj)
4d-xz       train_gpt --G-x 2 --G-z R/2 (R >= 4)        FSDP2 + TP on a (R/2, 2) mesh
ted         train_moe --G-expert R (TED MoE, no         DeepSpeed MoE (deepspeed.moe.layer)
            clipping, capacity factor 4)
samo        train_gpt --G-data R --samo                 DDP + AdamW on the same pruned
            --prune-sparsity 0.9                        model (pruned gradients zeroed)
==========  ==========================================  ====================================

Every row trains training's ``--model`` (default ``mini``; for ``ted`` the same shape with
every second block a 4-expert top-1 MoE) on the same data, seed, optimizer (AdamW with
the engine's hyper-parameters, weight-decay groups, learning-rate schedule and global-norm
clipping) and global batch (``--global-batch``, default 8 x R samples of 64 tokens).
Every contender runs as its own ``mpiexec -n R`` job of this script (``--worker NAME``)
with ``OMP_NUM_THREADS=1``, so none inherits another's process state.

1. Parity: every contender trains ``--parity-steps`` steps from the same initial weights
   (one serial model, saved once and loaded by each) on the same batches; each peer's
   losses must equal the engine's within the row's relative tolerance (``Row.rtol``, its
   reason in ``Row.why``), else the pair is reported as not comparable (no ratio). The
   parity run also logs the collectives (mcrdl's logger): bytes per step and rank for
   the engines and the peers over "mcrdl" (Gloo's calls are not logged; they are the
   same calls as the peer's over "mcrdl").
2. Timing: ``--rounds`` rounds, each launching every contender once (the order reverses
   every round, as this machine's speed drifts); each job trains ``--warmup`` +
   ``--steps`` steps, and its figure is the median over the timed steps of the slowest
   rank's step. Reported per contender: median tokens/s over rounds, spread (min-max),
   ratio to the best peer, peak RSS per rank (ru_maxrss), bytes per step; a PNG bar
   chart; one final line per engine ``engines: <engine> <ratio>x best peer (<peer>)``
   followed by the engine's ratio to the best peer of each round and their median (the
   contenders of a round ran minutes apart: on a loaded machine the steadier figure).

At 4 ranks and more the default rows are those of ``ROWS_AT_4`` (4d-z and 4d-x run at 2
ranks; 4d-xz composes them) and the default is 2 rounds: on the 2-core machine a job
of 4 ranks takes ~10 s before its first step (4 processes sharing 2 cores import torch,
and torch's optimizer imports its compiler on first use; the stdlib corpus is read),
which bounds the command, not the steps: 3 rounds of these rows take 13 minutes.

On a GPU (``--device cuda``, R GPUs of one node, default ``--dtype bf16`` and the
``gpt2-xl`` model, 1.5 B parameters with the default byte vocabulary, 8 x 1024 tokens
per rank and step) the rows are ``dp`` against DDP and ``4d-z`` against FSDP2, the
peers over NCCL with bf16 compute and
fp32 master weights (DDP under ``torch.autocast``, FSDP2 with a ``MixedPrecisionPolicy``),
the engines with ``--dtype bf16``. Every contender's model flop/s (Narayanan et al.'s
formula, training/core/flops.py) is reported as a fraction of the device's bf16
datasheet peak (MFU; on a CPU, of the GEMM rate one rank measures). ``--device cpu
--dtype bf16`` runs the same path on a CPU (the tests do). One command for a GPU node::

    python benchmarks/engines.py --device cuda --ranks 1 --rounds 2

Peers are optional: ``pip install .[bench]`` (DeepSpeed: ``DS_BUILD_OPS=0 pip install
deepspeed``); a row whose peer is not installed says so and runs without it. DeepSpeed's
first ``init_distributed`` on a CPU compiles a shared-memory op (~70 s, once per
``TORCH_EXTENSIONS_DIR``, here ``$TMPDIR/mcrdl-engines-torch-extensions``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
# fp32 end to end: the first step's losses come from identical weights and data and agree
# to a few ulps; later steps differ by the gradient's summation order (buckets, shards,
# partial sums of a split matmul, float64 against float32 norms): ~1e-7 relative per
# gradient, carried by Adam's normalized update into the weights at about lr x that.
# Every pair stays below 1e-7 over 10 steps at 2 and 4 ranks; 1e-6 leaves a factor of 10.
# A different step shows above it within a few steps: a global norm 1% small (a sharded
# gradient counted as a copy) moved the clipped losses 1e-6 by step 3 and 3e-5 by step 5.
FP32_RTOL = 1e-6
# bf16 compute (8 significant bits, 3.9e-3 relative rounding per element): the engine
# computes with bf16 weights cast from its fp32 masters, DDP under autocast and FSDP2 with
# its mixed-precision policy, each rounding in other places: over 3 steps of the tiny GPT
# on a CPU the losses differ by 1.1e-5 (DDP) and 3.6e-5 (FSDP2) relative. 5e-3 leaves
# room for larger models; a gradient off by a factor or a skipped update shows above it,
# a norm off by 1% (which the fp32 rows catch) does not.
BF16_RTOL = 5e-3
SAMO_SPARSITY = 0.9


# --- workers (inside an mpiexec job) ---------------------------------------------------
@dataclass
class Contender:
    """One launched contender on this rank: `step(i)` trains step i and returns the
    global batch's mean loss; `barrier()` aligns the ranks (untimed); `max_over_ranks`
    reduces a list of floats elementwise by MAX over the world; `gather` collects one
    float per rank on every rank; `comm_bytes()` is this rank's logged bytes so far
    (None where nothing is logged)."""
    step: Callable[[int], float]
    barrier: Callable[[], None]
    max_over_ranks: Callable[[list[float]], list[float]]
    gather: Callable[[float], list[float]]
    comm_bytes: Callable[[], float | None] = lambda: None


@dataclass(frozen=True)
class Row:
    """One mcrdl engine (a worker name) against its peers (worker names); `argv`: the
    row's training options besides the shared ones; `rtol`/`why`: its parity tolerance
    and the reason for it; `needs`: the module each peer imports (skipped when absent)."""
    name: str
    engine: str
    peers: tuple[str, ...]
    argv: tuple[str, ...] = ()
    rtol: float = FP32_RTOL
    why: str = "fp32, gradients summed in another order"
    needs: dict[str, str] = field(default_factory=dict)
    moe: bool = False


MOE_ARGV = ("--experts", "4", "--top-k", "1", "--capacity-factor", "4.0", "--moe-every", "2")
DEEPSPEED_INSTALL = "DS_BUILD_OPS=0 pip install deepspeed (or pip install .[bench])"


def rows_for(ranks: int, micro_batch: int, block_size: int, device: str = "cpu",
             dtype: str = "fp32") -> list[Row]:
    """The rows at `ranks` ranks on `device` with `dtype` compute (module doc)."""
    rtol, why = ((BF16_RTOL, "bf16 compute, fp32 masters: the two round to bf16 in "
                  "different places") if dtype == "bf16" else (FP32_RTOL, Row.why))
    if device == "cuda":  # one node's GPUs: the dense rows, their peers over NCCL
        return [Row("dp", "dp", ("ddp-nccl",), rtol=rtol, why=why),
                Row("4d-z", "4d-z", ("fsdp2-nccl",), rtol=rtol, why=why)]
    both = ("gloo", "mcrdl")
    rows = [
        Row("dp", "dp", tuple(f"ddp-{b}" for b in both)),
        Row("pipe", "pipe", tuple(f"{s}-{b}" for s in ("gpipe", "1f1b") for b in both),
            argv=("--micro-batch-size", "4")),
        Row("4d-z", "4d-z", tuple(f"fsdp2-{b}" for b in both)),
        Row("4d-x", "4d-x", tuple(f"tp-{b}" for b in both),
            why="fp32, partial sums of the split matmuls added in another order"),
    ]
    if ranks >= 4 and ranks % 2 == 0:
        rows.append(Row("4d-xz", "4d-xz", tuple(f"2d-{b}" for b in both),
                        why="fp32, split matmuls and sharded gradients summed in another "
                            "order"))
    # one router group per microbatch (DeepSpeed routes all of a rank's microbatch tokens
    # together); capacity factor 4.0 = experts / top_k: every expert has a slot for every
    # token, so neither drops one. With drops the two keep different tokens (TED an
    # expert's first in token order, DeepSpeed with use_rts=False whichever torch.topk
    # returns among equal 0/1 mask entries): at 2.0 the first step's losses differ by
    # 4.6e-5 relative on this data, at 4.0 they agree to the last bit.
    rows.append(Row("ted", "ted", tuple(f"dsmoe-{b}" for b in both),
                    argv=(*MOE_ARGV, "--router-group-tokens", str(micro_batch * block_size),
                          "--grad-clip", "0"),
                    why="fp32, no token dropped; "
                        "no clipping (DeepSpeed's clip averages each rank's local "
                        "expert norm over the ranks: another norm than the global one)",
                    needs={f"dsmoe-{b}": "deepspeed" for b in both}, moe=True))
    rows.append(Row("samo", "samo", tuple(f"dense-{b}" for b in both),
                    argv=("--prune-sparsity", str(SAMO_SPARSITY)),
                    why="fp32; SAMO updates the unpruned entries of the same AdamW "
                        "(compressed states), the dense peer all entries with the pruned "
                        "gradients zeroed"))
    if dtype == "bf16":
        rows = [Row(r.name, r.engine, r.peers, r.argv, rtol, why, r.needs, r.moe)
                for r in rows if r.name in BF16_ROWS]
    return rows


#: The default rows at 4 ranks and more (module doc).
ROWS_AT_4 = ("dp", "pipe", "4d-xz", "ted", "samo")
#: The rows whose peers also train in bf16 (autocast or a mixed-precision policy).
BF16_ROWS = ("dp", "4d-z")


def find_row(name: str, rows: list[Row]) -> Row:
    for row in rows:
        if name in (row.engine, *row.peers):
            return row
    raise KeyError(name)


def train_argv(args) -> list[str]:
    """The training options of the contender's row (shared + the row's own)."""
    row = find_row(args.worker, rows_for(args.ranks, args.micro_batch, _block_size(args),
                                         args.device, args.dtype))
    return ["--model", args.model, "--global-batch-size", str(args.global_batch),
            "--micro-batch-size", str(args.micro_batch), "--seed", str(args.seed),
            "--steps", str(args.parity_steps + args.warmup + args.steps),
            "--device", args.device, "--dtype", args.dtype, *row.argv]


def model_config(cfg, dataset):
    """The GPT's shape as the engines build it (training/pipeline/trainer.py)."""
    from training.models.gpt import get_config
    return get_config(cfg.model, vocab_size=dataset.vocab_size, n_layer=cfg.n_layer,
                      n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size)


def _mcrdl_contender(step: Callable[[int], float], rank: int, world: int) -> Contender:
    import torch
    from _peers import mcrdl_bytes

    import mcrdl

    def reduce(values, op):
        t = torch.tensor(values, dtype=torch.float64)
        mcrdl.all_reduce("auto", t, op=op)
        return t.tolist()

    def gather(x):
        v = [0.0] * world
        v[rank] = x
        return reduce(v, mcrdl.ReduceOp.SUM)

    return Contender(step=step, barrier=lambda: reduce([0.0], mcrdl.ReduceOp.SUM),
                     max_over_ranks=lambda v: reduce(v, mcrdl.ReduceOp.MAX),
                     gather=gather, comm_bytes=mcrdl_bytes)


def engine_gpt(layout: list[str], *, init: str = "init") -> Callable:
    def make(args, rank: int, world: int) -> Contender:
        """training.train_gpt's engine for `layout` (options with R for the world), from
        the serial initial weights (--init-from)."""
        from training.train_gpt import parse_args
        argv = [a.replace("R/2", str(world // 2)).replace("R", str(world)) for a in layout]
        path = getattr(args, init)
        cfg = parse_args(train_argv(args) + argv + ["--init-from", str(path)],
                         world_size=world)
        if cfg.uses_4d():
            from training.parallel4d.trainer import Trainer4D
            trainer = Trainer4D(cfg)
        else:
            from training.pipeline.trainer import Trainer
            trainer = Trainer(cfg)
        return _mcrdl_contender(lambda i: trainer.train_step()[0], rank, world)
    return make


def engine_ted(args, rank: int, world: int) -> Contender:
    """training.train_moe's TED engine at pure expert parallelism (--G-expert R)."""
    from training.ted.trainer import MoETrainer
    from training.train_moe import parse_args
    cfg = parse_args(train_argv(args) + ["--G-expert", str(world), "--init-from",
                                         str(args.init_moe)], world_size=world)
    trainer = MoETrainer(cfg)
    return _mcrdl_contender(lambda i: trainer.train_step()[0], rank, world)


def _peer(factory: str, *a, **kw) -> Callable:
    def make(args, rank: int, world: int) -> Contender:
        module, _, name = factory.partition(":")
        return getattr(__import__(module), name)(*a, **kw)(args, rank, world)
    return make


WORKERS: dict[str, Callable] = {
    "dp": engine_gpt(["--G-data", "R"]),
    "pipe": engine_gpt(["--G-inter", "R"]),
    "4d-z": engine_gpt(["--G-z", "R", "--engine", "4d"]),  # the 4D engine at 1 rank too
    "4d-x": engine_gpt(["--G-x", "R", "--engine", "4d"]),
    "4d-xz": engine_gpt(["--G-x", "2", "--G-z", "R/2", "--engine", "4d"]),
    "ted": engine_ted,
    "samo": engine_gpt(["--G-data", "R", "--samo"], init="init_pruned"),
}
for _b in ("gloo", "mcrdl"):
    WORKERS |= {
        f"ddp-{_b}": _peer("_peers:ddp", _b),
        f"dense-{_b}": _peer("_peers:ddp", _b, masked=True),
        f"gpipe-{_b}": _peer("_peers:pipelining", _b, "gpipe"),
        f"1f1b-{_b}": _peer("_peers:pipelining", _b, "1f1b"),
        f"fsdp2-{_b}": _peer("_peers:dtensor", _b, "fsdp2"),
        f"tp-{_b}": _peer("_peers:dtensor", _b, "tp"),
        f"2d-{_b}": _peer("_peers:dtensor", _b, "2d"),
        f"dsmoe-{_b}": _peer("_peers_deepspeed:moe", _b),
    }
# --device cuda: the dense rows' peers over NCCL (rows_for)
WORKERS |= {"ddp-nccl": _peer("_peers:ddp", "nccl"),
            "fsdp2-nccl": _peer("_peers:dtensor", "nccl", "fsdp2")}


def worker(args) -> int:
    from mcrdl.launch import detect

    info = detect()
    rank, world = info.rank, info.size
    c = WORKERS[args.worker](args, rank, world)
    losses, times = [], []
    bytes_per_step = None
    if args.parity_steps:  # the checked steps, their collectives counted by mcrdl's logger
        import mcrdl
        mcrdl.configure(logging=True)
        bytes0 = c.comm_bytes()
        for i in range(args.parity_steps):
            losses.append(c.step(i))
        bytes1 = c.comm_bytes()
        if bytes1 is not None:
            bytes_per_step = (bytes1 - (bytes0 or 0.0)) / args.parity_steps
        mcrdl.configure(logging=False)  # the timed steps run without the logger
    for i in range(args.parity_steps, args.parity_steps + args.warmup + args.steps):
        c.barrier()
        t0 = time.perf_counter()
        c.step(i)
        times.append(time.perf_counter() - t0)
    slowest = c.max_over_ranks(times) if times else []
    rss = c.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # MiB
    peak = None
    if args.peak and rank == 0:  # the MFU's denominator, in each contender's first job
        import torch

        from training.core.flops import peak_flops
        device = (torch.device("cuda", torch.cuda.current_device())
                  if args.device == "cuda" else torch.device("cpu"))
        peak = peak_flops(device)
    sent = c.gather(bytes_per_step if bytes_per_step is not None else -1.0)
    import torch.distributed as dist
    if dist.is_initialized():  # the peers' world, closed before the interpreter exits
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        Path(args.out).write_text(json.dumps(
            {"losses": losses, "step_s": slowest, "rss_mib": rss,
             "bytes_per_step": None if min(sent) < 0 else statistics.mean(sent),
             "peak_flops": peak}))
    return 0


# --- launcher ----------------------------------------------------------------------------
def launch(args, name: str, out: Path, *, parity: bool) -> dict:
    """Run contender `name` as its own mpiexec job; its rank 0's record."""
    cmd = ["mpiexec", "-n", str(args.ranks), sys.executable, str(Path(__file__).resolve()),
           "--worker", name, "--out", str(out), "--init", str(args.init),
           "--init-pruned", str(args.init_pruned), "--init-moe", str(args.init_moe),
           "--ranks", str(args.ranks), "--model", args.model,
           "--global-batch", str(args.global_batch), "--micro-batch", str(args.micro_batch),
           "--seed", str(args.seed), "--device", args.device, "--dtype", args.dtype]
    cmd += ["--parity-steps", str(args.parity_steps if parity else 0), *["--peak"] * parity,
            "--warmup", str(args.warmup), "--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(
                   Path(tempfile.gettempdir()) / "mcrdl-engines-torch-extensions")),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(HERE),
                                                        os.environ.get("PYTHONPATH")])))
    for attempt in (1, 2):  # a job that fails is run once more (the failure is shown)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        if proc.returncode == 0 or attempt == 2:
            break
        print(f"{name}: exited {proc.returncode}, running it again; its last output:\n"
              f"{proc.stderr[-600:]}", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: `{' '.join(cmd)}` exited {proc.returncode}:\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def parity(row: Row, records: dict) -> dict[str, str | None]:
    """Per peer: None when its first losses (`records`: the round-0 records, which
    train the checked steps before the timed ones) match the engine's, else the reason."""
    ref = records[row.engine]
    print(f"parity {row.engine}: losses {', '.join(f'{x:.7f}' for x in ref['losses'])}",
          flush=True)
    verdict = {}
    for peer in row.peers:
        got = records[peer]
        worst = max(abs(a - b) / abs(a)
                    for a, b in zip(ref["losses"], got["losses"], strict=True))
        ok = worst <= row.rtol
        verdict[peer] = None if ok else (f"losses differ by {worst:.2e} relative "
                                         f"(> {row.rtol:g})")
        print(f"parity {peer}: losses {', '.join(f'{x:.7f}' for x in got['losses'])}",
              flush=True)
        print(f"parity {peer}: max relative loss difference {worst:.2e} over "
              f"{len(ref['losses'])} steps (tolerance {row.rtol:g}: {row.why}): "
              f"{'ok' if ok else 'NOT COMPARABLE'}", flush=True)
    return verdict


def save_initial_weights(args, rows: list[Row]) -> None:
    """The serial initial weights every contender loads: the GPT (args.init), the same
    GPT magnitude-pruned to SAMO_SPARSITY (args.init_pruned: n - floor(p n) entries of
    largest magnitude kept over the whole model, the rule of training/samo/pruning.py)
    and the MoE GPT (args.init_moe)."""
    import torch

    from training.models.gpt import GPT
    mcfg, moe_configs = _model_configs(args, moe=any(r.moe for r in rows))
    state = GPT(mcfg, seed=args.seed).state_dict()
    torch.save(state, args.init)
    if any(r.name == "samo" for r in rows):
        from training.samo.pruning import kept_count
        flat = torch.cat([v.reshape(-1).abs() for v in state.values()])
        keep = kept_count(flat.numel(), SAMO_SPARSITY)
        threshold = torch.topk(flat, keep).values.min()
        if int((flat >= threshold).sum()) != keep:
            raise RuntimeError("the pruning threshold ties: pick another --seed")
        torch.save({k: v * (v.abs() >= threshold) for k, v in state.items()},
                   args.init_pruned)
    if any(r.moe for r in rows):
        from training.models.moe import MoEGPT
        moe_cfg, moe = moe_configs
        torch.save(MoEGPT(moe_cfg, moe, seed=args.seed).state_dict(), args.init_moe)


def _model_configs(args, moe: bool = False) -> tuple:
    """(the rows' GPT config, and with `moe` the ted row's (model config, MoE config)),
    as the engines build them from ``--model`` and the dataset's vocabulary."""
    from training.core.data import load_dataset
    from training.train_gpt import parse_args
    base = ["--model", args.model, "--seed", str(args.seed)]
    cfg = parse_args(base)
    dataset = load_dataset(cfg.data, cfg.vocab_size)
    if not moe:
        return model_config(cfg, dataset), None
    from training.models.moe import base_config
    from training.train_moe import parse_args as moe_args
    mc = moe_args(base + list(MOE_ARGV) + ["--micro-batch-size", str(args.micro_batch),
                                           "--router-group-tokens",
                                           str(args.micro_batch * _block_size(args))])
    return model_config(cfg, dataset), (base_config(mc.model, vocab_size=dataset.vocab_size),
                                        mc.moe_config())


def flops_per_token(args, rows: list[Row]) -> dict[str, float]:
    """Per row, the model FLOPs of one trained token of its model
    (training/core/flops.py)."""
    from training.core.flops import model_flops_per_token
    mcfg, moe_configs = _model_configs(args, moe=any(r.moe for r in rows))
    return {r.name: model_flops_per_token(*moe_configs) if r.moe
            else model_flops_per_token(mcfg) for r in rows}


def plot(results: dict, rows: list[Row], path: Path, ranks: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for row in rows for n in (row.engine, *row.peers) if n in results]
    med = [results[n]["median"] for n in names]
    lo = [results[n]["median"] - results[n]["min"] for n in names]
    hi = [results[n]["max"] - results[n]["median"] for n in names]
    colors = ["tab:blue" if n in {r.engine for r in rows} else "tab:gray" for n in names]
    fig, ax = plt.subplots(figsize=(0.9 * len(names) + 2, 4.5))
    ax.bar(names, med, yerr=[lo, hi], color=colors, capsize=3)
    ax.set_ylabel("tokens/s (median; bars: min-max)")
    ax.set_title(f"mcrdl engines (blue) vs peers, {ranks} ranks, OMP_NUM_THREADS=1")
    ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def available(rows: list[Row]) -> tuple[list[Row], list[str]]:
    """The rows with their installed peers, and a note per peer left out."""
    out, notes = [], []
    for row in rows:
        peers = []
        for p in row.peers:
            mod = row.needs.get(p)
            if mod and importlib.util.find_spec(mod) is None:
                notes.append(f"{p}: skipped, {mod} is not installed ({DEEPSPEED_INSTALL})")
            else:
                peers.append(p)
        out.append(Row(row.name, row.engine, tuple(peers), row.argv, row.rtol, row.why,
                       row.needs, row.moe))
    return out, notes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the dp and 4d-z rows on this node's GPUs, peers over NCCL")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="compute precision (default fp32 on cpu, bf16 on cuda); bf16 "
                   "keeps the rows whose peers train in bf16 (dp, 4d-z)")
    p.add_argument("--rows", default=None, help="comma-separated rows: dp, pipe, 4d-z, "
                   "4d-x, 4d-xz (4+ ranks), ted, samo (default: all below 4 ranks, else "
                   f"{','.join(ROWS_AT_4)})")
    p.add_argument("--model", default=None, help="training's --model (default mini; "
                   "gpt2-xl on cuda)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per step (default 8 x --ranks)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parity-steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per job")
    p.add_argument("--rounds", type=int, default=None,
                   help="alternating rounds (default 3; 2 at 4 ranks and more)")
    p.add_argument("--peer-backends", default=None,
                   help="the torch.distributed backends of the peers run (default gloo,mcrdl "
                   "on cpu; nccl on cuda)")
    p.add_argument("--parity-only", action="store_true",
                   help="only the parity step: one job per contender, no timed steps")
    p.add_argument("--png", default="engines.png")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--peak", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    p.add_argument("--init-pruned", help=argparse.SUPPRESS)
    p.add_argument("--init-moe", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.model = args.model or ("gpt2-xl" if cuda else "mini")
    if args.global_batch is None:
        args.global_batch = 8 * args.ranks
    if args.rounds is None:
        args.rounds = 2 if args.ranks >= 4 else 3
    if args.worker:
        return worker(args)
    if args.parity_steps < 1:
        p.error(f"--parity-steps {args.parity_steps}: expected >= 1 (every pair is first "
                "checked to compute the same losses; its timed rounds come after)")
    if cuda:
        import torch
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not 1 <= args.ranks <= have:
            p.error(f"--device cuda --ranks {args.ranks}: this node has {have} GPU(s) "
                    "visible; use --ranks 1.." + str(have) if have else
                    "--device cuda: no GPU visible (torch.cuda.is_available() is False)")

    every = rows_for(args.ranks, args.micro_batch, _block_size(args), args.device, args.dtype)
    if args.rows is None and args.ranks >= 4 and not cuda:
        args.rows = ",".join(r.name for r in every if r.name in ROWS_AT_4)
    if args.rows:
        wanted = args.rows.split(",")
        unknown = set(wanted) - {r.name for r in every}
        if unknown:
            p.error(f"--rows {args.rows}: no row {', '.join(sorted(unknown))} at "
                    f"{args.ranks} ranks; expected some of {', '.join(r.name for r in every)}")
        every = [r for r in every if r.name in wanted]
    args.peer_backends = args.peer_backends or ("nccl" if cuda else "gloo,mcrdl")
    backends = set(args.peer_backends.split(","))
    allowed = {"nccl"} if cuda else {"gloo", "mcrdl"}
    if backends - allowed:
        p.error(f"--peer-backends {args.peer_backends}: expected "
                f"{' or '.join(sorted(allowed))} with --device {args.device}")
    every = [Row(r.name, r.engine, tuple(x for x in r.peers if x.rsplit("-", 1)[1] in backends),
                 r.argv, r.rtol, r.why, r.needs, r.moe) for r in every]
    rows, notes = available(every)
    for note in notes:
        print(note, flush=True)
    if args.parity_only:
        args.rounds, args.warmup, args.steps = 1, 0, 0
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="engines-") as tmpdir:
        tmp = Path(tmpdir)
        args.init, args.init_pruned, args.init_moe = (tmp / "init.pt", tmp / "pruned.pt",
                                                      tmp / "moe.pt")
        save_initial_weights(args, rows)
        order = [n for row in rows for n in (row.engine, *row.peers)]
        samples: dict[str, list[float]] = {n: [] for n in order}
        rss: dict[str, list[float]] = {}
        checked: dict[str, dict] = {}
        tokens = args.global_batch * _block_size(args)
        for r in range(args.rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                rec = launch(args, name, tmp / f"{name}-{r}.json", parity=r == 0)
                if r == 0:
                    checked[name] = rec
                if args.parity_only:
                    continue
                timed = rec["step_s"][args.warmup:] or rec["step_s"]
                samples[name].append(tokens / statistics.median(timed))
                rss[name] = [max(a, b) for a, b in zip(rss.get(name, rec["rss_mib"]),
                                                       rec["rss_mib"], strict=True)]
                print(f"round {r}: {name} {samples[name][-1]:.0f} tokens/s", flush=True)
            if r == 0:
                verdicts = {row.engine: parity(row, checked) for row in rows}
    if args.parity_only:
        bad = [f"{p} ({why})" for v in verdicts.values() for p, why in v.items() if why]
        print("parity: " + ("every pair ok" if not bad else "NOT COMPARABLE: " + ", ".join(bad)))
        return 0
    flops = flops_per_token(args, rows)
    results = {n: {"median": statistics.median(s), "min": min(s), "max": max(s),
                   "rounds": s, "peak_rss_mib": rss[n],
                   "bytes_per_step": checked[n]["bytes_per_step"]}
               for n, s in samples.items()}
    # one peak for the table: the best any contender's rank 0 measured (on a CPU the
    # measurement is disturbed by whatever else runs; on a GPU it is the datasheet's)
    peak, source = max((r["peak_flops"] for r in checked.values()), key=lambda p: p[0])
    for row in rows:  # model flop/s of the median, over the ranks' peak (MFU)
        for name in (row.engine, *row.peers):
            res = results[name]
            res["model_flops_per_s"] = res["median"] * flops[row.name]
            res["mfu"] = res["model_flops_per_s"] / (peak * args.ranks)
    print(f"\n{args.model} GPT, {args.ranks} ranks ({args.device}, {args.dtype}), global batch "
          f"{args.global_batch} x {_block_size(args)} tokens, {args.steps} timed steps after "
          f"{args.warmup}, {args.rounds} alternating rounds, OMP_NUM_THREADS=1, "
          f"{time.perf_counter() - t_start:.0f} s; MFU against {peak / 1e12:.3g} TFLOP/s "
          f"per rank ({source})" + (f", {args.ranks} ranks on {os.cpu_count()} cores"
                                    if args.device == "cpu" and args.ranks > (os.cpu_count()
                                                                             or 1) else ""))
    print(f"{'contender':12} {'tokens/s':>9} {'min':>9} {'max':>9} {'vs best peer':>13} "
          f"{'RSS/rank MiB':>14} {'MB/step/rank':>13} {'MFU':>7}")
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
            sent = res["bytes_per_step"]
            print(f"{name:12} {res['median']:9.0f} {res['min']:9.0f} {res['max']:9.0f} "
                  f"{ratio:>13} {max(res['peak_rss_mib']):14.0f} "
                  f"{'-' if sent is None else f'{sent / 1e6:.2f}':>13} "
                  f"{res['mfu']:7.1%}")
        if best is None:
            lines.append(f"engines: {row.engine} not comparable (no peer passed parity: "
                         + "; ".join(f"{p}: {verdicts[row.engine][p]}" for p in row.peers)
                         + ")" if row.peers else
                         f"engines: {row.engine} has no installed peer")
        else:
            ratio = results[row.engine]["median"] / results[best]["median"]
            # within a round the contenders ran minutes apart, under the same load
            per_round = [e / max(results[p]["rounds"][r] for p in ok)
                         for r, e in enumerate(results[row.engine]["rounds"])]
            results[row.engine]["per_round_vs_best_peer"] = per_round
            lines.append(f"engines: {row.engine} {ratio:.2f}x best peer ({best}); per "
                         f"round vs that round's best peer "
                         f"{'/'.join(f'{x:.2f}' for x in per_round)}, median "
                         f"{statistics.median(per_round):.2f}")
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
