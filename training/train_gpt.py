"""Train a GPT or a Llama-family model (``--arch``) with AxoNN's pipeline x data
parallelism, or its 4D (X x Y x Z x data) parallelism, on mcrdl.

    mpiexec -n 4 python -m training.train_gpt --model tiny --steps 50 --G-inter 2 --G-data 2
    mpiexec -n 8 python -m training.train_gpt --G-x 2 --G-y 2 --G-z 2 --overlap all
    torchrun --nproc-per-node 4 -m training.train_gpt --G-inter 4
    srun -n 8 python -m training.train_gpt --config my_run.toml --steps 1000
    mpiexec -n 8 python -m training.train_gpt --G-inter 2 --G-data 4 --dtype bf16 \
        --samo --prune-sparsity 0.9 --prune-schedule 0,100,200     # SAMO (training/samo/)
    mpiexec -n 4 python -m training.train_gpt --init-from hf:TinyLlama-1.1B --data tokens/ \
        --block-size 512 --G-data 4    # a Hugging Face model: its config.json's shape

Options (``--help``; declared in training/core/run_options.py and each engine's
options.py) come from their defaults, then
``--config FILE`` (TOML or JSON: option names with underscores as keys, at the top level
or in the tables [model], [data], [parallel], [optimizer], [run], [samo]), then the command
line. Rank 0 shows a progress bar (on a terminal) and one log line per
``--log-interval`` steps, writes ``--metrics`` (JSON lines: step, loss, lr, grad_norm,
time_s, tokens_per_s), and at the end prints the per-phase time breakdown per pipeline
stage and saves the loss curve as a PNG.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mcrdl.launch import detect as detect_launch

from .core import options, report
from .core.report import TrainResult
from .core.run_options import DataOptions, ModelOptions, OptimizerOptions, RunOptions
from .core.runner import run_command, train_loop
from .core.topology import GridError
from .models.families import family_of, model_shape
from .models.gpt import GPTConfig
from .models.llama import LlamaConfig
from .parallel4d.options import TensorOptions
from .pipeline.options import PipelineOptions
from .pipeline.trainer import Trainer
from .plan.auto import LayoutOptions, auto_layout
from .samo.options import SamoOptions


@dataclass
class TrainConfig(LayoutOptions, SamoOptions, RunOptions, OptimizerOptions, TensorOptions,
                  PipelineOptions, DataOptions, ModelOptions):
    """The options of ``python -m training.train_gpt`` (the last base's fields come
    first: model, data, parallel, tensor, optimizer, run, samo, layout)."""

    def model_config(self) -> GPTConfig | LlamaConfig:
        """The model's shape (training/models/families.py), ValueError naming --arch,
        --model and the overriding options."""
        model = model_shape(self, self.data_vocab_size())
        family = family_of(model)
        if family.stage is None:
            source = f"--init-from {self.init_from}" if self.init_from else f"--arch {self.arch}"
            raise ValueError(f"{source} is a {family.name} model, which this command does "
                             f"not build; train it with python -m training.train_moe --arch "
                             f"{family.name}")
        return model


def parse_args(argv: Sequence[str] | None = None, *,
               world_size: int | None = None) -> TrainConfig:
    """The run's validated options (ValueError naming a bad option); with `world_size`,
    also checked against a world of that many ranks."""
    return options.parse_args(TrainConfig, argv, prog="python -m training.train_gpt",
                             description=__doc__, world_size=world_size)


def run(cfg: TrainConfig, **trainer_options) -> TrainResult:
    """Train per `cfg` on this rank; returns the per-step losses (and, on rank 0, the
    phase breakdown). Every rank of the world must call it with the same config (or
    every rank of a group, with ``grid=ProcessGrid(..., world=group)``); `trainer_options`
    go to Trainer."""
    cfg.validate()
    choice = None
    if cfg.layout == "auto":
        cfg, choice = auto_layout(cfg, build=lambda c: _trainer(c, trainer_options))
    trainer = _trainer(cfg, trainer_options)
    result = TrainResult(grid=cfg.describe_grid())
    result.layout = choice
    wall, steps_timed = train_loop(trainer, cfg, result,
                                   nan_hint="lower --lr or use --dtype fp32/bf16")
    tokens_per_step = cfg.global_batch_size * trainer.model_cfg.block_size
    is_rank0 = trainer.world_rank == 0
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
        arch = family_of(trainer.model_cfg).name
        report.plot_loss(cfg.metrics_path, Path(cfg.out_dir) / "loss.png",
                         f"{'GPT' if arch == 'gpt' else arch.capitalize()}, {result.grid}")
    return result


def _trainer(cfg: TrainConfig, trainer_options: dict):
    """The engine's trainer for `cfg`: 4D when a tensor axis is used, else the pipeline."""
    if cfg.uses_4d():
        from .parallel4d.trainer import Trainer4D
        return Trainer4D(cfg, **trainer_options)
    return Trainer(cfg, **trainer_options)


def main(argv: Sequence[str] | None = None) -> int:
    """The command: 0 when trained, 2 for bad options, 3 for an unusable checkpoint.
    A grid that does not fit the run is the same error on every rank."""
    return run_command(lambda args: parse_args(args, world_size=detect_launch().size), run,
                       argv, layout_errors=(GridError,),
                       layout_errors_agree=True, gather_refusals=True)


if __name__ == "__main__":
    sys.exit(main())
