"""The loss of a model on a token split, under any launcher and layout.

    python -m training.evaluate --init-from hf:llama-dir --data data/mine --windows 64
    mpiexec -n 4 python -m training.evaluate --init-from runs/ckpt/step_000100 \\
        --data data/mine --G-inter 2 --G-data 2
    mpiexec -n 4 python -m training.evaluate --init-from moe.pt --trainer train_moe \\
        --data data/mine --G-tensor 2 --G-expert 2 --experts 4

Window i is tokens ``[i*T, i*T+T+1)`` of ``--split`` (inputs its first T, targets its
last T), ``i < --windows`` (default: as many as the split holds); T is ``--block-size``
(default the model's context). The last line printed is one JSON object: ``{"loss":
mean cross-entropy over all W*T targets, "tokens": W*T, "windows": W}``.

``--init-from`` is a Hugging Face directory (``hf:DIR``), a serial state_dict (``.pt``;
its shape from the ``.json`` that ``python -m training.checkpoint consolidate`` writes
beside it, else from the model options) or a checkpoint's step directory (which must
have been saved on this layout; consolidate it for another). The engine is train_gpt's
(pipeline x data, or 4D with ``--G-x/--G-y/--G-z``) or, with ``--trainer train_moe`` (the
default for a Mixtral directory or a train_moe checkpoint), train_moe's TED, built with
the layout options as the trainers take them (or ``--layout auto``: the layout their
planner chooses, training/plan/auto.py; a checkpoint keeps its own); its ``evaluate``
spreads the windows over the data-parallel shards. ``--serial`` instead runs the whole
serial model in every process (the reference the engines are checked against).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mcrdl.launch import detect as detect_launch

from .core import checkpoint as ckpt
from .core import options
from .core.data import eval_windows, load_dataset
from .core.goldfish import IGNORE_INDEX
from .core.options import Options, PathOptionError, option
from .core.run_options import HF_PREFIX, DataOptions, ModelOptions, OptimizerOptions, RunOptions
from .core.runner import run_command
from .core.topology import GridError
from .models import families
from .parallel4d.options import TensorOptions
from .pipeline.options import PipelineOptions
from .plan import auto
from .plan.auto import LayoutOptions
from .samo.options import SamoOptions
from .ted.options import MoETrainConfig

#: The model options a source's shape fills (those the model options can express).
SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "n_kv_head")


@dataclass
class EvalOptions(Options):
    section = "eval"
    split: str = option("val", "the split of --data to evaluate", choices=("train", "val"))
    windows: int | None = option(None, "windows of --block-size tokens (default: all the "
                                 "split holds)", minimum=1)
    trainer: str | None = option(None, "whose engines evaluate: train_gpt (pipeline x data, "
                                 "4D) or train_moe (TED); default: from --init-from",
                                 choices=("train_gpt", "train_moe"))
    serial: bool = option(False, "the whole serial model in every process instead of the "
                          "engine (the reference)")


@dataclass
class EvalConfig(LayoutOptions, EvalOptions, SamoOptions, RunOptions, OptimizerOptions,
                 TensorOptions, PipelineOptions, DataOptions, ModelOptions):
    """train_gpt's options and the evaluation's."""

    def model_config(self):
        return families.model_shape(self, self.data_vocab_size())


@dataclass
class MoEEvalConfig(LayoutOptions, EvalOptions, MoETrainConfig):
    """train_moe's options and the evaluation's."""


# --------------------------------------------------------------------------- sources

@dataclass
class Source:
    """What --init-from names: its kind ("hf", "pt", "checkpoint"), the engine family
    ("gpt" or "moe") and the model's config dict (families.describe's form; with "moe"
    beside "model" for an MoE), None for a .pt without its .json."""

    spec: str
    kind: str
    engine: str
    config: dict | None
    manifest: dict | None = None

    @property
    def model(self) -> dict | None:
        if self.config is None:
            return None
        return self.config["model"] if "moe" in self.config else self.config


def read_source(spec: str, trust: bool = False) -> Source:
    """The init source `spec` names; FileNotFoundError/CheckpointError naming it."""
    if spec.startswith(HF_PREFIX):
        from .models.hf import HFCheckpoint

        with HFCheckpoint(spec.removeprefix(HF_PREFIX)) as hf:
            moe = "Mixtral" in hf.architecture.name
            return Source(spec, "hf", "moe" if moe else "gpt",
                          None if moe else families.describe(hf.config))
    path = Path(spec)
    if path.is_dir():
        manifest = ckpt.read_manifest(path, trust=trust)
        ted = manifest.get("engine") == "ted"
        config = {"model": manifest["model"], "moe": manifest["moe"]} if ted else \
            manifest["model"]
        return Source(spec, "checkpoint", "moe" if ted else "gpt", config, manifest)
    if not path.is_file():
        raise FileNotFoundError(f"--init-from {spec}: no such file or directory; expected "
                                "hf:DIR, a .pt state_dict or a checkpoint's step directory")
    sidecar = path.with_suffix(".json")
    config = json.loads(sidecar.read_text()) if sidecar.is_file() else None
    return Source(spec, "pt", "moe" if config and "moe" in config else "gpt", config)


def model_config(d: dict):
    """Our config of a config dict (families.describe's form, or a manifest's before the
    "arch" field: a llama's holds n_kv_head)."""
    if "arch" not in d and "n_kv_head" in d:
        d = {**d, "arch": "llama"}
    return families.config_from_dict(d)


def serial_model(source: Source, fallback=None) -> torch.nn.Module:
    """The whole serial model of `source` in fp32, in eval mode; `fallback`: the model
    config of a .pt without its .json."""
    if source.kind == "hf":
        from .models.hf import load_hf

        model = load_hf(source.spec.removeprefix(HF_PREFIX), dtype=torch.float32)
        return model.eval()
    if source.kind == "checkpoint":
        state, config = consolidate(source)
    else:
        state, config = torch.load(source.spec, map_location="cpu", weights_only=True), \
            source.config
    if config is not None and "moe" in config:
        from .models.moe import MoEConfig, MoEGPT

        model = MoEGPT(model_config(config["model"]), MoEConfig(**config["moe"]))
    else:
        cfg = model_config(config) if config is not None else fallback
        if cfg is None:
            sidecar = Path(source.spec).with_suffix(".json")
            raise ValueError(f"--init-from {source.spec}: no {sidecar} with its shape; give "
                             "the model options")
        model = families.family_of(cfg).stage(cfg, 0, cfg.n_units - 1)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.float().eval()


def consolidate(source: Source) -> tuple[dict, dict]:
    """(whole state_dict, config dict) of a checkpoint's step directory."""
    from .parallel4d import consolidate as parallel4d
    from .pipeline import consolidate as pipeline
    from .ted import consolidate as ted

    engines = {"pipeline": pipeline.consolidate, "4d": parallel4d.consolidate,
               "ted": ted.consolidate}
    engine = source.manifest.get("engine", "pipeline")
    if engine not in engines:
        raise ckpt.CheckpointError(f"{source.spec} was written by the engine {engine!r}; "
                                   f"this version reads those of {', '.join(engines)}")
    return engines[engine](source.spec, source.manifest)


@torch.no_grad()
def serial_loss(model: torch.nn.Module, windows: torch.Tensor, batch: int = 8) -> tuple[float, int]:
    """(mean cross-entropy over the targets of `windows` [W, T+1] that are not
    IGNORE_INDEX, their count): the serial reference of ``trainer.evaluate``."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for rows in windows.split(batch):
        x, y = rows[:, :-1], rows[:, 1:]
        out = model(x)
        logits = out[0] if isinstance(out, tuple) else out
        total += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="sum").double()
        count += int((y != IGNORE_INDEX).sum())
    return float(total / count), count


# --------------------------------------------------------------------------- command

def fill_shape(cfg, source: Source, window: int | None) -> None:
    """Set the model options (and --vocab-size) from `source`'s shape where they were
    left at their defaults; ValueError naming an option given otherwise, or a window
    (--block-size) longer than a GPT's position table."""
    model = source.model
    if model is None:
        return
    defaults = type(cfg)()
    arch = model.get("arch", "llama" if "n_kv_head" in model else "gpt")
    if hasattr(cfg, "arch"):
        if cfg.arch != defaults.arch and cfg.arch != arch:
            raise ValueError(f"--arch {cfg.arch}: --init-from {source.spec} holds a {arch} "
                             "model")
        cfg.arch = arch
    context = model.get("block_size")
    if window is not None and context is not None and window > context and arch == "gpt":
        raise ValueError(f"--block-size {window}: the model's position embedding holds "
                         f"{context} positions; give at most {context}")
    for name in SHAPE_FIELDS:
        if not hasattr(cfg, name):
            continue
        value = model.get(name)
        given = getattr(cfg, name)
        if given is not None and value is not None and given != value:
            raise ValueError(f"--{name.replace('_', '-')} {given}: --init-from "
                             f"{source.spec} has {value}")
        if value is not None:
            setattr(cfg, name, value)
    vocab = model.get("vocab_size")
    if cfg.vocab_size is None and vocab is not None:
        cfg.vocab_size = vocab


def parse_args(argv: Sequence[str] | None = None, *, world_size: int | None = None):
    """The validated options; the config class by --trainer (or the source's). The
    source's shape fills the model options before the checks of the model and the world.
    A checkpoint directory is no --init-from of the trainers' options: it is taken out
    of the command line they check and loaded as a resume."""
    argv = list(sys.argv[1:] if argv is None else argv)
    trainer = _flag_value(argv, "--trainer")
    spec = _flag_value(argv, "--init-from")
    if spec is None:
        raise ValueError("--init-from is required: hf:DIR, a .pt state_dict or a "
                         "checkpoint's step directory")
    try:
        source = read_source(spec, trust="--trust-checkpoint" in argv)
    except (FileNotFoundError, ckpt.CheckpointError, ValueError) as e:
        raise PathOptionError(str(e)) from None
    if source.kind == "checkpoint":  # loaded as a resume: the manifest gives the shape
        argv = [*_without_flag(argv, "--init-from"), "--resume", spec]
    # --block-size is the windows' length here, not a shape option checked against the
    # source's (a model evaluates windows up to its context)
    window = _flag_value(argv, "--block-size")
    try:
        window = None if window is None else int(window)
    except ValueError:
        raise ValueError(f"--block-size {window!r}: expected a number of tokens") from None
    if window is not None and window < 1:
        raise ValueError(f"--block-size {window}: expected 1 or more")
    if source.model is not None:
        argv = _without_flag(argv, "--block-size")
    moe = trainer == "train_moe" if trainer else source.engine == "moe"
    config_class = MoEEvalConfig if moe else EvalConfig
    cfg = options.parse_args(config_class, argv, prog="python -m training.evaluate",
                             description=__doc__)
    cfg.source = source
    fill_shape(cfg, source, window)
    cfg.window = window
    if source.kind == "checkpoint" and hasattr(cfg, "dtype"):
        cfg.dtype = (source.manifest.get("train_config") or {}).get("dtype", cfg.dtype)
    if cfg.layout == "auto" and (cfg.serial or cfg.layout_trials):
        raise ValueError("--layout auto chooses the engine's layout: not with --serial (one "
                         "whole model per process) nor --layout-trials (trials train)")
    cfg.validate()
    if world_size is not None:
        cfg.check_world(world_size)
    cfg.validate_node()
    return cfg


def auto_layout(cfg):
    """--layout auto: the options with the layout the trainers' planner chooses (a
    checkpoint source, loaded as a resume, keeps the layout it was saved on).
    Collective over the world."""
    chosen, _ = auto.auto_layout(cfg)
    chosen.source, chosen.window = cfg.source, cfg.window
    return chosen


def _without_flag(argv: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def _flag_value(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def build_trainer(cfg):
    """The engine's trainer for the layout options, holding the source's weights."""
    source = cfg.source
    if isinstance(cfg, MoETrainConfig):
        from .ted.trainer import MoETrainer
        trainer = MoETrainer(cfg)
    elif cfg.uses_4d():
        from .parallel4d.trainer import Trainer4D
        trainer = Trainer4D(cfg)
    else:
        from .pipeline.trainer import Trainer
        trainer = Trainer(cfg)
    if source.kind == "checkpoint":
        trainer.load_checkpoint(source.spec)
    if not hasattr(trainer, "evaluate"):
        raise ValueError(f"{type(trainer).__name__} has no evaluate() yet; give --serial")
    return trainer


def run(cfg) -> dict:
    """Evaluate per `cfg` on this rank (collective unless --serial); returns the result
    and prints it on rank 0."""
    if cfg.serial:
        dataset = load_dataset(cfg.data, cfg.vocab_size)
        model = serial_model(cfg.source, fallback=cfg.model_config())
        windows = eval_windows(dataset.splits[cfg.split], cfg.windows,
                               cfg.window or model.cfg.block_size)
        loss, tokens = serial_loss(model, windows)
        rank = detect_launch().rank
    else:
        if cfg.layout == "auto":
            cfg = auto_layout(cfg)
        trainer = build_trainer(cfg)
        windows = eval_windows(trainer.dataset.splits[cfg.split], cfg.windows,
                               cfg.window or trainer.model_cfg.block_size)
        loss = trainer.evaluate(windows)
        tokens = int((windows[:, 1:] != IGNORE_INDEX).sum())
        rank = trainer.world_rank
    result = {"loss": loss, "tokens": tokens, "windows": int(windows.shape[0])}
    if rank == 0:
        where = "serial" if cfg.serial else cfg.describe_grid()
        print(f"{cfg.source.spec}: {cfg.split} loss {loss:.6f} over {tokens} tokens "
              f"({windows.shape[0]} windows of {windows.shape[1] - 1}; {where})")
        print(json.dumps(result), flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """0 when evaluated, 2 for bad options, 3 for an unusable checkpoint."""
    return run_command(lambda args: parse_args(args, world_size=detect_launch().size), run,
                       argv, layout_errors=(GridError, ValueError), layout_errors_agree=True,
                       gather_refusals=True)


if __name__ == "__main__":
    sys.exit(main())
