"""Hugging Face checkpoints in and out of the serial models.

A Hugging Face directory holds ``config.json`` and the weights in safetensors, either one
``model.safetensors`` or shards listed by ``model.safetensors.index.json``. Supported
architectures (``config.json``'s ``architectures[0]``):

- ``LlamaForCausalLM`` <-> :class:`training.models.llama.LlamaStage`
- ``GPT2LMHeadModel``  <-> :class:`training.models.gpt.GPTStage` (GPT-2's own
  ``gelu_new``, the tanh approximation, as ``activation="gelu_tanh"``; ``gelu`` exact)
- ``MixtralForCausalLM`` <-> :class:`training.models.mixtral.Mixtral` (train_moe's
  ``--arch mixtral``): the shape is a MixtralConfig (``config``), the experts and their
  routing a MoEConfig (``moe``: every block sparse, Mixtral's gating, dropless as HF
  routes, HF's router_aux_loss_coef). Each expert is its own tensors in the files
  (``block_sparse_moe.experts.E.w1/w2/w3``: gate, down, up), so a rank reads only the
  experts it holds.

Reading goes tensor by tensor through safetensors slices, so a parallel engine's rank
reads only its shard: :meth:`HFCheckpoint.state_dict` takes ``select(name, shape)``,
called with each of our parameter names and its full shape in our layout, returning the
index (a tuple of slices) of the part this rank holds, or None for a tensor it does not
hold. GPT-2's Conv1D weights are stored transposed relative to nn.Linear; the conversion
transposes the index too, so a slice of our layout reads the matching slice of the file.

Writing (:func:`export_hf`) gives a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads as is: config.json,
model.safetensors and generation_config.json. Fields of an imported config.json that our
models do not describe (token ids, ...), its generation config and its tokenizer files
are carried over when ``source`` names the imported directory.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.nn as nn

from .gpt import GPTConfig, GPTStage
from .llama import Llama3RopeScaling, LlamaConfig, LlamaStage
from .mixtral import Mixtral, MixtralConfig
from .moe import MoEConfig

__all__ = ["HFCheckpoint", "HFConfigError", "SUPPORTED", "export_hf", "export_state_dict",
           "load_hf"]

Select = Callable[[str, tuple[int, ...]], "tuple[slice, ...] | None"]

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
# Buffers some transformers versions saved beside the parameters; they carry no weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


class HFConfigError(ValueError):
    """A Hugging Face config.json that our models cannot represent."""


@dataclass(frozen=True)
class TensorMap:
    """Our parameter ``name`` is the HF tensor ``hf_name`` (transposed when ``transposed``).
    ``fallback`` is read when the files lack ``hf_name`` (an LM head tied to the
    embedding); ``export`` is False for a tensor HF does not store (our tied LM head)."""
    name: str
    hf_name: str
    transposed: bool = False
    fallback: str | None = None
    export: bool = True


# ---------------------------------------------------------------------------- Llama

def _need(hf: dict, field: str, ok: bool, expected: str) -> None:
    if not ok:
        raise HFConfigError(f"{field}={hf.get(field)!r} cannot be represented; "
                            f"our model supports {expected}")


def _llama_from_hf(hf: dict) -> LlamaConfig:
    _need(hf, "hidden_act", hf.get("hidden_act", "silu") == "silu", "'silu' (SwiGLU)")
    _need(hf, "attention_bias", not hf.get("attention_bias", False), "no biases")
    _need(hf, "mlp_bias", not hf.get("mlp_bias", False), "no biases")
    rope = dict(hf.get("rope_parameters") or {})
    if not rope:  # transformers 4's layout: rope_theta beside rope_scaling
        rope = dict(hf.get("rope_scaling") or {})
        rope["rope_theta"] = hf.get("rope_theta", 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise HFConfigError(f"rope type {kind!r} cannot be represented; our "
                            f"model supports 'default' and 'llama3'")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFConfigError(f"partial_rotary_factor="
                            f"{rope['partial_rotary_factor']!r} cannot be represented; our "
                            f"model rotates every feature (1.0)")
    scaling = None
    if kind == "llama3":
        scaling = Llama3RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope["original_max_position_embeddings"]))
    return LlamaConfig(
        n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"],
        n_embd=hf["hidden_size"], block_size=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"], n_kv_head=hf.get("num_key_value_heads"),
        intermediate_size=hf["intermediate_size"], head_dim=hf.get("head_dim"),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope["rope_theta"]), rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _llama_to_hf(cfg: LlamaConfig) -> dict:
    s = cfg.rope_scaling
    scaling = None if s is None else {
        "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position}
    return {"model_type": "llama", "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
            "hidden_size": cfg.n_embd, "intermediate_size": cfg.intermediate_size,
            "head_dim": cfg.head_dim, "max_position_embeddings": cfg.block_size,
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": cfg.tie_embeddings}


def _llama_tensors(cfg: LlamaConfig, moe: MoEConfig | None = None) -> list[TensorMap]:
    head = cfg.n_units - 1
    out = [TensorMap("units.0.embed_tokens.weight", "model.embed_tokens.weight")]
    for layer in range(cfg.n_layer):
        ours, theirs = f"units.{layer + 1}", f"model.layers.{layer}"
        out += [TensorMap(f"{ours}.{n}.weight", f"{theirs}.{n}.weight") for n in (
            "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
            "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
            "mlp.down_proj")]
    out.append(TensorMap(f"units.{head}.norm.weight", "model.norm.weight"))
    if cfg.tie_embeddings:
        out.append(TensorMap(f"units.{head}.lm_head.weight", "model.embed_tokens.weight",
                             export=False))
    else:
        out.append(TensorMap(f"units.{head}.lm_head.weight", "lm_head.weight"))
    return out


# ---------------------------------------------------------------------------- GPT-2

#: transformers' GPT-2 activations -> GPTConfig.activation ("gelu_new", "gelu_fast" and
#: "gelu_pytorch_tanh" are one formula, the tanh approximation, computed three ways).
_GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
                     "gelu_pytorch_tanh": "gelu_tanh"}


def _gpt2_from_hf(hf: dict) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    _need(hf, "activation_function", act in _GPT2_ACTIVATIONS,
          f"one of {', '.join(_GPT2_ACTIVATIONS)} (GPTConfig.activation: the exact GELU "
          "or its tanh approximation)")
    n_embd = hf.get("n_embd", 768)
    _need(hf, "n_inner", hf.get("n_inner") in (None, 4 * n_embd), f"4 x n_embd = {4 * n_embd}")
    _need(hf, "layer_norm_epsilon", hf.get("layer_norm_epsilon", 1e-5) == 1e-5,
          "1e-5 (nn.LayerNorm's)")
    _need(hf, "scale_attn_weights", hf.get("scale_attn_weights", True), "true")
    _need(hf, "scale_attn_by_inverse_layer_idx",
          not hf.get("scale_attn_by_inverse_layer_idx", False), "false")
    _need(hf, "add_cross_attention", not hf.get("add_cross_attention", False), "false")
    return GPTConfig(n_layer=hf.get("n_layer", 12), n_head=hf.get("n_head", 12),
                     n_embd=n_embd, block_size=hf.get("n_positions", 1024),
                     vocab_size=hf.get("vocab_size", 50257), bias=True,
                     activation=_GPT2_ACTIVATIONS[act])


def _gpt2_to_hf(cfg: GPTConfig) -> dict:
    if not cfg.bias:
        raise HFConfigError("GPT-2 checkpoints have biases; a GPT with bias=False has no "
                            "GPT2LMHeadModel equivalent")
    return {"model_type": "gpt2", "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_embd": cfg.n_embd, "n_positions": cfg.block_size, "n_inner": None,
            "vocab_size": cfg.vocab_size,
            "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
            "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


def _gpt2_tensors(cfg: GPTConfig, moe: MoEConfig | None = None) -> list[TensorMap]:
    head = cfg.n_units - 1
    out = [TensorMap("units.0.wte.weight", "transformer.wte.weight"),
           TensorMap("units.0.wpe.weight", "transformer.wpe.weight")]
    for layer in range(cfg.n_layer):
        ours, theirs = f"units.{layer + 1}", f"transformer.h.{layer}"
        for n in ("ln_1", "ln_2"):
            out += [TensorMap(f"{ours}.{n}.{p}", f"{theirs}.{n}.{p}") for p in ("weight", "bias")]
        for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):  # Conv1D: (in, out)
            out += [TensorMap(f"{ours}.{n}.weight", f"{theirs}.{n}.weight", transposed=True),
                    TensorMap(f"{ours}.{n}.bias", f"{theirs}.{n}.bias")]
    out += [TensorMap(f"units.{head}.ln_f.{p}", f"transformer.ln_f.{p}")
            for p in ("weight", "bias")]
    out.append(TensorMap(f"units.{head}.lm_head.weight", "lm_head.weight",
                         fallback="transformer.wte.weight"))
    return out


# ---------------------------------------------------------------------------- Mixtral

def _mixtral_from_hf(hf: dict) -> MixtralConfig:
    _need(hf, "sliding_window", hf.get("sliding_window") is None, "full attention (null)")
    _need(hf, "router_jitter_noise", not hf.get("router_jitter_noise", 0.0),
          "no router noise (0.0): routing must not depend on the rank")
    cfg = _llama_from_hf({**hf, "rms_norm_eps": hf.get("rms_norm_eps", 1e-5)})
    return MixtralConfig(**cfg.as_dict() | {"rope_scaling": cfg.rope_scaling})


def _mixtral_moe_from_hf(hf: dict, cfg: MixtralConfig) -> MoEConfig:
    """HF's routing: every block sparse, Mixtral's gating, no capacity (dropless); one
    router group per sequence (the aux loss is per group; the routing is not)."""
    return MoEConfig(experts=hf.get("num_local_experts", 8),
                     top_k=hf.get("num_experts_per_tok", 2), capacity_factor=0,
                     moe_every=1, router_group_tokens=cfg.block_size,
                     aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                     gating="mixtral")


def _mixtral_to_hf(cfg: MixtralConfig, moe: MoEConfig | None = None) -> dict:
    if moe is None:
        raise TypeError("export_hf: a Mixtral needs its MoEConfig (moe=) for its experts")
    if moe.moe_every != 1 or moe.gating != "mixtral":
        raise HFConfigError(f"moe_every={moe.moe_every}, gating={moe.gating!r}: "
                            "MixtralForCausalLM has experts in every block and Mixtral's "
                            "gating (moe_every=1, gating='mixtral')")
    out = _llama_to_hf(cfg)
    if out.pop("rope_scaling") is not None:
        raise HFConfigError("rope_scaling: MixtralForCausalLM has no rotary scaling")
    for k in ("attention_bias", "mlp_bias"):
        out.pop(k)
    return {**out, "model_type": "mixtral", "num_local_experts": moe.experts,
            "num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coef,
            "router_jitter_noise": 0.0, "sliding_window": None, "output_router_logits": False}


def _mixtral_tensors(cfg: MixtralConfig, moe: MoEConfig | None = None) -> list[TensorMap]:
    if moe is None:
        raise TypeError("a Mixtral's tensors need its MoEConfig (moe=)")
    head = cfg.n_units - 1
    out = [TensorMap("units.0.embed_tokens.weight", "model.embed_tokens.weight")]
    for layer in range(cfg.n_layer):
        ours, theirs = f"units.{layer + 1}", f"model.layers.{layer}"
        out += [TensorMap(f"{ours}.{n}.weight", f"{theirs}.{n}.weight") for n in (
            "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
            "self_attn.o_proj", "post_attention_layernorm")]
        if not moe.is_moe(layer):
            out += [TensorMap(f"{ours}.mlp.{n}.weight", f"{theirs}.mlp.{n}.weight")
                    for n in ("gate_proj", "up_proj", "down_proj")]
            continue
        out.append(TensorMap(f"{ours}.moe.router.weight",
                             f"{theirs}.block_sparse_moe.gate.weight"))
        for e in range(moe.experts):
            out += [TensorMap(f"{ours}.moe.experts.{e}.{n}.weight",
                              f"{theirs}.block_sparse_moe.experts.{e}.{w}.weight")
                    for n, w in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))]
    out.append(TensorMap(f"units.{head}.norm.weight", "model.norm.weight"))
    out.append(TensorMap(f"units.{head}.lm_head.weight", "lm_head.weight"))
    return out


@dataclass(frozen=True)
class Architecture:
    name: str                 # config.json's architectures[0]
    config_type: type
    stage: type[nn.Module]
    from_hf: Callable[[dict], object]
    to_hf: Callable[..., dict]                   # (config, moe=None)
    tensors: Callable[..., list[TensorMap]]      # (config, moe=None)
    moe_from_hf: Callable[[dict, object], MoEConfig] | None = None


SUPPORTED: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", LlamaConfig, LlamaStage, _llama_from_hf, _llama_to_hf,
                 _llama_tensors),
    Architecture("GPT2LMHeadModel", GPTConfig, GPTStage, _gpt2_from_hf, _gpt2_to_hf,
                 _gpt2_tensors),
    Architecture("MixtralForCausalLM", MixtralConfig, Mixtral, _mixtral_from_hf,
                 _mixtral_to_hf, _mixtral_tensors, _mixtral_moe_from_hf),
)}


# ---------------------------------------------------------------------------- reading

class HFCheckpoint:
    """An open Hugging Face directory: ``config`` (ours), ``moe`` (a MixtralForCausalLM's
    MoEConfig, else None), ``architecture`` and the tensors, read lazily. Use as a
    context manager (it holds the safetensors files open)."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = os.fspath(path)
        cfg_path = os.path.join(self.path, CONFIG)
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{cfg_path} does not exist; a Hugging Face checkpoint "
                                    f"directory holds config.json and safetensors weights")
        with open(cfg_path) as f:
            self.hf_config: dict = json.load(f)
        names = self.hf_config.get("architectures") or []
        if not names or names[0] not in SUPPORTED:
            raise HFConfigError(f"{cfg_path}: architecture {names[0] if names else None!r} is "
                                f"not supported; supported: {', '.join(SUPPORTED)}")
        self.architecture = SUPPORTED[names[0]]
        try:
            self.config = self.architecture.from_hf(self.hf_config)
            self.moe = (None if self.architecture.moe_from_hf is None
                        else self.architecture.moe_from_hf(self.hf_config, self.config))
        except KeyError as e:
            raise HFConfigError(f"{cfg_path}: field {e.args[0]!r} of a {names[0]} config is "
                                f"missing") from None
        except (TypeError, ValueError) as e:  # ours (HFConfigError) and LlamaConfig's checks
            raise HFConfigError(f"{cfg_path}: {e}") from None
        self._files = self._weight_files()
        self._stack = ExitStack()
        self._open = {f: self._stack.enter_context(safe_open(os.path.join(self.path, f), "pt"))
                      for f in sorted(set(self._files.values()))}

    def _weight_files(self) -> dict[str, str]:
        """Tensor name -> file (relative to the directory); checks every file exists."""
        from safetensors import safe_open

        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = dict(json.load(f)["weight_map"])
        elif os.path.isfile(os.path.join(self.path, WEIGHTS)):
            with safe_open(os.path.join(self.path, WEIGHTS), "pt") as f:
                files = {k: WEIGHTS for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.path}: no {WEIGHTS} and no {INDEX}; only "
                                    f"safetensors weights are read (save with "
                                    f"save_pretrained(..., safe_serialization=True))")
        for name in sorted(set(files.values())):
            if not os.path.isfile(os.path.join(self.path, name)):
                users = sum(1 for v in files.values() if v == name)
                raise FileNotFoundError(f"{self.path}: shard {name} is missing ({INDEX} "
                                        f"lists {users} tensors in it)")
        return files

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def _slice(self, hf_name: str):
        return self._open[self._files[hf_name]].get_slice(hf_name)

    def tensor_maps(self) -> list[TensorMap]:
        """Our names and their HF sources; checks that every HF tensor has a use."""
        maps = self.architecture.tensors(self.config, self.moe)
        used = {m.hf_name for m in maps} | {m.fallback for m in maps if m.fallback}
        unused = sorted(n for n in self._files if n not in used
                        and not n.endswith(_IGNORED_SUFFIXES))
        if unused:
            raise HFConfigError(f"{self.path}: tensors {', '.join(unused[:5])}"
                                f"{' ...' if len(unused) > 5 else ''} have no place in our "
                                f"{self.architecture.name} (config.json and weights disagree?)")
        return maps

    def state_dict(self, select: Select | None = None) -> dict[str, torch.Tensor]:
        """Our parameter names -> tensors (the parts ``select`` picks; all by default)."""
        out = {}
        for m in self.tensor_maps():
            hf_name = m.hf_name
            if hf_name not in self._files:
                if m.fallback is None or m.fallback not in self._files:
                    raise HFConfigError(f"{self.path}: tensor {hf_name} is missing from the "
                                        f"weights (needed for our {m.name})")
                hf_name = m.fallback
            view = self._slice(hf_name)
            shape = tuple(view.get_shape())
            if m.transposed:
                shape = shape[::-1]
            index = select(m.name, shape) if select else tuple(slice(None) for _ in shape)
            if index is None:
                continue
            t = view[index[::-1] if m.transposed else index]
            out[m.name] = t.t().contiguous() if m.transposed else t
        return out


def load_hf(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> nn.Module:
    """The whole serial model (LlamaStage, GPTStage or Mixtral) holding the weights of the
    Hugging Face directory ``path``; ``dtype`` converts them (default: as stored)."""
    with HFCheckpoint(path) as ckpt:
        if ckpt.moe is not None:
            model = ckpt.architecture.stage(ckpt.config, ckpt.moe)
        else:
            model = ckpt.architecture.stage(ckpt.config, 0, ckpt.config.n_units - 1)
        state = ckpt.state_dict()
    own = model.state_dict()
    for name, t in state.items():
        if t.shape != own[name].shape:
            raise HFConfigError(f"{path}: {name} has shape {tuple(t.shape)} in the weights but "
                                f"{tuple(own[name].shape)} from config.json")
    model.load_state_dict(state, strict=True)
    return model.to(dtype) if dtype is not None else model.to(next(iter(state.values())).dtype)


# ---------------------------------------------------------------------------- writing

def _architecture_of(model: nn.Module) -> Architecture:
    for arch in SUPPORTED.values():
        if type(model) is arch.stage:
            if arch.moe_from_hf is not None:  # a whole model by construction
                return arch
            if (model.first, model.last) != (0, model.cfg.n_units - 1):
                raise ValueError(f"export_hf: the model holds units {model.first}..{model.last} "
                                 f"of 0..{model.cfg.n_units - 1}; export the whole model "
                                 f"(consolidate a pipeline's stages first)")
            return arch
    raise TypeError(f"export_hf: {type(model).__name__} has no Hugging Face equivalent; "
                    f"supported: {', '.join(a.stage.__name__ for a in SUPPORTED.values())}")


def export_hf(model: nn.Module, path: str | os.PathLike, *,
              source: str | os.PathLike | None = None) -> None:
    """Write ``model`` (a whole LlamaStage, GPTStage or Mixtral) as a Hugging Face
    directory. ``source``: the directory it was imported from, whose other config fields,
    generation config and tokenizer files are carried over."""
    _architecture_of(model)
    export_state_dict(model.cfg, model.state_dict(), path, source=source,
                      moe=getattr(model, "moe_cfg", None))


def export_state_dict(cfg: GPTConfig | LlamaConfig | MixtralConfig,
                      state: dict[str, torch.Tensor], path: str | os.PathLike, *,
                      source: str | os.PathLike | None = None,
                      moe: MoEConfig | None = None) -> None:
    """:func:`export_hf` for the whole model's state_dict (a consolidated checkpoint's)
    and its config, without building the model; a MixtralConfig needs its MoEConfig
    (``moe``, a TED manifest's "moe")."""
    from safetensors.torch import save_file

    arch = next((a for a in SUPPORTED.values() if a.config_type is type(cfg)), None)
    if arch is None:
        names = ", ".join(a.config_type.__name__ for a in SUPPORTED.values())
        raise TypeError(f"export_hf: a {type(cfg).__name__} has no Hugging Face equivalent; "
                        f"supported: {names}")
    maps = arch.tensors(cfg, moe)
    missing = sorted(m.name for m in maps if m.name not in state)
    if missing:
        raise KeyError(f"export_hf: the state_dict lacks {', '.join(missing[:5])}"
                       f"{' ...' if len(missing) > 5 else ''} of the whole model")
    tensors = {}
    for m in maps:
        if m.export:
            t = state[m.name].detach().cpu()
            tensors[m.hf_name] = (t.t() if m.transposed else t).contiguous()
    hf = arch.to_hf(cfg, moe) if arch.moe_from_hf is not None else arch.to_hf(cfg)
    if arch.name == "GPT2LMHeadModel":  # tie when the head is the embedding, bit for bit
        tied = torch.equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"])
        if tied:
            del tensors["lm_head.weight"]
        hf["tie_word_embeddings"] = tied
    base = {}
    if source is not None:
        with open(os.path.join(source, CONFIG)) as f:
            base = json.load(f)
    dtype = next(iter(tensors.values())).dtype
    config = {**base, **hf, "architectures": [arch.name],
              "torch_dtype": str(dtype).removeprefix("torch.")}
    config.pop("dtype", None)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    gen_source = source and os.path.join(source, GENERATION_CONFIG)
    if gen_source and os.path.isfile(gen_source):
        shutil.copyfile(gen_source, os.path.join(path, GENERATION_CONFIG))
    else:
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if config.get(k) is not None}
        with open(os.path.join(path, GENERATION_CONFIG), "w") as f:
            json.dump({"_from_model_config": True, **gen}, f, indent=2, sort_keys=True)
    for name in TOKENIZER_FILES if source is not None else ():
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(path, name))
