"""One rank's share of a 4D (X x Y x Z x data) GPT run: the grid and its groups, this
rank's pieces of the model, its batches, the optimizer, one training step.

Ranks: ``r = x + G_x*(y + G_y*(z + G_z*d))`` by default (--grid-order). Samples (whole
sequences) are sharded over G_z * G_data: rank (x, y, z, d) trains on shard ``d*G_z + z``
of the global batch (``Batches`` with dp_rank ``d*G_z + z`` of ``G_z*G_data``), so the X
and Y ranks of one (z, d) see the same samples.

A step: for each micro-batch, forward, cross-entropy, backward of ``loss / (G_z *
G_data * micro-batches)``; then ``GPT4D.reduce_gradients`` (SUM over Z and data); then
one all_reduce over the world of two float32, the loss (counted by the ranks at x = y =
0) and the squared gradient norm (each piece counted once); then the optimizer of
training/core/optim.py clips with that norm and updates this rank's pieces.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict
from pathlib import Path

import torch

import mcrdl

from ..core import checkpoint as ckpt
from ..core import runtime
from ..core.data import Batches, load_dataset
from ..core.dtypes import torch_dtype
from ..core.optim import DataParallelAdamW, OffloadedAdamW, applied_lr
from ..core.options import Options
from ..core.timers import PhaseTimers
from ..core.topology import Axis, GridError, ProcessGrid
from ..models.families import describe, family_of, model_shape
from ..models.init_source import read_init
from ..tensor_parallel.comm import AxisComm, GatherSchedule, Overlap, Recorder, TensorComms
from .model import GPT4D, IGNORE_INDEX
from .options import FUSED_BUCKET_MIB
from .perf_model.step import Grid4D, TrainingStep, check_grid

GRID_AXES = (Axis.X, Axis.Y, Axis.Z, Axis.DATA)


def build_comms(grid: ProcessGrid, backends: dict[str, str], overlap: Overlap, *,
                keep_weights: bool = True, record: bool = False) -> TensorComms:
    """The TensorComms of this rank of `grid` (axes x, y, z, data; those not in the
    grid have degree 1)."""
    recorder = Recorder(record)
    axes = {}
    for axis in GRID_AXES:
        group = grid.group(axis) if axis in grid.sizes else None
        axes[axis.value] = AxisComm(axis.value, group, backends.get(axis.value, "auto"),
                                    recorder)
    return TensorComms(**axes, overlap=overlap, keep_weights=keep_weights, recorder=recorder,
                       gathers=GatherSchedule(prefetch=overlap.oag))


class _NoEvents:
    events: list = []


class Trainer4D:
    """One configured 4D run on this rank (every rank of the world builds it with the same
    config). Same interface as training.pipeline.trainer.Trainer for train_gpt.run. `record`
    keeps the issue/wait order of the collectives (``comms.recorder``); `kernels` is the
    matmul layout chooser (training.parallel4d.tuning). `cfg` is train_gpt's TrainConfig
    (this engine sits below the command that composes the options)."""

    stage_index, n_stages = 0, 1

    def __init__(self, cfg: Options, *, record: bool = False, kernels=None,
                 grid: ProcessGrid | None = None):
        """`grid`: run on it, e.g. a grid spanning a group of ranks
        (``ProcessGrid(..., world=group)``, its groups made on every rank of the world),
        so that other runs train on other ranks at the same time; the run's "world"
        (its step scalars, checkpoints, rank 0's output) is then that group. By default
        a grid over the whole world from `cfg`."""
        self.cfg = cfg
        self.device = runtime.pick_device(cfg.device)
        runtime.init_comm(cfg.backends.split(",") if cfg.backends else [], self.device, cfg.timeout)
        backends = cfg.backend_of_axis()
        extra = sorted({b for b in backends.values() if b != "auto"} - set(mcrdl.get_backends()))
        if extra:  # e.g. --axis-backends z=pccl: add the backend (collective)
            mcrdl.init(extra)
        world = getattr(grid, "world", None)
        self.world = self.world_group = world  # the run's ranks (None: the whole world)
        self.world_rank = mcrdl.get_rank() if world is None else world.rank
        self.world_size = mcrdl.get_size() if world is None else world.size
        torch.manual_seed(cfg.seed)
        self.dataset = load_dataset(cfg.data, cfg.vocab_size)
        # --arch's family; with --init-from hf:DIR the directory's config.json
        self.model_cfg = model_shape(cfg, self.dataset.vocab_size)
        g = Grid4D(cfg.G_x, cfg.G_y, cfg.G_z, cfg.G_data)
        check_grid(TrainingStep(self.model_cfg, cfg.global_batch_size), g, self.world_size)
        sizes = {Axis.X: g.x, Axis.Y: g.y, Axis.Z: g.z, Axis.DATA: g.data}
        if grid is None:
            order = [a for a in cfg.axis_order() if a in sizes]
            grid = ProcessGrid(sizes, order=order)
        else:  # the config's degrees are what is checked, checkpointed and consolidated
            given = {a: grid.sizes.get(a, 1) for a in sizes}
            if given != sizes or set(grid.sizes) - set(sizes):
                shown = ", ".join(f"{a}={n}" for a, n in grid.sizes.items())
                raise GridError(
                    f"the grid given ({shown}) differs from the config's G_x={g.x}, G_y={g.y}, "
                    f"G_z={g.z}, G_data={g.data}; pass a grid of the config's degrees (axes x, "
                    "y, z, data) or set --G-x/--G-y/--G-z/--G-data to the grid's")
        self.grid = grid
        overlap = Overlap.from_level(cfg.overlap)
        self.comms = build_comms(self.grid, backends, overlap,
                                 keep_weights=not cfg.regather_weights, record=record)
        if kernels is None and cfg.tune_matmul:
            from .tuning import MatmulTuner
            kernels = MatmulTuner(group=world)
        self.comms.kernels = kernels
        dtype = torch_dtype(cfg.dtype)
        if dtype == torch.float16:
            raise GridError("--dtype fp16 is not supported by the 4D engine (no loss "
                            "scaling yet); use bf16 or fp32")
        source = None
        if cfg.init_from and not cfg.resume:  # .pt or hf:DIR: each rank reads its pieces
            mc = self.model_cfg
            source = read_init(cfg.init_from,
                               lambda: family_of(mc).stage(mc, 0, mc.n_units - 1), world)
        try:
            self.model = GPT4D(self.model_cfg, self.comms, seed=cfg.seed, source=source)
        finally:
            if source is not None:
                source.close()
        fp32 = (None if source is None or dtype == torch.float32  # the masters start from it
                else [p.detach().clone() for p in self.model.parameters()])
        self.model.to(device=self.device, dtype=dtype)
        c = self.comms
        self.shard, self.n_shards = c.data.rank * c.z.size + c.z.rank, c.z.size * c.data.size
        self.batches = Batches(self.dataset, self.model_cfg.block_size, cfg.global_batch_size,
                               cfg.micro_batch_size, self.shard, self.n_shards, seed=cfg.seed,
                               goldfish=cfg.goldfish())
        self.timers = PhaseTimers()
        comm = dict(data_group=None, pipe_group=None, world_reduce=self.world_size > 1,
                    timers=self.timers)
        if cfg.offload_optimizer or dtype != torch.float32:
            self.optimizer = OffloadedAdamW(self.model.parameters(), cfg.optim(), **comm)
            if fp32 is not None:
                self.optimizer.seed_masters(fp32)
        else:
            self.optimizer = DataParallelAdamW(self.model.parameters(), cfg.optim(), **comm)
        self.engine = _NoEvents()
        #: elements per fused gradient all_reduce (--bucket-mib)
        element_bytes = torch.finfo(dtype).bits // 8
        mib = FUSED_BUCKET_MIB if cfg.bucket_mib is None else cfg.bucket_mib
        self.bucket_elements = max(1, int(mib * 2**20) // element_bytes)
        self.step = 0
        #: the record of --layout auto (set by train_loop), kept in checkpoint manifests
        self.layout_choice: dict | None = None

    def describe(self) -> str:
        cfg, c = self.cfg, self.comms
        backends = ", ".join(f"{a}={c.axis(a).backend}" for a in ("x", "y", "z", "data")
                             if c.axis(a).size > 1) or "none"
        name = cfg.init_from if (cfg.init_from or "").startswith("hf:") else \
            f"{family_of(self.model_cfg).name} {cfg.model}"
        return (f"training {name} ({self.model_cfg.n_params() / 1e6:.2f} M params, "
                f"{cfg.dtype}) on {self.world_size} ranks with the 4D engine: "
                f"{cfg.describe_grid()}, {self.batches.n_micro} microbatches of "
                f"{cfg.micro_batch_size} per step per (z, data) shard, overlap {cfg.overlap}, "
                f"collectives {backends}, data: {self.dataset.describe()}")

    def train_step(self) -> tuple[float, bool]:
        """One step on every rank: (the global batch's mean loss, whether applied)."""
        c = self.comms
        micro = self.batches.microbatches(self.step)
        scale = 1.0 / (self.n_shards * len(micro))
        loss_sum = 0.0
        axes = [c.axis(a) for a in ("x", "y", "z", "data")]
        before = [a.exposed for a in axes]
        t0 = time.perf_counter()
        for x, y in micro:
            x, y = x.to(self.device), y.to(self.device)
            loss = self.model.loss(x, y)
            (loss * scale).backward()
            loss_sum += loss.item()
        self.model.reduce_gradients(self.bucket_elements)
        exposed = [a.exposed - b for a, b in zip(axes, before, strict=True)]
        self.timers.add("compute", time.perf_counter() - t0 - sum(exposed))
        for a, seconds in zip(axes, exposed, strict=True):
            if a.size > 1:
                self.timers.add(f"exposed {a.name}", seconds)
        counts_loss = c.x.rank == 0 and c.y.rank == 0
        with self.timers("optimizer"):
            sumsq = float(self.model.owned_grad_sumsq())
        scalars = torch.tensor([loss_sum * scale if counts_loss else 0.0, sumsq],
                               dtype=torch.float32)
        if self.world_size > 1:
            with self.timers("exposed world"):
                mcrdl.all_reduce("auto", scalars, op=mcrdl.ReduceOp.SUM, group=self.world)
        applied = self.optimizer.step(sumsq=float(scalars[1]))
        if getattr(c.kernels, "pending", False):  # the first step timed the matmul modes
            c.kernels.agree()
        self.step += 1
        return float(scalars[0]), applied

    def metrics_record(self, loss: float, step_time: float, tokens: int,
                       applied: bool) -> dict:
        return {"step": self.step, "loss": loss, "lr": applied_lr(self.optimizer),
                "grad_norm": self.optimizer.last_grad_norm, "time_s": step_time,
                "tokens_per_s": tokens / step_time}

    def evaluate(self, windows: torch.Tensor) -> float:
        """Collective over the run's ranks: the mean cross-entropy of the model on
        `windows` [W, T+1] (the same on every rank; inputs ``[:, :T]``, targets
        ``[:, 1:]``) over every target other than -100, the same float on every rank.
        The windows are spread over the G_z*G_data shards as training batches are: round
        k gives shard s rows ``k*S*mb + s*mb ..`` (+ --micro-batch-size), the last round
        padded with windows whose targets are all -100. Forward only, no state changes;
        the loss sums and target counts (float64, counted by the x = y = 0 ranks) are
        all_reduced over the run once."""
        c, mb = self.comms, self.cfg.micro_batch_size
        if windows.dim() != 2 or windows.shape[1] < 2:
            raise ValueError(f"evaluate: windows of shape {tuple(windows.shape)}; expected "
                             "[W, T+1] token ids with T >= 1")
        n, t = windows.shape[0], windows.shape[1] - 1
        if t > self.model_cfg.block_size:
            raise ValueError(f"evaluate: windows of {t} inputs exceed the model's block_size "
                             f"{self.model_cfg.block_size}")
        inputs, targets = windows[:, :t].long(), windows[:, 1:].long().clone()
        per_round = self.n_shards * mb
        rounds = max(1, -(-n // per_round))
        pad = rounds * per_round - n
        if pad:
            inputs = torch.cat([inputs, torch.zeros(pad, t, dtype=torch.long)])
            targets = torch.cat([targets, torch.full((pad, t), IGNORE_INDEX, dtype=torch.long)])
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for k in range(rounds):
                    lo = k * per_round + self.shard * mb
                    s, kept = self.model.loss_sum(inputs[lo:lo + mb].to(self.device),
                                                  targets[lo:lo + mb].to(self.device))
                    total += s.cpu()
                    count += kept
        finally:
            self.model.train(was_training)
        counts = c.x.rank == 0 and c.y.rank == 0
        sums = torch.tensor([float(total), float(count)] if counts else [0.0, 0.0],
                            dtype=torch.float64)
        if self.world_size > 1:
            mcrdl.all_reduce("auto", sums, op=mcrdl.ReduceOp.SUM, group=self.world)
        if sums[1] == 0:
            raise ValueError("evaluate: every target of the windows is -100 (ignored)")
        return float(sums[0] / sums[1])

    def serial_state_dict(self):
        """Collective: the serial state_dict on the run's rank 0."""
        from .model import serial_state_dict
        return serial_state_dict(self.model, self.world)

    # --- checkpoints ----------------------------------------------------------------------
    @property
    def tensor_rank(self) -> int:
        """This rank's place in its data replica: x + G_x*(y + G_y*z)."""
        c = self.comms
        return c.x.rank + c.x.size * (c.y.rank + c.y.size * c.z.rank)

    def save_checkpoint(self) -> Path:
        """Collective over the run's ranks: each rank of data replica 0 writes its shard
        (its pieces with their splits and coordinates, and its optimizer state), the
        run's rank 0 the manifest (with the 4D grid); returns the step directory."""
        c = self.comms

        def write_shard(directory: Path) -> dict | None:
            if c.data.rank != 0:
                return None
            state = {"model": self.model.local_pieces(), "coords": c.coords(),
                     "splits": {n: asdict(s) for n, s in self.model.splits().items()},
                     "optimizer": self.optimizer.state_dict(), "step": self.step}
            return ckpt.save_shard(directory, self.tensor_rank, state, prefix="tensor")

        return runtime.save_checkpoint(
            self.cfg.checkpoint_dir, self.step, write_shard=write_shard,
            manifest=lambda shards: ckpt.build_manifest(
                step=self.step, grid=self.cfg.degree_options(), partition=[],
                model=describe(self.model_cfg), optimizer=type(self.optimizer).__name__,
                train_config=dataclasses.asdict(self.cfg), shards=shards, engine="4d",
                layout_choice=self.layout_choice),
            group=self.world)

    def load_checkpoint(self, spec: str) -> int:
        """Collective: load `spec` ("latest" or a path) written on the same tensor grid
        (G_data may differ) and return its step; any problem raises CheckpointError on
        every rank before any state changes."""
        want = {"model": describe(self.model_cfg), "optimizer": type(self.optimizer).__name__,
                **{f"G_{a}": self.comms.axis(a).size for a in ("x", "y", "z")}}

        def check(manifest: dict, path: Path) -> None:
            have = {"model": manifest["model"], "optimizer": manifest["optimizer"],
                    **{k: manifest["grid"].get(k, 1) for k in ("G_x", "G_y", "G_z")}}
            ckpt.check_matches(path, have, want, "resume with the same model, "
                               "--G-x/--G-y/--G-z and --offload-optimizer (--G-data may "
                               "change)")

        manifest, shard = runtime.load_for_resume(spec, self.cfg.checkpoint_dir, engine="4d",
                                          dtype=self.cfg.dtype, shard=self.tensor_rank,
                                          check=check, group=self.world,
                                          trust=self.cfg.trust_checkpoint)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(shard["model"][name])
        self.optimizer.load_state_dict(shard["optimizer"])
        self.step = manifest["step"]
        return self.step
