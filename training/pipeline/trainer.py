"""One rank's share of a pipeline x data parallel run of any model family
(training/models/families.py: ``--arch``): the process grid, this stage's part of the
model, its batches, optimizer and pipeline engine, one training step, a forward-only
evaluation, and sharded checkpoints saved and loaded collectively."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import mcrdl
from mcrdl.launch import detect as detect_launch
from mcrdl.launch import node_cores_for_ranks, oversubscribed

from ..core import checkpoint as ckpt
from ..core import runtime
from ..core.data import Batches, load_dataset
from ..core.dtypes import torch_dtype
from ..core.optim import DataParallelAdamW, OffloadedAdamW, applied_lr
from ..core.options import Options
from ..core.run_options import HF_PREFIX
from ..core.timers import PhaseTimers
from ..core.topology import Axis, ProcessGrid
from ..models.families import describe, family_of, model_shape
from ..models.init_source import read_init
from ..samo.optimizer import SamoAdamW
from ..samo.pruning import DenseMasking, Pruning, check_shard
from .engine import PipelineEngine, partition


def comm_backends(cfg: Options, device: torch.device) -> list[str]:
    """The backends a train_gpt run initializes: --backends; else, on one CPU node whose
    ranks outnumber its cores (mcrdl.launch.oversubscribed) where the pipeline sends
    messages (G_inter > 1) and no --p2p-backend is given, mpi for the collectives and
    gloo for the pipeline's messages when both exist; else runtime.init_comm's default
    (mpi alone). Gloo's waits block in the kernel, while the mpi backend's lane polls as
    long as a receive is posted, and stage 0 keeps one posted from its first forward to
    its last backward: with ranks sharing cores, that polling takes the CPU of the rank
    computing (mini GPT, G_inter=4 on 2 cores: 202 ms a step with gloo's messages, 241
    with mpi's); with a core per rank it costs nothing and mpi's messages are the
    faster (G_inter=2 on 2 cores: 88 ms against 94-96). The rule reads this node's
    launch and CPUs before any communication, so it applies to a one-node launch only:
    on several nodes each could answer otherwise, and every rank must initialize the
    same backends. A layout still to choose (--layout
    auto) gets the default: a data-parallel trial inside a job with gloo initialized
    measured 126-138 ms a step against 93-96 ms with mpi alone (4 ranks, mini GPT)."""
    if cfg.backends:
        return cfg.backends.split(",")
    usable = mcrdl.available_backends()
    messages = getattr(cfg, "G_inter", 1) > 1 and getattr(cfg, "layout", "manual") != "auto"
    launch = detect_launch()
    if device.type != "cuda" and messages and not cfg.p2p_backend \
            and "mpi" in usable and "gloo" in usable and launch.local_size == launch.size \
            and oversubscribed(launch.local_size, node_cores_for_ranks()):
        return ["mpi", "gloo"]
    return []


def p2p_backend(cfg: Options, device: torch.device) -> str:
    """Initialize mcrdl (unless the caller did; ``comm_backends``) and return the
    pipeline's p2p backend: --p2p-backend, else nccl on a GPU, else gloo on a CPU when
    mpi runs beside it (the collectives stay on "auto", which routes them to mpi
    without a tuning table), else mpi, else gloo."""
    runtime.init_comm(comm_backends(cfg, device), device, cfg.timeout)
    if cfg.p2p_backend:
        return cfg.p2p_backend
    have = mcrdl.get_backends()
    if device.type == "cuda" and "nccl" in have:
        return "nccl"
    if device.type != "cuda" and "gloo" in have and "mpi" in have:
        return "gloo"
    return "mpi" if "mpi" in have else "gloo"


def tied_names(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """The names of `state` (a module's state_dict) whose tensor is an earlier name's
    (a tied LM head: the embedding), mapped to that name: SAMO's compressed shards store
    each parameter once, and the shard's reader puts the other names back."""
    first: dict[int, str] = {}
    out = {}
    for name, t in state.items():
        key = t.data_ptr()
        if key in first and t.numel():
            out[name] = first[key]
        else:
            first.setdefault(key, name)
    return out


def check_tied(model_cfg, stages: list[tuple[int, int]]) -> None:
    """ValueError unless the embedding (unit 0) and the LM head (the last unit) of a
    model that ties them (``tie_embeddings``) are on one stage: they are one matrix."""
    head = model_cfg.n_units - 1
    if getattr(model_cfg, "tie_embeddings", False) and not any(
            first == 0 and last == head for first, last in stages):
        raise ValueError(f"--G-inter {len(stages)}: the model ties its LM head to its "
                         "embedding (tie_embeddings, Hugging Face's tie_word_embeddings), so "
                         "the two must sit on one stage, but a pipeline puts the embedding on "
                         "its first stage and the head on its last; use --G-inter 1 (scale "
                         "with --G-data) or the 4D engine (--G-x/--G-y/--G-z)")


class Trainer:
    """One configured training run on this rank (stage of the model, data, optimizer,
    pipeline engine). Every rank of the world builds it with the same config, or, given
    a `grid` spanning a group of ranks (``ProcessGrid(..., world=group)``, its groups
    made on every rank of the world), every rank of that group: then the run's
    "world" (rank 0's output, checkpoints, losses summed) is that group, and other runs
    may train on other ranks at the same time. `compute_delay` (seconds per forward or
    backward, by stage index) and `record` (keep the pipeline's events) are for tests.
    `cfg` is train_gpt's TrainConfig (the sections of the shared, pipeline and SAMO
    options; this engine sits below the command that composes them)."""

    def __init__(self, cfg: Options, *, grid: ProcessGrid | None = None,
                 compute_delay: dict[int, float] | None = None, record: bool = False):
        self.cfg = cfg
        self.device = runtime.pick_device(cfg.device)
        self.p2p_backend = p2p_backend(cfg, self.device)
        if grid is None:
            cfg.check_world(mcrdl.get_size())  # in the options' words, before the grid's
            grid = ProcessGrid(cfg.degrees(), order=cfg.axis_order())
        elif grid.sizes != cfg.degrees() or not grid.is_member:
            raise ValueError(f"Trainer: the grid {grid} is not this process's grid "
                             f"{cfg.describe_grid()}")
        self.grid, self.world_group = grid, grid.world
        self.world_rank, self.world_size = grid.rank, grid.world_size
        self.pipe_group, self.data_group = self.grid.group(Axis.PIPE), self.grid.group(Axis.DATA)
        self.stage_index, self.n_stages = self.grid.coord(Axis.PIPE), self.grid.size(Axis.PIPE)
        self.data_rank, self.n_replicas = self.grid.coord(Axis.DATA), self.grid.size(Axis.DATA)
        torch.manual_seed(cfg.seed)
        self.dataset = load_dataset(cfg.data, cfg.vocab_size)
        self.model_cfg = model_shape(cfg, self.dataset.vocab_size)
        self.family = family_of(self.model_cfg)
        if self.family.stage is None:
            raise ValueError(f"the pipeline engine builds no {self.family.name} model; "
                             f"train it with python -m training.train_moe")
        self.partition = partition(self.model_cfg.n_layer, self.n_stages, cfg.blocks_per_stage())
        check_tied(self.model_cfg, self.partition)
        first_unit, last_unit = self.partition[self.stage_index]
        dtype = torch_dtype(cfg.dtype)
        fp32 = None  # --init-from's weights, before the cast to dtype
        self.model_stage = self.family.stage(
            self.model_cfg, first_unit, last_unit, seed=cfg.seed,
            activation_checkpointing=cfg.activation_checkpointing)
        if cfg.init_from and not cfg.resume:  # each stage reads its units' tensors only
            with read_init(cfg.init_from, lambda: self.family.stage(
                    self.model_cfg, 0, self.model_cfg.n_units - 1), self.world_group) as source:
                source.load_into(self.model_stage)
            # the fp32 masters start from them, unrounded (a pruned run's are masked)
            if dtype != torch.float32 and cfg.prune_sparsity is None:
                fp32 = [p.detach().clone() for p in self.model_stage.parameters()]
        self.model_stage.to(device=self.device, dtype=dtype)
        self.batches = Batches(self.dataset, self.model_cfg.block_size, cfg.global_batch_size,
                               cfg.micro_batch_size, self.data_rank, self.n_replicas,
                               seed=cfg.seed, goldfish=cfg.goldfish())
        self.timers = PhaseTimers()
        comm = dict(data_group=self.data_group, pipe_group=self.pipe_group,
                    world_reduce=self.world_size > 1, world_group=self.world_group,
                    timers=self.timers)
        self.pruning = (Pruning.from_config(cfg, self.model_stage, self.pipe_group,
                                            self.data_group)
                        if cfg.prune_sparsity is not None else None)  # prunes before step 0
        if cfg.samo:  # compressed model states over the pruning's index (SAMO)
            self.optimizer = SamoAdamW(self.model_stage.named_parameters(), cfg.optim(),
                                       index=self.pruning.index,
                                       loss_scaling=dtype == torch.float16, **comm)
        elif cfg.offload_optimizer or dtype != torch.float32:  # low precision: fp32 masters
            self.optimizer = OffloadedAdamW(self.model_stage.parameters(), cfg.optim(),
                                            loss_scaling=dtype == torch.float16, **comm)
            if fp32 is not None:
                self.optimizer.seed_masters(fp32)
        else:
            self.optimizer = DataParallelAdamW(self.model_stage.parameters(), cfg.optim(),
                                               **comm)
        if self.pruning is not None:
            self.pruning.attach(self.optimizer if cfg.samo else DenseMasking(
                self.model_stage.named_parameters(), self.optimizer))
        stage_delay = (compute_delay or {}).get(self.stage_index, 0.0)
        self.engine = PipelineEngine(self.model_stage, stage_index=self.stage_index,
                                     n_stages=self.n_stages, group=self.pipe_group,
                                     p2p_backend=self.p2p_backend,
                                     micro_batch=cfg.micro_batch_size,
                                     pipeline_limit=cfg.pipeline_limit, timers=self.timers,
                                     timeout=cfg.timeout, compute_delay=stage_delay,
                                     record=record,
                                     backward_group=self.grid.twin_group(Axis.PIPE))
        self.step = 0  # steps completed
        #: the record of --layout auto (set by train_loop), kept in checkpoint manifests
        self.layout_choice: dict | None = None

    def describe(self) -> str:
        """The run's start line: model, grid, partition, batches, backend, data."""
        cfg = self.cfg
        name = (cfg.init_from if cfg.init_from and cfg.init_from.startswith(HF_PREFIX)
                else cfg.model if self.family.name == "gpt"
                else f"{self.family.name} {cfg.model}")
        return (f"training {name} ({self.model_cfg.n_params() / 1e6:.2f} M params, "
                f"{cfg.dtype}) on {self.world_size} ranks: {cfg.describe_grid()}, stages "
                f"{self.partition}, {self.batches.n_micro} microbatches of "
                f"{cfg.micro_batch_size} per step, p2p '{self.p2p_backend}', data: "
                f"{self.dataset.describe()}"
                + (f"; {self.pruning.describe()}{', SAMO' if cfg.samo else ''}"
                   if self.pruning else ""))

    def _sum_over_world(self, value: float) -> float:
        total = torch.tensor([value], dtype=torch.float64)
        if self.world_size > 1:
            mcrdl.all_reduce("auto", total, op=mcrdl.ReduceOp.SUM, group=self.world_group)
        return float(total)

    def train_step(self) -> tuple[float, bool]:
        """One step on every rank: (the global batch's mean loss, whether the optimizer
        applied the update; False when fp16 loss scaling skipped it)."""
        if self.pruning is not None:
            self.pruning.prune_if_due(self.step)
        self.engine.loss_scale = self.optimizer.scaler.scale
        microbatches = self.batches.microbatches(self.step)
        # every gradient of the stage accumulates once per microbatch: the optimizer
        # posts each bucket's all-reduce from the backward once the last one has
        self.optimizer.begin_step(len(microbatches))
        local_loss = self.engine.run(microbatches)
        applied = self.optimizer.step()
        self.step += 1
        on_last_stage = self.stage_index == self.n_stages - 1
        loss_sum = self._sum_over_world(local_loss if on_last_stage else 0.0)
        return loss_sum / self.n_replicas, applied

    def metrics_record(self, loss: float, step_time: float, tokens: int,
                       applied: bool) -> dict:
        """The metrics file's record of the step just taken (`step_time` in seconds,
        `tokens` per step)."""
        record = {"step": self.step, "loss": loss, "lr": applied_lr(self.optimizer),
                  "grad_norm": self.optimizer.last_grad_norm, "time_s": step_time,
                  "tokens_per_s": tokens / step_time}
        if self.optimizer.scaler.enabled:
            record.update(loss_scale=self.optimizer.scaler.scale, applied=applied)
        return record

    # --- evaluation -----------------------------------------------------------------------
    def evaluate(self, windows: torch.Tensor) -> float:
        """Collective over the run's world: the mean cross-entropy of the model on
        `windows` ([W, T+1] token ids, the same on every rank; inputs ``[:, :T]``,
        targets ``[:, 1:]``, targets of -100 left out), forward only: no gradient, no
        change of state. The data-parallel replicas take every n-th microbatch of
        ``--micro-batch-size`` windows (the last padded with ignored targets); each
        microbatch runs through the stages in order, the last stage summing the loss
        and counting the targets; the sums are all-reduced in float64."""
        windows = torch.as_tensor(windows)
        if windows.dim() != 2 or windows.size(1) < 2:
            raise ValueError(f"evaluate: windows of shape {tuple(windows.shape)}; expected "
                             "[W, T+1] token ids with T >= 1")
        T = windows.size(1) - 1
        if T > self.model_cfg.block_size:
            raise ValueError(f"evaluate: windows of {T} targets exceed the model's context "
                             f"(block_size {self.model_cfg.block_size})")
        inputs, targets = windows[:, :T].long(), windows[:, 1:].long()
        mb, shards = self.cfg.micro_batch_size, self.n_replicas
        n_micro = -(-windows.size(0) // (mb * shards)) * shards  # whole rounds of replicas
        pad = n_micro * mb - windows.size(0)
        if pad:
            inputs = torch.cat([inputs, inputs.new_zeros(pad, T)])
            targets = torch.cat([targets, targets.new_full((pad, T), -100)])
        first, last = self.stage_index == 0, self.stage_index == self.n_stages - 1
        dtype = next(self.model_stage.parameters()).dtype
        loss_sum = torch.zeros((), dtype=torch.float64)
        count = torch.zeros((), dtype=torch.float64)
        was_training = self.model_stage.training
        self.model_stage.eval()
        try:
            with torch.no_grad():
                for m in range(self.data_rank, n_micro, shards):
                    rows = slice(m * mb, (m + 1) * mb)
                    if first:
                        x = inputs[rows].to(self.device)
                    else:
                        x = torch.empty((mb, T, self.model_cfg.n_embd), dtype=dtype,
                                        device=self.device)
                        mcrdl.recv(self.p2p_backend, x, src=self.stage_index - 1, tag=0,
                                   group=self.pipe_group)
                    out = self.model_stage(x)
                    if not last:
                        mcrdl.send(self.p2p_backend, out.contiguous(),
                                   dst=self.stage_index + 1, tag=0, group=self.pipe_group)
                        continue
                    t = targets[rows].to(self.device)
                    loss_sum += torch.nn.functional.cross_entropy(
                        out.float().reshape(-1, out.size(-1)), t.reshape(-1),
                        ignore_index=-100, reduction="sum").double().cpu()
                    count += (t != -100).sum().double().cpu()
        finally:
            self.model_stage.train(was_training)
        totals = torch.stack([loss_sum, count])
        if self.world_size > 1:
            mcrdl.all_reduce("auto", totals, op=mcrdl.ReduceOp.SUM, group=self.world_group)
        if totals[1] == 0:
            raise ValueError("evaluate: every target of the windows is ignored (-100)")
        return float(totals[0] / totals[1])

    # --- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Collective: the first data-parallel replica of each stage writes its shard,
        world rank 0 the manifest; returns the step directory once the manifest is on
        disk. A failed write raises CheckpointError on every rank."""
        def write_shard(directory: Path) -> dict | None:
            if self.data_rank != 0:
                return None
            own = self.model_stage.state_dict()
            state = {"model": {k: v.detach().clone() for k, v in own.items()},
                     "aliases": tied_names(own),
                     "optimizer": self.optimizer.state_dict(), "stage": self.stage_index,
                     "units": self.partition[self.stage_index], "step": self.step}
            if self.pruning is not None:
                self.pruning.add_to_shard(state)
            return ckpt.save_shard(directory, self.stage_index, state)

        return runtime.save_checkpoint(
            self.cfg.checkpoint_dir, self.step, write_shard=write_shard,
            manifest=lambda shards: ckpt.build_manifest(
                step=self.step, grid=self.cfg.degree_options(), partition=self.partition,
                model=describe(self.model_cfg), optimizer=type(self.optimizer).__name__,
                train_config=dataclasses.asdict(self.cfg), shards=shards,
                layout_choice=self.layout_choice),
            group=self.world_group)

    def load_checkpoint(self, spec: str) -> int:
        """Collective: load `spec` ("latest" or a path) on every rank and return its step;
        a missing, damaged or mismatched checkpoint raises CheckpointError on every rank
        before any state changes."""
        manifest, shard = runtime.load_for_resume(
            spec, self.cfg.checkpoint_dir, engine="pipeline", dtype=self.cfg.dtype,
            shard=self.stage_index, group=self.world_group, trust=self.cfg.trust_checkpoint,
            check=lambda manifest, path: ckpt.check_resumable(
                manifest, path, n_stages=self.n_stages, partition=self.partition,
                model=describe(self.model_cfg), optimizer=type(self.optimizer).__name__),
            check_shard=lambda shard, manifest, path: check_shard(
                shard, self.pruning, path, manifest["step"]))
        self.model_stage.load_state_dict(ckpt.shard_model(shard))
        if self.pruning is not None:
            self.pruning.load_shard(shard, manifest["step"])
        self.optimizer.load_state_dict(shard["optimizer"])
        self.step = manifest["step"]
        return self.step
