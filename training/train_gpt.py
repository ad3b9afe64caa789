"""Train a GPT with AxoNN's pipeline x data parallelism, or its 4D (X x Y x Z x data)
parallelism, on mcrdl.

    mpiexec -n 4 python -m training.train_gpt --model tiny --steps 50 --G-inter 2 --G-data 2
    mpiexec -n 8 python -m training.train_gpt --G-x 2 --G-y 2 --G-z 2 --overlap all
    torchrun --nproc-per-node 4 -m training.train_gpt --G-inter 4
    srun -n 8 python -m training.train_gpt --config my_run.toml --steps 1000
    mpiexec -n 8 python -m training.train_gpt --G-inter 2 --G-data 4 --dtype bf16 \
        --samo --prune-sparsity 0.9 --prune-schedule 0,100,200     # SAMO (training/samo.py)

Options (``--help``; declared in training/config.py) come from their defaults, then
``--config FILE`` (TOML or JSON: option names with underscores as keys, at the top level
or in the tables [model], [data], [parallel], [optimizer], [run], [samo]), then the command
line. Rank 0 shows a progress bar (on a terminal) and one log line per
``--log-interval`` steps, writes ``--metrics`` (JSON lines: step, loss, lr, grad_norm,
time_s, tokens_per_s), and at the end prints the per-phase time breakdown per pipeline
stage and saves the loss curve as a PNG.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import config, report
from .command import run_command
from .config import TrainConfig
from .report import MetricsFile, ProgressLog, TrainResult
from .topology import GridError
from .trainer import Trainer


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """The run's validated options (ValueError naming a bad option)."""
    return config.parse_args(TrainConfig, argv, prog="python -m training.train_gpt",
                             description=__doc__)


def run(cfg: TrainConfig, **trainer_options) -> TrainResult:
    """Train per `cfg` on this rank; returns the per-step losses (and, on rank 0, the
    phase breakdown). Every rank of the world must call it with the same config (or
    every rank of a group, with ``grid=ProcessGrid(..., world=group)``); `trainer_options`
    go to Trainer."""
    cfg.validate()
    if cfg.uses_4d():
        from .parallel4d.trainer import Trainer4D
        trainer = Trainer4D(cfg, **trainer_options)
    else:
        trainer = Trainer(cfg, **trainer_options)
    result = TrainResult(grid=cfg.describe_grid())
    if cfg.resume:
        result.start_step = trainer.load_checkpoint(cfg.resume)
    is_rank0 = trainer.world_rank == 0
    verbose = is_rank0 and not cfg.quiet
    if verbose:
        print(trainer.describe(), flush=True)
    metrics = MetricsFile(cfg.metrics_path, result.start_step) if is_rank0 else None
    progress = ProgressLog(cfg.last_step - result.start_step, lines=verbose,
                           bar=verbose and cfg.progress)
    tokens_per_step = cfg.global_batch_size * trainer.model_cfg.block_size
    timed_since, timed_from_step = time.perf_counter(), result.start_step
    try:
        while trainer.step < cfg.last_step:
            if trainer.step == result.start_step + 1:  # the run's first step is warm-up
                trainer.timers.reset()
                timed_since, timed_from_step = time.perf_counter(), trainer.step
            step_start = time.perf_counter()
            loss, applied = trainer.train_step()
            step_time = time.perf_counter() - step_start
            result.losses.append((trainer.step, loss))
            if is_rank0:
                record = trainer.metrics_record(loss, step_time, tokens_per_step, applied)
                metrics.write(record)
                if trainer.step % cfg.log_interval == 0 or trainer.step == cfg.last_step:
                    progress.log(report.step_line(record, cfg.steps))
                progress.advance()
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {trainer.step}; lower --lr "
                                         "or use --dtype fp32/bf16")
            if cfg.checkpoint_due(trainer.step):
                directory = trainer.save_checkpoint()
                progress.log(f"checkpoint {directory}")
    finally:
        progress.close()
        if metrics:
            metrics.close()
    wall = time.perf_counter() - timed_since
    steps_timed = trainer.step - timed_from_step
    result.stage, result.events = trainer.stage_index, trainer.engine.events
    result.phases = report.gather_phase_times(trainer.timers, wall, steps_timed,
                                              key=trainer.stage_index,
                                              group=trainer.world_group)
    if result.phases and cfg.uses_4d():
        result.tokens_per_s = tokens_per_step * steps_timed / wall
        if not cfg.quiet:
            report.print_breakdown_4d(result, steps_timed)
    elif result.phases:
        n_micro = trainer.batches.n_micro
        result.bubble_measured, result.bubble_model = report.pipeline_bubble(
            result.phases, trainer.n_stages, n_micro)
        result.tokens_per_s = tokens_per_step * steps_timed / wall
        if not cfg.quiet:
            report.print_breakdown(result, steps_timed, trainer.n_stages, n_micro)
    if is_rank0 and cfg.plot:
        report.plot_loss(metrics.path, Path(cfg.out_dir) / "loss.png", f"GPT, {result.grid}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """The command: 0 when trained, 2 for bad options, 3 for an unusable checkpoint.
    A grid that does not fit the run is the same error on every rank."""
    return run_command(parse_args, run, argv, layout_errors=(GridError,),
                       layout_errors_agree=True)


if __name__ == "__main__":
    sys.exit(main())
