"""Train a Mixture-of-Experts GPT with DeepSpeed-TED (tensor x expert x data parallelism,
duplicate token dropping, communication-aware checkpointing, tiled optimizer) on mcrdl.

    mpiexec -n 4 python -m training.train_moe --model moe-tiny --experts 4 --top-k 2 \\
        --G-tensor 2 --G-expert 2 --dtd --cac --activation-checkpointing
    mpiexec -n 4 python -m training.train_moe --G-expert 4 --backends a2a=gloo,allreduce=mpi
    torchrun --nproc-per-node 2 -m training.train_moe --G-tensor 2 --backends gloo

``--arch mixtral`` (training/models/mixtral.py): Llama blocks (RMSNorm, rotary,
grouped-query attention) with SwiGLU experts and Mixtral's top-k gating (defaults: 8
experts, top-2, every block); ``--init-from hf:DIR`` starts it from a Hugging Face
MixtralForCausalLM (its shape, experts and top-k; each rank reads the experts it holds).
``--capacity-factor 0`` is dropless: no token dropped, the capacity agreed over the
expert group per MoE call.

The layout (training/ted/model.py): ``G_tensor x G_data_nonexp`` ranks, ``G_data_nonexp =
G_expert x G_data_exp``. ``--G-data`` (G_data_nonexp) defaults to world / G_tensor.
Options as train_gpt's (``--help``; ``--config FILE`` with [model], [moe], [data],
[parallel], [optimizer], [run] tables). ``--backends`` names the backends to initialize
and pins collective kinds: ``a2a=gloo,allreduce=mpi,allgather=auto`` (default "auto" for
every kind). Rank 0 shows a progress bar (on a terminal) and one line per
``--log-interval`` steps, writes ``--metrics`` (JSON lines: step, loss, aux_loss,
dropped_fraction, lr, grad_norm, time_s, tokens_per_s, and moe_load: per MoE layer its
unit, the token-expert assignments routed to each expert, those dropped, and the
largest expert load over the mean), and at the end prints the time
per phase, the communication per collective kind (calls and bytes per step, from
mcrdl's logger) and saves the loss curve as a PNG. ``--checkpoint-dir`` writes sharded
atomic checkpoints (exact resume with ``--resume``); ``python -m training.checkpoint
consolidate DIR -o moe.pt`` writes the serial MoEGPT (or Mixtral) ``state_dict``, and ``--init-from
moe.pt`` starts a run of any layout from it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mcrdl
from mcrdl.launch import detect as detect_launch

from .core import options, report
from .core.report import TrainResult
from .core.runner import run_command, train_loop
from .plan.auto import LayoutOptions, auto_layout
from .ted.options import MoETrainConfig


@dataclass
class MoECommandConfig(LayoutOptions, MoETrainConfig):
    """The command's options: the engine's (MoETrainConfig) and the layout section."""


def parse_args(argv: Sequence[str] | None = None, *,
               world_size: int | None = None) -> MoECommandConfig:
    """The run's validated options (ValueError naming a bad option); with `world_size`,
    also checked against a world of that many ranks."""
    return options.parse_args(MoECommandConfig, argv, prog="python -m training.train_moe",
                             description=__doc__, world_size=world_size)


def comm_breakdown(steps: int) -> list[dict]:
    """Collective over the world: the logged calls per (op, backend, group size) as rows
    with the calls and bytes per step and rank (the mean over ranks); rank 0 gets them,
    the others []."""
    rows = mcrdl.log_summary(gather=True, quiet=True)
    if mcrdl.get_rank() != 0:
        return []
    merged: dict[tuple, dict] = {}
    for r in rows:
        key = (r["op"], r["backend"], r["group_size"])
        m = merged.setdefault(key, {"op": r["op"], "backend": r["backend"],
                                    "group_size": r["group_size"], "count": 0, "bytes": 0})
        m["count"] += r["count"]
        m["bytes"] += r["bytes"]
    out = sorted(merged.values(), key=lambda m: (-m["bytes"], m["op"]))
    per = max(1, steps) * mcrdl.get_size()
    for m in out:
        m["calls_per_step"] = m["count"] / per
        m["bytes_per_step"] = m["bytes"] / per
    return out


def print_comm(rows: list[dict], steps: int) -> None:
    print(f"\ncommunication per step and rank (mean over ranks, {steps} steps after warm-up; "
          "mcrdl's logger):")
    print(f"{'op':<18} {'backend':<8} {'ranks':>5} {'calls':>9} {'bytes':>14}")
    for r in rows:
        print(f"{r['op']:<18} {r['backend']:<8} {r['group_size']:>5} "
              f"{r['calls_per_step']:>9.1f} {r['bytes_per_step']:>14,.0f}")


def run(cfg: MoETrainConfig, **trainer_options) -> TrainResult:
    """Train per `cfg` on this rank; every rank calls it with the same config. Returns
    the per-step losses; ``result.comm`` holds the communication rows on rank 0."""
    from .ted.trainer import MoETrainer

    cfg.validate()
    choice = None
    if getattr(cfg, "layout", "manual") == "auto":
        cfg, choice = auto_layout(cfg, build=lambda c: MoETrainer(c, **trainer_options))
    trainer = MoETrainer(cfg, **trainer_options)
    result = TrainResult(grid=trainer.layout.describe())
    result.layout = choice
    result.aux, result.dropped, result.comm = [], [], []
    logging = cfg.comm_log and mcrdl.configure().logging is None  # not already on
    if logging:
        mcrdl.configure(logging=True)

    def on_step():
        result.aux.append(trainer.last["aux"])
        result.dropped.append(trainer.last["dropped"])

    wall, steps_timed = train_loop(
        trainer, cfg, result, nan_hint="lower --lr",
        on_warmup_end=mcrdl.reset_log if logging else lambda: None, on_step=on_step,
        line_suffix=lambda record: (f" | aux {record['aux_loss']:.4f} | dropped "
                                    f"{record['dropped_fraction']:.3f}"))
    tokens_per_step = cfg.global_batch_size * trainer.model_cfg.block_size
    is_rank0 = trainer.world_rank == 0
    result.trainer = trainer
    result.phases = report.gather_phase_times(trainer.timers, wall, steps_timed, key=0)
    if logging:
        result.comm = comm_breakdown(steps_timed)
        mcrdl.configure(logging=False)
    if result.phases:
        result.tokens_per_s = tokens_per_step * steps_timed / wall
        if not cfg.quiet:
            phases = result.phases[0]
            print(f"\nper-step time by phase (ms, mean over ranks; {steps_timed} steps after "
                  "warm-up): " + ", ".join(f"{k} {phases[k] * 1e3:.2f}"
                                           for k in ("compute", "collective", "optimizer",
                                                     "other", "wall")))
            if result.comm:
                print_comm(result.comm, steps_timed)
            print(f"throughput: {result.tokens_per_s:,.0f} tokens/s", flush=True)
    if is_rank0 and cfg.plot:
        report.plot_loss(cfg.metrics_path, Path(cfg.out_dir) / "loss.png",
                         f"{'Mixtral' if cfg.arch == 'mixtral' else 'MoE GPT'}, {result.grid}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """The command: 0 when trained, 2 for bad options, 3 for an unusable checkpoint. A
    layout or model the world cannot hold is a ValueError named by the rank's check."""
    return run_command(lambda args: parse_args(args, world_size=detect_launch().size), run,
                       argv, layout_errors=(ValueError,),
                       layout_errors_agree=False, gather_refusals=True)


if __name__ == "__main__":
    sys.exit(main())
