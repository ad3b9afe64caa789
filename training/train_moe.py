"""Train a Mixture-of-Experts GPT with DeepSpeed-TED (tensor x expert x data parallelism,
duplicate token dropping, communication-aware checkpointing, tiled optimizer) on mcrdl.

    mpiexec -n 4 python -m training.train_moe --model moe-tiny --experts 4 --top-k 2 \\
        --G-tensor 2 --G-expert 2 --dtd --cac --activation-checkpointing
    mpiexec -n 4 python -m training.train_moe --G-expert 4 --backends a2a=gloo,allreduce=mpi
    torchrun --nproc-per-node 2 -m training.train_moe --G-tensor 2 --backends gloo

The layout (training/ted.py): ``G_tensor x G_data_nonexp`` ranks, ``G_data_nonexp =
G_expert x G_data_exp``. ``--G-data`` (G_data_nonexp) defaults to world / G_tensor.
Options as train_gpt's (``--help``; ``--config FILE`` with [model], [moe], [data],
[parallel], [optimizer], [run] tables). ``--backends`` names the backends to initialize
and pins collective kinds: ``a2a=gloo,allreduce=mpi,allgather=auto`` (default "auto" for
every kind). Rank 0 shows a progress bar (on a terminal) and one line per
``--log-interval`` steps, writes ``--metrics`` (JSON lines: step, loss, aux_loss,
dropped_fraction, lr, grad_norm, time_s, tokens_per_s), and at the end prints the time
per phase, the communication per collective kind (calls and bytes per step, from
mcrdl's logger) and saves the loss curve as a PNG. ``--checkpoint-dir`` writes sharded
atomic checkpoints (exact resume with ``--resume``); ``python -m training.checkpoint
consolidate DIR -o moe.pt`` writes the serial MoEGPT ``state_dict``, and ``--init-from
moe.pt`` starts a run of any layout from it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mcrdl

from . import config, report
from .command import run_command, train_loop
from .config import DataOptions, ModelOptions, OptimizerOptions, Options, RunOptions, option
from .moe import MoEConfig
from .report import TrainResult
from .ted import TEDLayout
from .topology import Axis


@dataclass
class MoEOptions(Options):
    section = "moe"
    experts: int = option(4, "experts per MoE layer", minimum=1)
    top_k: int = option(1, "experts per token: 1 (Switch) or 2 (GShard)", minimum=1)
    capacity_factor: float = option(1.25, "expert capacity = ceil(factor x top_k x group "
                                    "tokens / experts)")
    moe_every: int = option(2, "every k-th block has an MoE FFN", minimum=1)
    router_group_tokens: int = option(16, "tokens per router group (capacity, dropping and "
                                      "the aux loss are per group)", minimum=1)
    aux_loss_coef: float = option(0.01, "weight of the load-balancing loss", minimum=0)

    def moe_config(self) -> MoEConfig:
        return MoEConfig(experts=self.experts, top_k=self.top_k,
                         capacity_factor=self.capacity_factor, moe_every=self.moe_every,
                         router_group_tokens=self.router_group_tokens,
                         aux_loss_coef=self.aux_loss_coef)

    def check(self) -> None:
        try:
            self.moe_config()
        except ValueError as e:
            raise ValueError(str(e).replace("MoEConfig: ", "")) from None


@dataclass
class TEDOptions(Options):
    section = "parallel"
    G_tensor: int = option(1, "tensor-parallel ranks (Megatron) of every block",
                           minimum=1, axis=Axis.TENSOR)
    G_expert: int = option(1, "expert-parallel ranks (experts spread, tokens all-to-all'd)",
                           minimum=1, axis=Axis.EXPERT)
    G_data: int | None = option(None, "data-parallel ranks of the non-expert parameters "
                                "(G_data_nonexp; default world / G_tensor)", minimum=1)
    dtd: bool = option(False, "duplicate token dropping before each all-to-all (acts when "
                       "G_tensor > 1 and G_expert > 1)")
    cac: bool = option(False, "communication-aware checkpointing (with "
                       "--activation-checkpointing)")
    optimizer_tile: int | None = option(None, "expert optimizer tile in parameters (default "
                                        "untiled)", minimum=1)
    debug_checks: bool = option(False, "check that dispatch buffers agree across tensor "
                                "ranks (per MoE call: an all_gather over the tensor group and "
                                "an all_reduce over the world)")
    comm_log: bool = option(True, "log every collective (mcrdl's logger) for the end-of-run "
                            "communication breakdown")

    def layout(self, world_size: int) -> TEDLayout:
        g_data = self.G_data
        if g_data is None:
            if world_size % self.G_tensor:
                raise ValueError(f"world of {world_size} ranks is not divisible by G_tensor="
                                 f"{self.G_tensor}")
            g_data = world_size // self.G_tensor
        return TEDLayout(self.G_tensor, self.G_expert, g_data)

    def check(self) -> None:
        if self.offload_optimizer:
            raise ValueError("--offload-optimizer: train_moe shards the optimizer states "
                             "(ZeRO-1) instead; drop the option")
        if self.dtype == "fp16":
            raise ValueError("--dtype fp16: train_moe has no loss scaling; use bf16 or fp32")
        if self.cac and not self.activation_checkpointing:
            raise ValueError("--cac needs --activation-checkpointing (it removes the "
                             "recomputation's collectives)")
        if self.G_data is not None:
            TEDLayout(self.G_tensor, self.G_expert, self.G_data).check()


@dataclass
class MoETrainConfig(RunOptions, OptimizerOptions, TEDOptions, DataOptions, MoEOptions,
                     ModelOptions):
    """The options of ``python -m training.train_moe``."""

    model: str = option("moe-tiny", "base model shape (training/moe.py MOE_BASES or "
                        "training/models/gpt.py CONFIGS)")
    out_dir: str = option("runs/moe", "directory of the metrics and the loss plot")
    backends: str | None = option(None, "mcrdl backends to initialize and collective kinds "
                                  "pinned, e.g. mpi,gloo,a2a=gloo,allreduce=mpi (default: mpi "
                                  "or gloo; every kind 'auto')")

    def optim(self):
        return self.optimizer_config(self.steps)

    def describe_grid(self) -> str:
        g = f"G_data={self.G_data}" if self.G_data else "G_data=world/G_tensor"
        return f"G_tensor={self.G_tensor} x G_expert={self.G_expert}, {g}"


def parse_args(argv: Sequence[str] | None = None) -> MoETrainConfig:
    """The run's validated options (ValueError naming a bad option)."""
    return config.parse_args(MoETrainConfig, argv, prog="python -m training.train_moe",
                             description=__doc__)


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
    from .moe_trainer import MoETrainer

    cfg.validate()
    trainer = MoETrainer(cfg, **trainer_options)
    result = TrainResult(grid=trainer.layout.describe())
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
                         f"MoE GPT, {result.grid}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """The command: 0 when trained, 2 for bad options, 3 for an unusable checkpoint. A
    layout or model the world cannot hold is a ValueError named by the rank's check."""
    return run_command(parse_args, run, argv, layout_errors=(ValueError,),
                       layout_errors_agree=False)


if __name__ == "__main__":
    sys.exit(main())
