"""The model families the engines build, by ``--arch`` name.

A family is a config class, its named shapes, the stage class (units ``first..last``
of one model, as training/models/gpt.py defines units) and ``make_unit``. Engines ask
for a family by name (``family(cfg.arch)``) or by a config they hold (``family_of``),
never for a model module directly, so that one code path serves every family.
Checkpoint manifests record the family's name beside the config's fields
(``describe``), and ``config_from_dict`` reads both back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch.nn as nn

from ..core.run_options import HF_PREFIX
from . import gpt, llama, mixtral

__all__ = ["FAMILIES", "Family", "config_from_dict", "describe", "family", "family_of",
           "hf_shape", "model_shape", "read_hf_config"]


@dataclass(frozen=True)
class Family:
    name: str                              # --arch
    config_type: type
    configs: dict[str, Any]                # --model names -> shapes
    # Stage(cfg, first, last, seed, activation_checkpointing); None: no stage of its
    # own (mixtral: its blocks need a MoEConfig; python -m training.train_moe builds it)
    stage: type[nn.Module] | None
    make_unit: Callable[[Any, int, int], nn.Module] | None
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
    Family("mixtral", mixtral.MixtralConfig, mixtral.CONFIGS, None, None,
           (*_GPT_SHAPE, "n_kv_head"), mixtral.MixtralConfig.from_dict),
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
    `vocab_size`; ValueError naming the options (``options.model_error``).
    With ``--init-from hf:DIR`` the shape is the Hugging Face config.json's
    (:func:`hf_shape`)."""
    resume = getattr(options, "resume", None)
    resumed = resumed_config(resume, getattr(options, "checkpoint_dir", None)) \
        if resume else None
    if resumed is not None:  # the checkpoint's manifest has the shape
        return source_shape(options, f"--resume {resume}", vocab_size, resumed, "manifest")
    init_from = getattr(options, "init_from", None)
    if init_from and init_from.startswith(HF_PREFIX):
        return hf_shape(options, init_from, vocab_size)
    described = described_config(init_from) if init_from else None
    if described is not None:  # a consolidated .pt: the .json beside it has the shape
        return source_shape(options, f"--init-from {init_from}", vocab_size, described,
                            ".json")
    try:
        return family(options.arch).config(
            options.model, vocab_size=vocab_size, n_layer=options.n_layer,
            n_head=options.n_head, n_embd=options.n_embd, block_size=options.block_size,
            n_kv_head=options.n_kv_head)
    except ValueError as e:
        raise ValueError(options.model_error(e)) from None


# ModelOptions' defaults: an option at its default is not "given" and gives way to the
# Hugging Face config.json
_DEFAULT_ARCH, _DEFAULT_MODEL = "gpt", "tiny"


def read_hf_config(directory: str | os.PathLike) -> Any:
    """Our config of the Hugging Face directory's config.json (training/models/hf.py
    converts it; no weight file is opened); ValueError naming the file and, for an
    architecture we lack, the supported ones."""
    from .hf import CONFIG, SUPPORTED

    path = os.path.join(directory, CONFIG)
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist; a Hugging Face model directory holds "
                         "config.json and safetensors weights") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read: {e}") from None
    names = (hf.get("architectures") or []) if isinstance(hf, dict) else []
    if not names or names[0] not in SUPPORTED:
        raise ValueError(f"{path}: architecture {names[0] if names else None!r} is not "
                         f"supported; supported: {', '.join(SUPPORTED)}")
    try:
        return SUPPORTED[names[0]].from_hf(hf)
    except KeyError as e:
        raise ValueError(f"{path}: field {e.args[0]!r} of a {names[0]} config is "
                         "missing") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def _config_of(d: dict) -> Any:
    if "arch" not in d and "n_kv_head" in d:  # written before the "arch" field
        d = {**d, "arch": "llama"}
    return config_from_dict(d)


def resumed_config(spec: str, root: str | None) -> Any:
    """The model config of the checkpoint ``--resume`` `spec` names (its manifest's),
    None where there is none to read or it is TED's (train_moe's options resolve those):
    the resume itself then reports the problem."""
    from ..core.checkpoint import latest_checkpoint

    path = latest_checkpoint(root) if spec == "latest" and root else Path(spec)
    try:
        manifest = json.loads((Path(path) / "manifest.json").read_text())
        if manifest.get("engine") == "ted" or not isinstance(manifest.get("model"), dict):
            return None
        return _config_of(manifest["model"])
    except (OSError, TypeError, ValueError):
        return None


def described_config(path: str) -> Any:
    """The config in the ``.json`` that ``python -m training.checkpoint consolidate``
    writes beside a serial state_dict `path` (:func:`describe`'s form; one without
    "arch" but with n_kv_head is a llama's), None when there is none or it describes an
    MoE (train_moe's own options resolve those); ValueError naming a .json that does not
    describe a model."""
    sidecar = Path(path).with_suffix(".json")
    if not Path(path).is_file() or not sidecar.is_file():
        return None
    try:
        d = json.loads(sidecar.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{sidecar}: cannot be read ({e})") from None
    if not isinstance(d, dict) or "moe" in d:
        return None
    try:
        return _config_of(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{sidecar}: not a model description beside --init-from {path} "
                         f"({e}); consolidate's .json holds the model's config") from None


def hf_shape(options: Any, spec: str, vocab_size: int) -> Any:
    """The model of ``--init-from hf:DIR`` (`spec`): config.json's shape
    (:func:`source_shape`)."""
    return source_shape(options, f"--init-from {spec}", vocab_size,
                        read_hf_config(spec.removeprefix(HF_PREFIX)), "config.json")


def source_shape(options: Any, where: str, vocab_size: int, cfg: Any, document: str) -> Any:
    """The model of the source `where` names (``--init-from hf:DIR``, ``--init-from
    M.pt``, ``--resume STEP``), whose `document` (config.json, the .pt's .json, the
    checkpoint's manifest) gives `cfg`. Options given beside it (``--arch`` and
    ``--model`` away from their defaults, a shape option set) must agree with it:
    ValueError naming both.
    ``--block-size`` may be shorter than the source's context when the weights do not
    depend on it (rotary positions, not a position table). `vocab_size`, the data's
    vocabulary when the options give it (the byte corpus, or ``--vocab-size``), must
    not exceed the model's."""
    fam = family_of(cfg)

    def disagree(option: str, theirs: str, fix: str = "") -> ValueError:
        return ValueError(f"{option} disagrees with {where}, whose {document} "
                          f"gives {theirs}; drop {option.split()[0]} (the source's "
                          f"config sets the model){fix}")

    arch = getattr(options, "arch", _DEFAULT_ARCH)
    if arch != _DEFAULT_ARCH and arch != fam.name:
        raise disagree(f"--arch {arch}", f"--arch {fam.name}")
    model = getattr(options, "model", _DEFAULT_MODEL)
    if model != _DEFAULT_MODEL:
        named = fam.configs.get(model)
        if named is None or replace(named, vocab_size=cfg.vocab_size,
                                    block_size=cfg.block_size) != cfg:
            raise disagree(f"--model {model}", f"a {fam.name} model of its own shape")
    for name in fam.shape_options:
        given = getattr(options, name, None)
        theirs = getattr(cfg, name)
        if given is None or given == theirs:
            continue
        if name == "block_size" and given < theirs:
            shorter = replace(cfg, block_size=given)
            if shorter.n_params() == cfg.n_params():
                cfg = shorter
                continue
            raise disagree(f"--block-size {given}", f"block_size {theirs}",
                           f"; a {fam.name} model's position table has {theirs} rows")
        raise disagree(f"--{name.replace('_', '-')} {given}", f"{name} {theirs}")
    for name in ("n_layer", "n_head", "n_embd", "block_size", "n_kv_head"):
        if name not in fam.shape_options and getattr(options, name, None) is not None:
            raise ValueError(f"--{name.replace('_', '-')} does not apply to {where} "
                             f"(a {fam.name} model)")
    data = getattr(options, "data", None)
    data_given = data in (None, "", "stdlib") or getattr(options, "vocab_size", None)
    if data_given and vocab_size > cfg.vocab_size:
        raise ValueError(f"the data's vocabulary ({vocab_size} tokens) exceeds {where}'s "
                         f"vocab_size {cfg.vocab_size}; its token ids would have no "
                         "embedding: prepare the data with the model's tokenizer")
    return cfg
