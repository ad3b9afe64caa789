"""The model families the engines build, by ``--arch`` name.

A family is a config class, its named shapes, the stage class (units ``first..last``
of one model, as training/models/gpt.py defines units) and ``make_unit``. Engines ask
for a family by name (``family(cfg.arch)``) or by a config they hold (``family_of``),
never for a model module directly, so that one code path serves every family.
Checkpoint manifests record the family's name beside the config's fields
(``describe``), and ``config_from_dict`` reads both back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch.nn as nn

from . import gpt, llama

__all__ = ["FAMILIES", "Family", "config_from_dict", "describe", "family", "family_of",
           "model_shape"]


@dataclass(frozen=True)
class Family:
    name: str                              # --arch
    config_type: type
    configs: dict[str, Any]                # --model names -> shapes
    stage: type[nn.Module]                 # Stage(cfg, first, last, seed, activation_checkpointing)
    make_unit: Callable[[Any, int, int], nn.Module]
    shape_options: tuple[str, ...]         # the ModelOptions fields that override a shape
    from_dict: Callable[[dict], Any]

    def config(self, model: str, **overrides) -> Any:
        """Shape `model` of this family with `overrides` (None: keep the shape's);
        ValueError naming the model and the family's shapes when unknown."""
        if model not in self.configs:
            raise ValueError(f"unknown {self.name} model {model!r}; expected one of "
                             f"{', '.join(self.configs)} (or another --arch)")
        unknown = sorted(k for k, v in overrides.items()
                         if v is not None and k not in (*self.shape_options, "vocab_size"))
        if unknown:
            raise ValueError(f"--{unknown[0].replace('_', '-')} does not apply to "
                             f"--arch {self.name}")
        given = {k: v for k, v in overrides.items() if v is not None}
        base = self.configs[model]
        if hasattr(base, "head_dim") and {"n_embd", "n_head"} & given.keys():
            given.setdefault("head_dim", None)  # derived again from the new width
        return replace(base, **given)


_GPT_SHAPE = ("n_layer", "n_head", "n_embd", "block_size")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("gpt", gpt.GPTConfig, gpt.CONFIGS, gpt.GPTStage, gpt.make_unit, _GPT_SHAPE,
           lambda d: gpt.GPTConfig(**d)),
    Family("llama", llama.LlamaConfig, llama.CONFIGS, llama.LlamaStage, llama.make_unit,
           (*_GPT_SHAPE, "n_kv_head"), llama.LlamaConfig.from_dict),
)}


def family(arch: str) -> Family:
    """The family ``--arch`` `arch` names; ValueError listing the known ones."""
    if arch not in FAMILIES:
        raise ValueError(f"unknown architecture {arch!r}; expected one of "
                         f"{', '.join(FAMILIES)}")
    return FAMILIES[arch]


def family_of(cfg: Any) -> Family:
    """The family whose config class `cfg` is an instance of (exactly)."""
    for f in FAMILIES.values():
        if type(cfg) is f.config_type:
            return f
    raise TypeError(f"{type(cfg).__name__} is the config of no model family; families: "
                    f"{', '.join(f.config_type.__name__ for f in FAMILIES.values())}")


def describe(cfg: Any) -> dict:
    """`cfg` as a manifest records it: its fields and ``"arch"``."""
    return {**cfg.as_dict(), "arch": family_of(cfg).name}


def config_from_dict(d: dict) -> Any:
    """The config :func:`describe` wrote (no ``"arch"``: a GPT, as manifests before
    the field)."""
    fields = dict(d)
    return family(fields.pop("arch", "gpt")).from_dict(fields)


def model_shape(options: Any, vocab_size: int) -> Any:
    """The shape a command's model options give (training/core/run_options.py
    ModelOptions: ``--arch``'s family, ``--model`` and the overriding options) with
    `vocab_size`; ValueError naming the options (``options.model_error``)."""
    try:
        return family(options.arch).config(
            options.model, vocab_size=vocab_size, n_layer=options.n_layer,
            n_head=options.n_head, n_embd=options.n_embd, block_size=options.block_size,
            n_kv_head=options.n_kv_head)
    except ValueError as e:
        raise ValueError(options.model_error(e)) from None
