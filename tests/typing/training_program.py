"""A user program of the training package's entry points: the commands' configs and
``run``, the engines' trainers and options, and the reference models.

tests/test_typing.py runs pyright and mypy on it (no error expected) and runs it in
one process: the configs, options and models are built and the models run a forward
pass (training runs are tests/test_training*.py's; here their calls are only checked).
"""

from __future__ import annotations

import torch
from typing_extensions import assert_type

from training.core.report import TrainResult
from training.models import GPT, GPTConfig, GPTStage
from training.models.moe import MoEConfig, MoEGPT
from training.parallel4d.options import TensorOptions
from training.parallel4d.trainer import Trainer4D
from training.pipeline.options import PipelineOptions
from training.pipeline.trainer import Trainer
from training.samo.options import SamoOptions
from training.ted.options import MoEOptions, MoETrainConfig, TEDOptions
from training.ted.trainer import MoETrainer
from training.train_gpt import TrainConfig
from training.train_gpt import parse_args as gpt_args
from training.train_gpt import run as train_gpt
from training.train_moe import MoECommandConfig
from training.train_moe import parse_args as moe_args
from training.train_moe import run as train_moe


def train(cfg: TrainConfig, moe: MoETrainConfig) -> list[tuple[int, float]]:
    """A run of each command from Python, and a step of each engine's trainer (every
    rank of the world calls it alike; not run here)."""
    result = train_gpt(cfg)
    assert_type(result, TrainResult)
    assert_type(train_moe(moe), TrainResult)
    trainer = Trainer4D(cfg) if cfg.uses_4d() else Trainer(cfg, record=True)
    loss, stop = trainer.train_step()
    assert_type(loss, float)
    assert_type(stop, bool)
    assert_type(trainer.save_checkpoint().name, str)
    assert_type(MoETrainer(moe).load_checkpoint("latest"), int)
    return result.losses


def main() -> None:
    cfg = gpt_args(["--model", "tiny", "--steps", "2", "--G-inter", "1"])
    assert_type(cfg, TrainConfig)
    assert isinstance(cfg, (PipelineOptions, TensorOptions, SamoOptions))
    cfg.validate()
    assert_type(cfg.G_inter, int)
    assert_type(cfg.uses_4d(), bool)
    moe = moe_args(["--experts", "2", "--steps", "1"])
    assert_type(moe, MoECommandConfig)
    assert isinstance(moe, (MoEOptions, TEDOptions)) and moe.experts == 2

    gpt_config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    model = GPT(gpt_config, seed=0)
    assert_type(model, GPTStage)
    tokens = torch.randint(0, 32, (2, 8))
    assert model(tokens).shape[:2] == (2, 8)
    experts = MoEGPT(gpt_config, MoEConfig(experts=2, moe_every=1, router_group_tokens=16), seed=0)
    assert_type(experts.n_params(), int)
    logits, _ = experts(tokens)
    assert logits.shape[:2] == (2, 8)


if __name__ == "__main__":
    main()
