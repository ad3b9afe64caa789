"""Train a GPT with AxoNN's pipeline x data parallelism on mcrdl.

    mpiexec -n 4 python -m training.train_gpt --model tiny --steps 50 --G-inter 2 --G-data 2
    torchrun --nproc-per-node 4 -m training.train_gpt --G-inter 4
    srun -n 8 python -m training.train_gpt --config my_run.toml --steps 1000

Options come from the defaults below, then ``--config FILE`` (TOML or JSON, keys are
the option names with underscores), then the command line. Rank 0 shows a progress bar
(on a terminal) and one log line per ``--log-interval`` steps, writes ``--metrics``
(JSON lines: step, loss, lr, grad_norm, time_s, tokens_per_s), and at the end prints
the per-phase time breakdown per pipeline stage and saves the loss curve as a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import mcrdl

from . import checkpoint as ckpt
from .data import Batches, load_dataset
from .models.gpt import GPTStage, get_config
from .optim import DataParallelAdamW, OffloadedAdamW, OptimConfig
from .pipeline import PipelineEngine, partition
from .timers import PHASES, PhaseTimers
from .topology import ProcessGrid

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainConfig:
    model: str = "tiny"
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    block_size: int | None = None
    data: str = "stdlib"
    vocab_size: int | None = None
    steps: int = 20
    G_inter: int = 1
    G_data: int = 1
    grid_order: str = "pipe,data"
    layers_per_stage: str | None = None
    micro_batch_size: int = 2
    global_batch_size: int = 8
    pipeline_limit: int | None = None
    dtype: str = "fp32"
    device: str = "auto"
    seed: int = 1234
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 5
    decay_steps: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    offload_optimizer: bool = False
    bucket_mib: float = 4.0
    coarsening: int = 2
    activation_checkpointing: bool = False
    backends: str | None = None
    p2p_backend: str | None = None
    metrics: str | None = None
    out_dir: str = "runs/gpt"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    stop_after: int | None = None
    resume: str | None = None
    log_interval: int = 1
    plot: bool = True
    progress: bool = True
    quiet: bool = False              # no start line, step lines or breakdown (benchmarks)
    timeout: float | None = None

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        for name in ("steps", "G_inter", "G_data", "micro_batch_size", "global_batch_size",
                     "log_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{_flag(name)} is {v!r}; expected a positive integer")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"--stop-after {self.stop_after}: expected 1..--steps ({self.steps})")
        if (self.checkpoint_every or self.stop_after) and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every/--stop-after need --checkpoint-dir")
        if self.resume and not self.checkpoint_dir and self.resume == "latest":
            raise ValueError("--resume without a path needs --checkpoint-dir")

    def optim(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, min_lr=self.min_lr, warmup_steps=self.warmup_steps,
                           decay_steps=self.decay_steps or self.steps,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip,
                           bucket_mib=self.bucket_mib, coarsening=self.coarsening)


def _flag(name: str) -> str:
    return name.replace("_", "-")


@dataclass
class TrainResult:
    losses: list[tuple[int, float]] = field(default_factory=list)
    phases: dict = field(default_factory=dict)      # rank 0: per-stage mean seconds per phase
    bubble_measured: float = float("nan")
    bubble_model: float = float("nan")
    tokens_per_s: float = float("nan")
    start_step: int = 0
    grid: str = ""
    stage: int = 0
    events: list = field(default_factory=list)  # the last step's pipeline events (record=True)


def parse_args(argv=None) -> TrainConfig:
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    ap = argparse.ArgumentParser(prog="python -m training.train_gpt", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML or JSON file of options (underscored names)")
    defaults = TrainConfig()
    for name, f in fields.items():
        flag = "--" + _flag(name)
        default = getattr(defaults, name)
        if name == "resume":
            ap.add_argument(flag, nargs="?", const="latest", default=None,
                            help="resume from --checkpoint-dir's latest checkpoint, or a path")
        elif f.type in ("bool", bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                            help=f"(default {default})")
        else:
            typ = int if "int" in str(f.type) else float if "float" in str(f.type) else str
            ap.add_argument(flag, type=typ, default=None, help=f"(default {default})")
    args = ap.parse_args(argv)
    values = {}
    if args.config:
        values.update(_read_config(args.config, fields))
    for name in fields:
        v = getattr(args, name)
        if v is not None:
            values[name] = v
    cfg = TrainConfig(**values)
    cfg.validate()
    return cfg


def _read_config(path: str, fields) -> dict:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--config {path}: no such file")
    if p.suffix == ".toml":
        try:
            import tomllib
        except ImportError as e:  # Python 3.10
            raise ValueError(f"--config {path}: TOML needs Python >= 3.11; use JSON") from e
        raw = tomllib.loads(p.read_text())
    else:
        raw = json.loads(p.read_text())
    out = {}
    for k, v in raw.items():
        name = k.replace("-", "_")
        if name not in fields:
            raise ValueError(f"--config {path}: unknown option {k!r}")
        out[name] = v
    return out


# --------------------------------------------------------------------------------------
def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device != "auto":
        return torch.device(cfg.device)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", 0)))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def _init(cfg: TrainConfig, device: torch.device) -> str:
    """Initialize mcrdl (once) and return the point-to-point backend."""
    if not mcrdl.is_initialized():
        usable = mcrdl.available_backends()
        if cfg.backends:
            names = cfg.backends.split(",")
        else:
            names = [n for n in ("mpi",) if n in usable] or ["gloo"]
            if device.type == "cuda" and "nccl" in usable:
                names.append("nccl")
        kw = {"timeout": cfg.timeout} if cfg.timeout else {}
        mcrdl.init(names, **kw)
    if cfg.p2p_backend:
        return cfg.p2p_backend
    have = mcrdl.get_backends()
    if device.type == "cuda" and "nccl" in have:
        return "nccl"
    return "mpi" if "mpi" in have else "gloo"


class Trainer:
    """One configured training run on this rank (model stage, data, optimizer, engine)."""

    def __init__(self, cfg: TrainConfig, *, compute_delay: dict[int, float] | None = None,
                 record: bool = False):
        self.cfg = cfg
        self.device = _device(cfg)
        self.p2p = _init(cfg, self.device)
        self.world_rank, self.world_size = mcrdl.get_rank(), mcrdl.get_size()
        order = [a.strip() for a in cfg.grid_order.split(",")]
        self.grid = ProcessGrid({"pipe": cfg.G_inter, "data": cfg.G_data}, order=order)
        self.pipe_group, self.data_group = self.grid.group("pipe"), self.grid.group("data")
        self.s, self.S = self.grid.coord("pipe"), cfg.G_inter
        self.d = self.grid.coord("data")
        torch.manual_seed(cfg.seed)
        self.dataset = load_dataset(cfg.data, cfg.vocab_size)
        self.model_cfg = get_config(cfg.model, vocab_size=self.dataset.vocab_size,
                                    n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                                    block_size=cfg.block_size)
        lps = [int(x) for x in cfg.layers_per_stage.split(",")] if cfg.layers_per_stage else None
        self.ranges = partition(self.model_cfg.n_layer, self.S, lps)
        first, last = self.ranges[self.s]
        dtype = DTYPES[cfg.dtype]
        self.stage = GPTStage(self.model_cfg, first, last, seed=cfg.seed,
                              activation_checkpointing=cfg.activation_checkpointing)
        self.stage.to(device=self.device, dtype=dtype)
        self.batches = Batches(self.dataset, self.model_cfg.block_size, cfg.global_batch_size,
                               cfg.micro_batch_size, self.d, cfg.G_data, seed=cfg.seed)
        self.timers = PhaseTimers()
        offload = cfg.offload_optimizer or dtype != torch.float32
        kw = dict(data_group=self.data_group, pipe_group=self.pipe_group,
                  world_reduce=self.world_size > 1, timers=self.timers)
        if offload:  # low precision always keeps fp32 master weights
            self.optimizer = OffloadedAdamW(self.stage.parameters(), cfg.optim(),
                                            loss_scaling=dtype == torch.float16, **kw)
        else:
            self.optimizer = DataParallelAdamW(self.stage.parameters(), cfg.optim(), **kw)
        self.engine = PipelineEngine(self.stage, rank=self.s, size=self.S, group=self.pipe_group,
                                     p2p_backend=self.p2p, micro_batch=cfg.micro_batch_size,
                                     pipeline_limit=cfg.pipeline_limit, timers=self.timers,
                                     timeout=cfg.timeout,
                                     compute_delay=(compute_delay or {}).get(self.s, 0.0),
                                     record=record)
        self.step = 0

    # --- collectives for bookkeeping ------------------------------------------------------
    def _world_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            mcrdl.all_reduce("auto", t, op=mcrdl.ReduceOp.SUM)
        return t.tolist()

    def _world_gather(self, values: list[float]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size == 1:
            return t.view(1, -1)
        out = torch.empty(self.world_size * len(values), dtype=torch.float64)
        mcrdl.all_gather("auto", out, t)
        return out.view(self.world_size, -1)

    def _raise_together(self, err: Exception | None, what: str) -> None:
        """Collective: if any rank has an error, every rank raises CheckpointError with
        the message of the lowest failing rank (so no rank is left waiting)."""
        (flag,) = self._world_sum([float(self.world_size - self.world_rank) if err else 0.0])
        if not flag:
            return
        msg = str(err) if err is not None else ""
        if err is not None and not isinstance(err, ckpt.CheckpointError):
            msg = f"{what}: {type(err).__name__}: {err}"
        # lowest failing rank: world_size - max(world_size - rank); the sum above is only a
        # flag, so find it with a MAX reduction
        t = torch.tensor([self.world_size - self.world_rank if err else 0], dtype=torch.int64)
        if self.world_size > 1:
            mcrdl.all_reduce("auto", t, op=mcrdl.ReduceOp.MAX)
        src = self.world_size - int(t)
        buf = torch.zeros(4096, dtype=torch.uint8)
        if self.world_rank == src:
            b = msg.encode()[:4096]
            buf[: len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
        if self.world_size > 1:
            mcrdl.bcast("auto", buf, src=src)
        text = bytes(buf[buf != 0].tolist()).decode(errors="replace")
        raise ckpt.CheckpointError(text if self.world_size == 1 else f"(rank {src}) {text}")

    # --- one step -------------------------------------------------------------------------
    def train_step(self) -> tuple[float, bool]:
        self.engine.loss_scale = self.optimizer.scaler.scale
        local = self.engine.run(self.batches.microbatches(self.step))
        applied = self.optimizer.step()
        self.step += 1
        contrib = local if self.s == self.S - 1 else 0.0
        (loss_sum,) = self._world_sum([contrib])
        return loss_sum / self.cfg.G_data, applied

    # --- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        root = Path(self.cfg.checkpoint_dir)
        d = ckpt.step_dir(root, self.step)
        d.mkdir(parents=True, exist_ok=True)
        info = [0.0] * 10  # stage, bytes, sha256 as 8 x 32-bit words
        if self.d == 0:
            state = {"model": {k: v.detach().clone() for k, v in self.stage.state_dict().items()},
                     "optimizer": self.optimizer.state_dict(), "stage": self.s,
                     "units": self.ranges[self.s], "step": self.step}
            nbytes, sha = ckpt.atomic_save(state, d / ckpt.shard_name(self.s))
            info = [float(self.s), float(nbytes)] + [float(int(sha[i:i + 8], 16))
                                                   for i in range(0, 64, 8)]
        rows = self._world_gather(info)
        if self.world_rank == 0:
            shards = []
            for r in range(self.world_size):
                if self.grid.coords_of(r)["data"] != 0:
                    continue
                row = rows[r].tolist()
                sha = "".join(f"{int(w):08x}" for w in row[2:])
                shards.append({"stage": int(row[0]), "file": ckpt.shard_name(int(row[0])),
                               "bytes": int(row[1]), "sha256": sha})
            manifest = {"format": ckpt.FORMAT, "step": self.step,
                        "grid": {"G_inter": self.S, "G_data": self.cfg.G_data},
                        "partition": [list(r) for r in self.ranges],
                        "model": self.model_cfg.as_dict(),
                        "optimizer": type(self.optimizer).__name__,
                        "train_config": dataclasses.asdict(self.cfg),
                        "shards": sorted(shards, key=lambda s: s["stage"])}
            ckpt.write_manifest(d, manifest)
        self._world_sum([0.0])  # nobody leaves before the manifest is on disk
        return d

    def load_checkpoint(self, spec: str) -> int:
        """Load `spec` ("latest" or a path) on every rank; all ranks fail together."""
        err: Exception | None = None
        path = None
        try:
            if spec == "latest":
                path = ckpt.latest_checkpoint(self.cfg.checkpoint_dir)
                if path is None:
                    raise ckpt.CheckpointError(
                        f"--resume: no complete checkpoint in {self.cfg.checkpoint_dir}")
            else:
                path = Path(spec)
            manifest = ckpt.read_manifest(path)
            want = {"G_inter": self.S, "partition": [list(r) for r in self.ranges],
                    "model": self.model_cfg.as_dict(), "optimizer": type(self.optimizer).__name__}
            have = {"G_inter": manifest["grid"]["G_inter"], "partition": manifest["partition"],
                    "model": manifest["model"], "optimizer": manifest["optimizer"]}
            for k in want:
                if want[k] != have[k]:
                    raise ckpt.CheckpointError(
                        f"checkpoint {path} was written with {k}={have[k]}, this run has {k}="
                        f"{want[k]}; resume with the same model, --G-inter, --layers-per-stage "
                        "and --offload-optimizer (--G-data may change)")
            shard = ckpt.load_shard(path, manifest, self.s)
        except (ckpt.CheckpointError, OSError, RuntimeError, KeyError, ValueError) as e:
            err = e
        self._raise_together(err, f"cannot load checkpoint {path}")
        self.stage.load_state_dict(shard["model"])
        self.optimizer.load_state_dict(shard["optimizer"])
        self.step = manifest["step"]
        return self.step


# --------------------------------------------------------------------------------------
def run(cfg: TrainConfig, **trainer_kw) -> TrainResult:
    """Train per `cfg` on this rank; returns the per-step losses (and, on rank 0, the
    phase breakdown). Every rank of the world must call it with the same config."""
    cfg.validate()
    tr = Trainer(cfg, **trainer_kw)
    res = TrainResult(grid=f"G_inter={cfg.G_inter} x G_data={cfg.G_data}")
    if cfg.resume:
        res.start_step = tr.load_checkpoint(cfg.resume)
    lead = tr.world_rank == 0
    talk = lead and not cfg.quiet
    metrics = _MetricsFile(cfg, res.start_step) if lead else None
    end = cfg.stop_after if cfg.stop_after else cfg.steps
    tokens = cfg.global_batch_size * tr.model_cfg.block_size
    if talk:
        print(f"training {cfg.model} ({tr.model_cfg.n_params() / 1e6:.2f} M params, "
              f"{cfg.dtype}) on {tr.world_size} ranks: {res.grid}, stages {tr.ranges}, "
              f"{tr.batches.n_micro} microbatches of {cfg.micro_batch_size} per step, "
              f"p2p '{tr.p2p}', data: {tr.dataset.describe()}", flush=True)
    progress = _progress(talk and cfg.progress, end - res.start_step, talk)
    measured_from = None
    wall0 = time.perf_counter()
    try:
        while tr.step < end:
            if tr.step == res.start_step + 1:  # step 1 of the run is warm-up
                tr.timers.reset()
                measured_from = time.perf_counter()
                n_measured0 = tr.step
            t0 = time.perf_counter()
            loss, applied = tr.train_step()
            dt = time.perf_counter() - t0
            res.losses.append((tr.step, loss))
            if lead:
                rec = {"step": tr.step, "loss": loss, "lr": tr.cfg.optim().lr_at(tr.step - 1),
                       "grad_norm": tr.optimizer.last_grad_norm, "time_s": dt,
                       "tokens_per_s": tokens / dt}
                if tr.optimizer.scaler.enabled:
                    rec.update(loss_scale=tr.optimizer.scaler.scale, applied=applied)
                metrics.write(rec)
                if tr.step % cfg.log_interval == 0 or tr.step == end:
                    progress.log(f"step {tr.step:5d}/{cfg.steps} | loss {loss:.5f} | lr "
                                 f"{rec['lr']:.2e} | {dt * 1e3:7.1f} ms | "
                                 f"{tokens / dt:,.0f} tok/s" + ("" if applied else " | skipped"))
                progress.advance()
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {tr.step}; lower --lr or use "
                                         "--dtype fp32/bf16")
            if cfg.checkpoint_dir and ((cfg.checkpoint_every and tr.step % cfg.checkpoint_every
                                        == 0) or tr.step == end):
                d = tr.save_checkpoint()
                if lead:
                    progress.log(f"checkpoint {d}")
    finally:
        progress.close()
        if metrics:
            metrics.close()
    wall = time.perf_counter() - (measured_from or wall0)
    steps_measured = tr.step - (n_measured0 if measured_from else res.start_step)
    res.stage, res.events = tr.s, tr.engine.events
    _breakdown(tr, res, wall, steps_measured, tokens, show=not cfg.quiet)
    if lead and cfg.plot and metrics:
        _plot(metrics.path, Path(cfg.out_dir) / "loss.png", res)
    return res


def _breakdown(tr: Trainer, res: TrainResult, wall: float, steps: int, tokens: int,
               show: bool = True) -> None:
    snap = tr.timers.snapshot()
    snap["other"] = max(0.0, wall - sum(v for k, v in snap.items() if k != "other"))
    rows = tr._world_gather([snap[p] for p in PHASES] + [wall])
    if tr.world_rank != 0 or steps < 1:
        return
    stages = {}
    for r in range(tr.world_size):
        stages.setdefault(tr.grid.coords_of(r)["pipe"], []).append(rows[r])
    res.phases = {s: dict(zip(PHASES + ("wall",), (torch.stack(v).mean(0) / steps).tolist(),
                              strict=True)) for s, v in sorted(stages.items())}
    S, M = tr.S, tr.batches.n_micro
    fr = [p["bubble"] / max(1e-12, p["compute"] + p["p2p"] + p["bubble"])
          for p in res.phases.values()]
    res.bubble_measured = sum(fr) / len(fr)
    res.bubble_model = (S - 1) / (M + S - 1)
    res.tokens_per_s = tokens * steps / wall
    if not show:
        return
    print(f"\nper-step time by phase (ms, mean over data-parallel ranks; {steps} steps after "
          "warm-up):")
    print("stage " + "".join(f"{p:>11}" for p in PHASES) + f"{'step':>11}")
    for s, p in res.phases.items():
        print(f"{s:5d} " + "".join(f"{p[k] * 1e3:11.2f}" for k in PHASES)
              + f"{p['wall'] * 1e3:11.2f}")
    print(f"bubble fraction: measured {res.bubble_measured:.3f} (bubble / (compute + p2p + "
          f"bubble), mean over stages), model (G_inter-1)/(m+G_inter-1) = {res.bubble_model:.3f}"
          f" with G_inter={S}, m={M}")
    print(f"throughput: {res.tokens_per_s:,.0f} tokens/s", flush=True)


class _MetricsFile:
    def __init__(self, cfg: TrainConfig, start_step: int):
        self.path = Path(cfg.metrics or Path(cfg.out_dir) / "metrics.jsonl")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if start_step and self.path.exists():  # resuming: keep the steps before the resume
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= start_step:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError):
                    continue
        self.f = open(self.path, "w")
        for line in kept:
            self.f.write(line + "\n")

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()


class _progress:
    """A rich progress bar on rank 0 when stderr is a terminal; log lines on stdout."""

    def __init__(self, bar: bool, total: int, lines: bool = True):
        self.bar = None
        self.lines = lines
        if bar and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task("training", total=total)
            self.bar.start()

    def log(self, line: str) -> None:
        if not self.lines:
            return
        if self.bar is not None:
            self.bar.console.print(line)
        else:
            print(line, flush=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _plot(metrics: Path, png: Path, res: TrainResult) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no loss curve; pip install matplotlib)")
        return
    pts = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([p["step"] for p in pts], [p["loss"] for p in pts], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"GPT, {res.grid}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"loss curve: {png}; metrics: {metrics}")


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except ckpt.CheckpointError as e:
        print(f"error (rank {mcrdl.get_rank() if mcrdl.is_initialized() else '?'}): {e}",
              file=sys.stderr, flush=True)
        return 3
    finally:
        if mcrdl.is_initialized():
            mcrdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
