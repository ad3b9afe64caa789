"""One rank's share of a TED MoE run (training/ted/model.py): groups, model, batches,
ZeRO-1 optimizer, one training step, memory accounting, and sharded checkpoints.

Checkpoints (training/core/checkpoint.py's format and atomic writes): every rank writes its
own file ``rank_00005.pt`` (its tensor-parallel slices, its experts, its optimizer
shards, and the layout of each parameter), world rank 0 the manifest, written last.
Resuming needs the same layout; training/ted/consolidate.py merges the files into the
serial MoEGPT's ``state_dict`` (training/models/moe.py), whatever the layout was.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import mcrdl

from ..core import checkpoint as ckpt
from ..core import runtime
from ..core.backends import Backends
from ..core.data import Batches, load_dataset
from ..core.dtypes import torch_dtype
from ..core.optim import applied_lr, storage_bytes
from ..core.timers import PhaseTimers
from ..models import families
from ..models.init_source import read_init
from ..models.mixtral import Mixtral, MixtralConfig
from ..models.moe import MoEGPT, moe_loss
from .consolidate import LAYERS, check_layers
from .model import TEDGPT, TEDGroups, count_parameters
from .zero import ParamSet, ZeroAdamW

ENGINE = "ted"


class MoETrainer:
    """A configured TED run on this rank (every rank builds it with the same config).
    `dataset` reuses a loaded corpus (runs in a loop: scanning the stdlib takes
    seconds); `early_stop` and `debug_checks` are passed to the model (tests)."""

    def __init__(self, cfg, *, dataset=None, early_stop: bool = True,
                 debug_checks: bool | None = None):
        self.cfg = cfg
        self.device = runtime.pick_device(cfg.device)
        self.backends = Backends.parse(cfg.backends)
        runtime.init_comm(self.backends.init, self.device, cfg.timeout, nccl_with_given=True)
        self.world_rank, self.world_size = mcrdl.get_rank(), mcrdl.get_size()
        self.dataset = dataset or load_dataset(cfg.data, cfg.vocab_size)
        self.model_cfg = cfg.model_config(vocab_size=self.dataset.vocab_size)
        self.moe_cfg = cfg.moe_config()
        self.layout = cfg.ted_layout(self.world_size)
        self.layout.check(self.model_cfg, self.moe_cfg, self.world_size)
        self.groups = TEDGroups(self.layout, self.backends)
        serial = Mixtral if isinstance(self.model_cfg, MixtralConfig) else MoEGPT
        state = None
        if cfg.init_from and not cfg.resume:  # the serial model: each rank its pieces
            state = read_init(cfg.init_from, lambda: serial(self.model_cfg, self.moe_cfg))
        torch.manual_seed(cfg.seed)
        self.model = TEDGPT(self.model_cfg, self.moe_cfg, self.groups, seed=cfg.seed,
                            state_dict=state,
                            dtd=cfg.dtd, cac=cfg.cac,
                            activation_checkpointing=cfg.activation_checkpointing,
                            early_stop=early_stop,
                            debug_checks=cfg.debug_checks if debug_checks is None
                            else debug_checks)
        dtype = torch_dtype(cfg.dtype)
        if state is not None:
            state.close()
        # the file's weights (fp32 or as stored), which the model rounds to `dtype`: the
        # masters start from them
        fp32 = (None if state is None or dtype == torch.float32
                else [p.detach().float().clone() for p in self.model.parameters()])
        self.model.to(device=self.device, dtype=dtype)
        self.batches = Batches(self.dataset, self.model_cfg.block_size, cfg.global_batch_size,
                               cfg.micro_batch_size, self.groups.data_rank, self.layout.g_data,
                               seed=cfg.seed, goldfish=cfg.goldfish())
        self.timers = PhaseTimers()
        g = self.groups
        self.optimizer = ZeroAdamW(
            [ParamSet("nonexpert", self.model.nonexpert_parameters(), g.data_nonexp, "avg",
                      1.0, self.layout.g_tensor),
             # expert gradients: SUM over the expert-data group, then the mean over the
             # G_data_nonexp batch shards (training/ted/zero.py)
             ParamSet("expert", self.model.expert_parameters(), g.data_exp, "sum",
                      1.0 / self.layout.g_data, self.layout.g_tensor, cfg.optimizer_tile)],
            cfg.optim(), g.world, self.timers)
        if fp32 is not None:
            self.optimizer.seed_masters(dict(zip(self.model.parameters(), fp32, strict=True)))
        self.step = 0
        #: the record of --layout auto (set by train_loop), kept in checkpoint manifests
        self.layout_choice: dict | None = None
        self.last = {}

    def describe(self) -> str:
        cfg, n = self.cfg, count_parameters(self.model)
        m = self.moe_cfg
        capacity = "dropless" if m.dropless else f"capacity {m.capacity()}"
        return (f"training {cfg.model if not cfg.init_from else cfg.init_from} "
                f"{'Mixtral' if m.gating == 'mixtral' else 'MoE GPT'} ({m.experts} experts, "
                f"top-{m.top_k}, {capacity} per {cfg.router_group_tokens}-token "
                f"group, {cfg.dtype}) on {self.world_size} ranks: {self.layout.describe()}; "
                f"{n['nonexpert'] + n['expert']:,} parameters on this rank ({n['expert']:,} "
                f"expert); DTD {'on' if cfg.dtd else 'off'}, CAC {'on' if cfg.cac else 'off'}"
                f", activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}"
                f"; collectives {self.backends.describe()}; data: {self.dataset.describe()}")

    def moe_units(self) -> list[int]:
        """The units (1..n_layer) with experts, in order (MoEStats.load's order)."""
        return [j + 1 for j in range(self.model_cfg.n_layer) if self.moe_cfg.is_moe(j)]

    def _kept_targets(self, targets: list[torch.Tensor]) -> float:
        """Collective: the targets that are not -100 in the global batch (every data
        shard's microbatches `targets`), at least 1; without a loss mask (Goldfish),
        every target, counted without communication."""
        if getattr(self.batches, "goldfish", None) is None:
            return float(self.cfg.global_batch_size * self.model_cfg.block_size)
        n = torch.tensor([float(sum(int((y != -100).sum()) for y in targets))],
                         dtype=torch.float64, device=self.device)
        self.groups.data_nonexp.all_reduce(n)
        return max(1.0, float(n))

    def train_step(self) -> tuple[float, bool]:
        """One step on every rank: (the global batch's mean LM loss over its targets
        that are not -100, True). The aux loss, the dropped fraction and the load of
        each MoE layer's experts are in ``self.last``."""
        micro = self.batches.microbatches(self.step)
        # the gradient is the mean over data shards (training/ted/zero.py), so each
        # shard's cross-entropy sum is divided by its share of the kept targets
        denominator = self._kept_targets([y for _, y in micro]) / self.layout.g_data
        acc = [0.0, 0.0, 0.0, 0.0]  # lm sum, aux, kept, assigned
        load = None
        for x, y in micro:
            x, y = x.to(self.device), y.to(self.device)
            with self.timers("compute"):
                logits, stats = self.model(x)
                _, lm = moe_loss(logits, y, stats, self.moe_cfg, denominator)
                (lm + self.moe_cfg.aux_loss_coef * stats.aux_loss / len(micro)).backward()
            for i, v in enumerate((lm.item() * denominator, stats.aux_loss.detach().item(),
                                   stats.kept, stats.assigned)):
                acc[i] += v
            here = torch.stack([torch.stack(pair) for pair in stats.load]).double()
            load = here if load is None else load + here
        # without clipping the norm is only reported: its sum of squares rides on the
        # all_reduce of the step's sums below
        defer = not self.optimizer.cfg.grad_clip > 0
        self.optimizer.step(defer_norm=defer)
        self.step += 1
        # one all_reduce of the sums, the load and (deferred) the squared norm, on the
        # model's device: the world's all_reduce may be pinned to a GPU backend
        acc.append(self.optimizer.local_sumsq if defer else 0.0)
        packed = torch.cat([torch.tensor(acc, dtype=torch.float64, device=load.device),
                            load.reshape(-1)]).to(self.device)
        with self.timers("collective"):
            self.groups.world.all_reduce(packed)
        sums, load = packed[:len(acc)], packed[len(acc):].view(load.shape)
        if defer:
            self.optimizer.set_norm(float(sums[4]))
        g_t = self.layout.g_tensor  # every tensor rank holds the same copy
        n = self.world_size * len(micro)
        self.last = {"lm": float(sums[0]) / g_t / (denominator * self.layout.g_data),
                     "aux": float(sums[1]) / n,
                     "dropped": 1.0 - float(sums[2]) / float(sums[3]) if sums[3] else 0.0,
                     "load": self.load_record(load.cpu() / g_t)}
        return self.last["lm"], True

    def load_record(self, load: torch.Tensor) -> list[dict]:
        """Per MoE layer: the token-expert assignments routed to each expert in the step,
        those dropped, and the largest expert load over the mean (1.0: balanced)."""
        out = []
        for unit, (tokens, kept) in zip(self.moe_units(), load, strict=True):
            mean = float(tokens.mean())
            out.append({"unit": unit, "tokens": [int(t) for t in tokens],
                        "dropped": [int(t) for t in tokens - kept],
                        "max_mean": float(tokens.max()) / mean if mean else 0.0})
        return out

    def eval_loss(self, step: int) -> float:
        """Collective: the mean LM loss of the global batch of `step`, no gradients."""
        micro = self.batches.microbatches(step)
        return self._mean_loss([x for x, _ in micro], [y for _, y in micro])

    def _mean_loss(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
        """Collective: the mean cross-entropy over the targets that are not -100 of every
        data shard's microbatches (`inputs`, `targets`), forward only."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for x, y in zip(inputs, targets, strict=True):
                logits, stats = self.model(x.to(self.device))
                _, lm = moe_loss(logits, y.to(self.device), stats, self.moe_cfg, 1.0)
                sums[0] += lm.double()
                sums[1] += float((y != -100).sum())
        self.groups.world.all_reduce(sums)  # each tensor rank counts the same: the ratio
        return float(sums[0] / sums[1]) if sums[1] else float("nan")

    def evaluate(self, windows: torch.LongTensor) -> float:
        """Collective over the world: the mean cross-entropy of `windows` ([W, T+1], the
        same on every rank: inputs [:, :T], targets [:, 1:]) over the targets that are
        not -100. Microbatch i holds windows i*b..(i+1)*b-1 (b = --micro-batch-size) and
        data shard d takes microbatches d, d + G_data, ..., so routing (per router group,
        inside a microbatch) does not depend on the layout; the last microbatches are
        padded with ignored windows. No gradient, no state change."""
        windows = torch.as_tensor(windows, dtype=torch.long)
        if windows.dim() != 2 or windows.shape[1] < 2:
            raise ValueError(f"evaluate: windows of shape {tuple(windows.shape)}; expected "
                             "[W, T+1] token ids")
        b, shards = self.cfg.micro_batch_size, self.layout.g_data
        inputs, targets = windows[:, :-1], windows[:, 1:]
        per = b * shards
        pad = -len(windows) % per
        if pad:
            inputs = torch.cat([inputs, inputs.new_zeros(pad, inputs.shape[1])])
            targets = torch.cat([targets, targets.new_full((pad, targets.shape[1]), -100)])
        mine = range(self.groups.data_rank, len(inputs) // b, shards)
        return self._mean_loss([inputs[i * b:(i + 1) * b] for i in mine],
                               [targets[i * b:(i + 1) * b] for i in mine])

    def metrics_record(self, loss: float, step_time: float, tokens: int,
                       applied: bool) -> dict:
        return {"step": self.step, "loss": loss, "aux_loss": self.last["aux"],
                "dropped_fraction": self.last["dropped"],
                "lr": applied_lr(self.optimizer),
                "grad_norm": self.optimizer.last_grad_norm, "time_s": step_time,
                "tokens_per_s": tokens / step_time, "moe_load": self.last["load"]}

    # --- memory ------------------------------------------------------------------------
    def measured_bytes(self) -> dict[str, int]:
        """Storage of this rank's parameters, gradients (after a backward, before the
        step) and optimizer states, counted tensor by tensor."""
        params = list(self.model.parameters())
        return {"params": storage_bytes(params),
                "grads": storage_bytes(p.grad for p in params if p.grad is not None),
                "optimizer": sum(self.optimizer.state_bytes().values())}

    # --- checkpoints -------------------------------------------------------------------
    def _rank_state(self) -> dict:
        layout = {n: {"split": dataclasses.asdict(p.split), "expert": getattr(p, "expert", False)}
                  for n, p in self.model.named_parameters()}
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "layout": layout, "tensor_rank": self.groups.tensor_rank,
                "optimizer": self.optimizer.state_dict(), "step": self.step,
                "rank": self.world_rank}

    def save_checkpoint(self) -> Path:
        """Collective: every rank writes its file, world rank 0 the manifest (last)."""
        def write_shard(directory: Path) -> dict:
            name = f"rank_{self.world_rank:05d}.pt"
            nbytes, sha = ckpt.atomic_save(self._rank_state(), directory / name)
            # "stage" keys the file for checkpoint.load_shard: here the world rank
            return {"stage": self.world_rank, "file": name, "bytes": nbytes, "sha256": sha}

        return runtime.save_checkpoint(
            self.cfg.checkpoint_dir, self.step, write_shard=write_shard,
            manifest=lambda entries: {
                "format": ckpt.FORMAT, "engine": ENGINE, "layers": LAYERS, "step": self.step,
                "grid": {"G_tensor": self.layout.g_tensor, "G_expert": self.layout.g_expert,
                         "G_data": self.layout.g_data},
                "model": families.describe(self.model_cfg), "moe": self.moe_cfg.as_dict(),
                "optimizer": "ZeroAdamW", "train_config": dataclasses.asdict(self.cfg),
                "shards": entries,
                **({"layout_choice": self.layout_choice} if self.layout_choice else {})})

    def load_checkpoint(self, spec: str) -> int:
        """Collective: load `spec` ("latest" or a path) on every rank; returns its step.
        A missing, damaged or mismatched checkpoint raises CheckpointError everywhere."""
        want = {"grid": {"G_tensor": self.layout.g_tensor, "G_expert": self.layout.g_expert,
                         "G_data": self.layout.g_data},
                "model": families.describe(self.model_cfg), "moe": self.moe_cfg.as_dict()}

        def check(manifest: dict, path: Path) -> None:
            check_layers(manifest, path)
            ckpt.check_matches(path, {k: manifest.get(k) for k in want}, want,
                               "resume with the same model, MoE options and layout")

        _, state = runtime.load_for_resume(spec, self.cfg.checkpoint_dir, engine=ENGINE,
                                   dtype=self.cfg.dtype, shard=self.world_rank, check=check,
                                   trust=self.cfg.trust_checkpoint)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        return self.step
