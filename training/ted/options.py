"""The options of train_moe: the MoE layers, TED's layout and features, and the config
they compose with the shared sections (``MoETrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.options import Options, flag, option
from ..core.run_options import (
    HF_PREFIX,
    DataOptions,
    ModelOptions,
    OptimizerOptions,
    RunOptions,
)
from ..core.topology import Axis, GridError
from ..models import mixtral
from ..models.moe import MoEConfig, base_config
from .model import TEDLayout

# --arch: the GPT's MoE (training/models/moe.py) or Mixtral (training/models/mixtral.py)
ARCHS = ("gpt", "mixtral")
# the MoE options whose default depends on --arch (gpt, mixtral)
_ARCH_DEFAULTS = {"experts": (4, 8), "top_k": (1, 2), "moe_every": (2, 1)}


def hf_model(init_from: str):
    """(MixtralConfig, MoEConfig) of the Hugging Face directory `init_from` ("hf:DIR")
    names; ValueError naming --init-from when it is no MixtralForCausalLM."""
    from ..models.hf import HFCheckpoint

    directory = init_from.removeprefix(HF_PREFIX)
    try:
        with HFCheckpoint(directory) as ckpt:
            cfg, moe, name = ckpt.config, ckpt.moe, ckpt.architecture.name
    except (OSError, ValueError) as e:
        raise ValueError(f"--init-from {init_from}: {e}") from None
    if moe is None:
        raise ValueError(f"--init-from {init_from}: a {name} has no experts; train_moe "
                         "imports MixtralForCausalLM (train_gpt trains the dense ones)")
    return cfg, moe


@dataclass
class MoEOptions(Options):
    section = "moe"
    experts: int | None = option(None, "experts per MoE layer (default 4; --arch mixtral "
                                 "8; hf:DIR's)", minimum=1)
    top_k: int | None = option(None, "experts per token: 1 (Switch) or 2 (GShard); "
                               "--arch mixtral: any, default 2", minimum=1)
    capacity_factor: float | None = option(None, "expert capacity = ceil(factor x top_k x "
                                           "group tokens / experts), default 1.25; 0: "
                                           "dropless (no token dropped, the capacity agreed "
                                           "over the expert group per call), the default "
                                           "with --init-from hf:DIR (HF routes so)",
                                           minimum=0)
    moe_every: int | None = option(None, "every k-th block has an MoE FFN (default 2; "
                                   "--arch mixtral 1)", minimum=1)
    router_group_tokens: int = option(16, "tokens per router group (capacity, dropping and "
                                      "the aux loss are per group)", minimum=1)
    aux_loss_coef: float = option(0.01, "weight of the load-balancing loss", minimum=0)

    def moe_config(self) -> MoEConfig:
        """The run's MoEConfig: the options, their --arch defaults, and with --init-from
        hf:DIR the checkpoint's experts, top-k and blocks (given options must agree)."""
        arch = getattr(self, "arch", "gpt")
        values = {k: getattr(self, k) if getattr(self, k) is not None
                  else d[arch == "mixtral"] for k, d in _ARCH_DEFAULTS.items()}
        init = getattr(self, "init_from", None)
        imported = arch == "mixtral" and init and init.startswith(HF_PREFIX)
        capacity = self.capacity_factor
        if capacity is None:
            capacity = 0 if imported else 1.25
        if imported:
            _, hf = hf_model(init)
            for k in _ARCH_DEFAULTS:
                given, theirs = getattr(self, k), getattr(hf, k)
                if given is not None and given != theirs:
                    raise ValueError(f"{flag(k)} {given} disagrees with --init-from {init} "
                                     f"({k} {theirs}); drop {flag(k)} or give {theirs}")
                values[k] = theirs
        return MoEConfig(**values, capacity_factor=capacity,
                         router_group_tokens=self.router_group_tokens,
                         aux_loss_coef=self.aux_loss_coef,
                         gating="mixtral" if arch == "mixtral" else "gshard")

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

    def ted_layout(self, world_size: int) -> TEDLayout:
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
            self.check_batch_split("G_data", [self.G_data])

    def check_model(self, model) -> None:
        """The layout's rules of the model (TEDLayout.check: experts over G_expert,
        heads and widths over G_tensor, a block with experts), and the router's: every
        microbatch holds whole router groups (to_groups)."""
        layout = TEDLayout(self.G_tensor, self.G_expert, self.G_data or self.G_expert)
        try:
            layout.check(model, self.moe_config())
        except ValueError as e:
            init = getattr(self, "init_from", None)
            if init and init.startswith(HF_PREFIX):  # the shape is the checkpoint's
                raise ValueError(f"--init-from {init}: {e}") from None
            raise
        tokens = self.micro_batch_size * model.block_size
        if tokens % self.router_group_tokens:
            raise ValueError(f"--router-group-tokens {self.router_group_tokens} does not "
                             f"divide a microbatch's {tokens} tokens (--micro-batch-size "
                             f"{self.micro_batch_size} x block_size {model.block_size}): "
                             "capacity and dropping are per whole router group; choose a "
                             f"divisor of {tokens}")

    def check_world(self, world_size: int) -> None:
        """The layout's rules of the world (TEDLayout.check) and the batch's split over
        G_data_nonexp, whose default is world / G_tensor."""
        if self.G_data is None and world_size % self.G_tensor:
            raise GridError(f"--G-tensor {self.G_tensor} does not divide the world of "
                            f"{world_size} ranks (G_data defaults to world / G_tensor); "
                            f"launch a multiple of {self.G_tensor} ranks or change --G-tensor")
        layout = self.ted_layout(world_size)
        try:
            layout.check(world_size=world_size)
        except ValueError as e:
            raise GridError(str(e)) from None
        self.check_batch_split("G_data", [layout.g_data])


@dataclass
class MoETrainConfig(RunOptions, OptimizerOptions, TEDOptions, DataOptions, MoEOptions,
                     ModelOptions):
    """The options of ``python -m training.train_moe``."""

    arch: str = option("gpt", "model family: gpt (GPT-2 blocks, training/models/moe.py) or "
                       "mixtral (Llama blocks with SwiGLU experts and Mixtral's top-k "
                       "gating, training/models/mixtral.py)", choices=ARCHS)
    model: str = option("moe-tiny", "base model shape (training/models/moe.py MOE_BASES or "
                        "training/models/gpt.py CONFIGS; --arch mixtral: "
                        "training/models/mixtral.py CONFIGS)")
    out_dir: str = option("runs/moe", "directory of the metrics and the loss plot")
    backends: str | None = option(None, "mcrdl backends to initialize and collective kinds "
                                  "pinned, e.g. mpi,gloo,a2a=gloo,allreduce=mpi (default: mpi "
                                  "or gloo; every kind 'auto')")

    def model_config(self, vocab_size: int | None = None):
        """The base model shape (training/models/moe.py base_config; --arch mixtral:
        mixtral.get_config, or hf:DIR's shape), ValueError naming --model. `vocab_size`:
        the data's (default --data's)."""
        vocab = self.data_vocab_size() if vocab_size is None else vocab_size
        shape = {"n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd,
                 "block_size": self.block_size}
        if self.arch != "mixtral" and self.n_kv_head is not None:
            raise ValueError("--n-kv-head applies to --arch mixtral (grouped-query "
                             "attention); drop it or add --arch mixtral")
        if self.arch == "mixtral" and self.init_from and self.init_from.startswith(HF_PREFIX):
            cfg, _ = hf_model(self.init_from)
            if self.block_size is not None and self.block_size <= cfg.block_size:
                # rotary positions: the weights do not depend on the context length
                cfg = replace(cfg, block_size=self.block_size)
            for k, given in (*shape.items(), ("n_kv_head", self.n_kv_head)):
                if given is not None and given != getattr(cfg, k):
                    raise ValueError(f"{flag(k)} {given} disagrees with --init-from "
                                     f"{self.init_from} ({k} {getattr(cfg, k)}); drop "
                                     f"{flag(k)}")
            if vocab > cfg.vocab_size:
                raise ValueError(f"--data's vocabulary ({vocab} tokens) exceeds the model's "
                                 f"({cfg.vocab_size}) of --init-from {self.init_from}")
            return cfg
        try:
            if self.arch == "mixtral":
                return mixtral.get_config(self.model, vocab_size=vocab,
                                          n_kv_head=self.n_kv_head, **shape)
            return base_config(self.model, vocab_size=vocab, **shape)
        except (ValueError, TypeError) as e:
            raise ValueError(self.model_error(ValueError(str(e)))) from None

    def describe_grid(self) -> str:
        g = f"G_data={self.G_data}" if self.G_data else "G_data=world/G_tensor"
        return f"G_tensor={self.G_tensor} x G_expert={self.G_expert}, {g}"
