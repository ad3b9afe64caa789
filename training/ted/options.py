"""The options of train_moe: the MoE layers, TED's layout and features, and the config
they compose with the shared sections (``MoETrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.options import Options, option
from ..core.run_options import DataOptions, ModelOptions, OptimizerOptions, RunOptions
from ..core.topology import Axis, GridError
from ..models.moe import MoEConfig, base_config
from .model import TEDLayout


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
            self.check_batch_split("G_data", [self.G_data])

    def check_model(self, model) -> None:
        """The layout's rules of the model (TEDLayout.check: experts over G_expert,
        heads and widths over G_tensor, a block with experts), and the router's: every
        microbatch holds whole router groups (to_groups)."""
        TEDLayout(self.G_tensor, self.G_expert, self.G_data or self.G_expert).check(
            model, self.moe_config())
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
        layout = self.layout(world_size)
        try:
            layout.check(world_size=world_size)
        except ValueError as e:
            raise GridError(str(e)) from None
        self.check_batch_split("G_data", [layout.g_data])


@dataclass
class MoETrainConfig(RunOptions, OptimizerOptions, TEDOptions, DataOptions, MoEOptions,
                     ModelOptions):
    """The options of ``python -m training.train_moe``."""

    model: str = option("moe-tiny", "base model shape (training/models/moe.py MOE_BASES or "
                        "training/models/gpt.py CONFIGS)")
    out_dir: str = option("runs/moe", "directory of the metrics and the loss plot")
    backends: str | None = option(None, "mcrdl backends to initialize and collective kinds "
                                  "pinned, e.g. mpi,gloo,a2a=gloo,allreduce=mpi (default: mpi "
                                  "or gloo; every kind 'auto')")

    def model_config(self):
        """The base model shape (training/models/moe.py base_config), ValueError naming
        --model."""
        try:
            return base_config(self.model, vocab_size=self.data_vocab_size(),
                               n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                               block_size=self.block_size)
        except ValueError as e:
            raise ValueError(self.model_error(e)) from None

    def describe_grid(self) -> str:
        g = f"G_data={self.G_data}" if self.G_data else "G_data=world/G_tensor"
        return f"G_tensor={self.G_tensor} x G_expert={self.G_expert}, {g}"
