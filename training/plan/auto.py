"""``--layout auto`` and ``--layout-trials K``: the layout chosen for the user.

The planner (``planner.plan``) enumerates every layout of the command's engines for the
world and the model, drops those that break a divisibility rule or exceed the memory per
rank (the engines' memory models), and ranks the rest by predicted step time: compute at
this machine's rate (``--peak-flops``, else a known GPU's bf16 peak at the planner's
efficiency, else the GEMM rate the slowest rank reaches while every rank multiplies at
once, taken as reached) plus communication from the tuning table "auto" routes by (alpha
and beta of its fastest all_reduce backend) or, with no table in force, from this
world's all_reduce measured when the job starts (8 bytes and 1 MiB, a fraction of a
second; ``measure_machine``). The first candidate whose options pass the command's own
rules is taken; with ``--layout-trials K`` the first K are each trained for
``--layout-trial-steps`` steps inside the job (the first step untimed), the one with the
least median step time (each step's slowest rank) wins, and training starts afresh on it
(the trials' updates are discarded: the engine rebuilds the model from ``--seed``).
Every rank agrees: rank 0 plans, the choice is broadcast, the trial times are reduced.

``--resume`` keeps the checkpoint's layout (its manifest's degrees) unless trials are
asked for. The choice is printed as a table on rank 0 and returned as a record that
the command writes to the metrics file and to every checkpoint's manifest
(``layout_choice``, beside ``train_config``, which holds the degrees the run used).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import mcrdl
from mcrdl.api import current_runtime
from mcrdl.launch import detect as detect_launch
from mcrdl.tuning.model import coefficients

from ..core import runtime
from ..core.backends import Backends
from ..core.checkpoint import resume_path
from ..core.flops import measured_peak, peak_flops
from ..core.options import Options, flag, option
from ..core.topology import GridError
from ..pipeline.trainer import comm_backends
from ..ted.options import MoETrainConfig
from .memory import gib, parse_bytes
from .network import Machine, PlanError
from .planner import Candidate, Plan, Problem, explain_infeasible, plan

__all__ = ["LayoutOptions", "choose_layout", "degree_options_of"]

#: Efficiency applied to a datasheet peak (a measured GEMM rate is already reached).
DATASHEET_EFFICIENCY = 0.5


@dataclass
class LayoutOptions(Options):
    section = "layout"
    layout: str = option("manual", "'auto': choose the engine and degrees from the memory "
                         "and communication models (the --G-* options stay unset)",
                         choices=("manual", "auto"))
    layout_trials: int = option(0, "with --layout auto: train the K best predicted layouts "
                                "a few steps each and keep the fastest", minimum=0)
    layout_trial_steps: int = option(6, "steps per trial (the first is not timed)",
                                     minimum=2)
    memory_per_rank: str | None = option(None, "memory per rank for --layout auto, e.g. "
                                         "16GiB (default: this GPU's memory, or the host's "
                                         "RAM over the node's ranks)")
    peak_flops: float | None = option(None, "peak flop/s per rank: the MFU's denominator "
                                      "and --layout auto's compute rate (default: a known "
                                      "GPU's bf16 peak, else a measured GEMM rate)", above=0)

    def check(self) -> None:
        if self.memory_per_rank is not None:
            try:
                parse_bytes(self.memory_per_rank)
            except (PlanError, ValueError) as e:
                raise ValueError(f"--memory-per-rank {self.memory_per_rank}: {e}") from None
        if self.layout != "auto":
            if self.layout_trials:
                raise ValueError("--layout-trials needs --layout auto")
            return
        given = {name: getattr(self, name) for name in _degree_names(self)
                 if getattr(self, name) != _default_degree(type(self), name)}
        if given:
            shown = " ".join(f"{flag(n)} {v}" for n, v in given.items())
            raise ValueError(f"--layout auto chooses the degrees itself; drop {shown} or "
                             "drop --layout auto")

    def check_world(self, world_size: int) -> None:
        if self.layout == "auto":
            return  # the degrees are chosen for this world when the run starts
        super().check_world(world_size)


def _degree_names(cfg: Any) -> list[str]:
    """The command's degree options (``G_inter``, ``G_x``, ``G_tensor``, ...)."""
    return [f.name for f in dataclasses.fields(cfg) if f.name.startswith("G_")]


def _default_degree(config_class: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(config_class) if f.name == name)
    return f.default


def degree_options_of(candidate: Candidate) -> dict[str, int]:
    """The command's degree options that run `candidate` (unset axes degree 1)."""
    d = candidate.degrees
    if candidate.engine == "pipeline":
        return {"G_inter": d[0], "G_data": d[1], "G_x": 1, "G_y": 1, "G_z": 1}
    if candidate.engine == "4d":
        return {"G_inter": 1, "G_x": d[0], "G_y": d[1], "G_z": d[2], "G_data": d[3]}
    return {"G_tensor": d[0], "G_expert": d[1], "G_data": d[2]}


def _with_degrees(cfg: Any, degrees: dict[str, int]) -> Any:
    names = {f.name for f in dataclasses.fields(cfg)}
    return dataclasses.replace(cfg, layout="manual", layout_trials=0,
                               **{k: v for k, v in degrees.items() if k in names})


def _local_memory(device: torch.device, local_ranks: int) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo") as f:
            total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    except (OSError, StopIteration, ValueError):
        total_kib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1024
    return total_kib * 1024 / max(1, local_ranks)


def _table_machine() -> Machine | None:
    """This machine for the planner from the tuning table in force: latency and
    bandwidth of its fastest all_reduce (one level: the planner's world spans nodes
    only where the launch says so); None without a table."""
    runtime = current_runtime()
    table = runtime.auto_table if runtime is not None else None
    fits = [table.model("all_reduce", b) for b in table.backends("all_reduce")] if table else []
    fits = [f for f in fits if f is not None and f.beta > 0]
    if not fits:
        return None
    return _one_level("this machine's tuning table", min(f.alpha for f in fits),
                      max(1 / f.beta for f in fits))


def _one_level(name: str, alpha: float, bandwidth: float) -> Machine:
    levels = ("intra_node", "inter_node")
    return Machine(name, None, dict.fromkeys(levels, alpha), dict.fromkeys(levels, bandwidth))


#: Message sizes and calls of the start-up all_reduce measurement (bytes, calls each).
PROBE_BYTES, PROBE_CALLS = (8, 1 << 20), 5


def measure_machine() -> Machine:
    """Collective over the world: the alpha-beta of this world's all_reduce measured
    now, for a machine without a tuning table in force (the shipped tables describe
    other CPUs and networks): the median over PROBE_CALLS calls of the slowest rank's
    time at 8 bytes gives alpha (over the op's latency steps), the 1 MiB calls less
    that give the bandwidth (over the op's bus factor). Ranks sharing cores, loopback
    transports and busy waits are all in the figures, as they are in the steps."""
    world = mcrdl.get_size()
    if world == 1:
        return _one_level("one rank (no communication)", 5e-6, 100e9)
    seconds = []
    for nbytes in PROBE_BYTES:
        t = torch.zeros(max(1, nbytes // 4))
        mcrdl.all_reduce("auto", t)  # warm-up: connections, buffers
        times = torch.zeros(PROBE_CALLS, dtype=torch.float64)
        for i in range(PROBE_CALLS):
            mcrdl.barrier("auto")
            t0 = time.perf_counter()
            mcrdl.all_reduce("auto", t)
            times[i] = time.perf_counter() - t0
        mcrdl.all_reduce("auto", times, op=mcrdl.ReduceOp.MAX)
        seconds.append(float(times.median()))
    a, b = coefficients("all_reduce", world)
    alpha = seconds[0] / a
    per_byte = max(seconds[1] - seconds[0], 1e-12) / (b * PROBE_BYTES[1])
    return _one_level("this world's all_reduce, measured at start", alpha, 1 / per_byte)


def world_gemm_rate(device: torch.device) -> float:
    """Collective: the GEMM rate of the slowest rank while every rank multiplies at once
    (ranks sharing cores share them, as they do in the steps)."""
    mcrdl.barrier("auto")
    rate = torch.tensor([measured_peak(device, cached=False)], dtype=torch.float64)
    if mcrdl.get_size() > 1:
        mcrdl.all_reduce("auto", rate, op=mcrdl.ReduceOp.MIN)
    return float(rate)


def _problem(cfg: Any, world_size: int, device: torch.device, memory: float,
             machine: Machine | None = None, peak: tuple[float, str] | None = None
             ) -> Problem:
    """The planner's problem of the command `cfg`; `machine`: the network (default: the
    tuning table's, else a GPU node's defaults); `peak`: the compute rate and its source
    (default: ``peak_flops``)."""
    model = cfg.model_config()
    moe = cfg.moe_config() if hasattr(cfg, "moe_config") else None
    rate, source = peak or peak_flops(device, cfg.peak_flops)
    efficiency = DATASHEET_EFFICIENCY if "datasheet" in source else 1.0
    launch = detect_launch()
    per_node = launch.local_size if 0 < launch.local_size < world_size else world_size
    machine = machine or _table_machine() or _one_level(
        "defaults (no tuning table in force)", 5e-6, 100e9)
    return Problem(model, world_size, per_node, memory, machine, rate, efficiency,
                   cfg.global_batch_size, cfg.micro_batch_size,
                   "fp32" if cfg.dtype == "fp32" else "bf16", moe)


def _runnable(cfg: Any, result: Plan, world_size: int, engines: tuple[str, ...]
              ) -> list[tuple[Candidate, Any]]:
    """The ranked candidates of `engines` whose options pass the command's rules."""
    out, seen = [], set()
    for c in result.ranked:
        if c.engine not in engines:
            continue
        trial = _with_degrees(cfg, degree_options_of(c))
        try:
            trial.validate()
            trial.check_world(world_size)
        except (ValueError, GridError):
            continue
        # 4D without tensor axes is the pipeline engine's data parallelism: one entry
        if trial.describe_grid() not in seen:
            seen.add(trial.describe_grid())
            out.append((c, trial))
    return out


def _print_choice(result: Plan, runnable: list, chosen: int, measured: dict[int, float],
                  predicted_only: bool) -> None:
    print(f"--layout auto: {len(result.ranked)} of "
          f"{len(result.ranked) + len(result.rejected)} layouts fit; "
          f"{result.problem.machine.name}, {result.problem.peak_flops / 1e9:.1f} GFLOP/s "
          f"x {result.problem.efficiency:g} per rank, {gib(result.problem.memory_per_gpu)} "
          "GiB per rank", flush=True)
    print(f"  {'':1} {'layout':<30} {'mem GiB':>8} {'comm MiB':>9} {'pred. s':>9} "
          f"{'measured s':>10}")
    shown = max(len(measured), 5)
    for i, (c, _) in enumerate(runnable[:shown]):
        mark = "*" if i == chosen else " "
        m = f"{measured[i]:>10.4f}" if i in measured else f"{'':>10}"
        print(f"  {mark} {c.label:<30} {gib(c.memory['total']):>8} "
              f"{c.comm_bytes / 2**20:>9.2f} {c.step_seconds:>9.4f} {m}")
    how = "predicted fastest" if predicted_only else "fastest measured"
    print(f"  * chosen ({how})", flush=True)


def _resumed_layout(cfg: Any) -> tuple[dict[str, int] | None, dict | None]:
    """The degrees of the checkpoint ``--resume`` names, from its manifest, and the
    ``layout_choice`` record that chose them (None: the run that wrote it had its
    layout given)."""
    path = resume_path(cfg.resume, cfg.checkpoint_dir)
    manifest = json.loads((path / "manifest.json").read_text())
    train = manifest.get("train_config") or {}
    earlier = manifest.get("layout_choice")
    return ({k: train[k] for k in _degree_names(cfg) if k in train} or None,
            (earlier.get("chosen") if earlier.get("source") == "checkpoint" else earlier)
            if isinstance(earlier, dict) else None)


def auto_layout(cfg: Any, build: Callable[[Any], Any] | None = None) -> tuple[Any, dict]:
    """Collective over the world: mcrdl initialized as the command of `cfg` does (train_moe's
    options: its --backends, nccl beside them on a GPU; train_gpt's or evaluate's: the
    pipeline's comm_backends), then ``choose_layout`` among that command's engines (TED;
    or --engine's, the pipeline and 4D by default). `build(cfg)`: a trainer, for
    ``--layout-trials``."""
    device = runtime.pick_device(cfg.device)
    if isinstance(cfg, MoETrainConfig):
        runtime.init_comm(Backends.parse(cfg.backends).init, device, cfg.timeout,
                          nccl_with_given=True)
        engines: tuple[str, ...] = ("ted",)
    else:
        runtime.init_comm(comm_backends(cfg, device), device, cfg.timeout)
        engines = {"4d": ("4d",), "pipeline": ("pipeline",)}.get(cfg.engine,
                                                                  ("pipeline", "4d"))
    return choose_layout(cfg, engines=engines, build=build)


def choose_layout(cfg: Any, *, engines: tuple[str, ...],
                  build: Callable[[Any], Any] | None = None) -> tuple[Any, dict]:
    """Collective over the world (mcrdl initialized): the options `cfg` with the layout
    chosen (see the module docstring) and the record of the choice. `engines`: those the
    command runs ("pipeline", "4d" / "ted"); `build(cfg)`: a trainer for a trial (with
    ``train_step()``), needed for ``--layout-trials``."""
    world = mcrdl.get_size()
    rank = mcrdl.get_rank()
    if cfg.resume and not cfg.layout_trials:
        degrees, earlier = mcrdl.broadcast_object(_resumed_layout(cfg) if rank == 0
                                                  else None)
        if degrees:
            chosen = _with_degrees(cfg, degrees)
            chosen.validate()
            chosen.check_world(world)
            if rank == 0:
                print(f"--layout auto: resuming on the checkpoint's layout "
                      f"{chosen.describe_grid()}", flush=True)
            record = {"layout": "auto", "source": "checkpoint", "degrees": degrees}
            if earlier:  # the choice that made the checkpoint's layout
                record["chosen"] = earlier
            return chosen, record
    device = torch.device("cuda", torch.cuda.current_device()) \
        if cfg.device != "cpu" and torch.cuda.is_available() else torch.device("cpu")
    memory = parse_bytes(cfg.memory_per_rank) if cfg.memory_per_rank else \
        _local_memory(device, max(1, detect_launch().local_size))
    least = torch.tensor([memory], dtype=torch.float64)
    if world > 1:  # the smallest node's memory bounds every rank
        mcrdl.all_reduce("auto", least, op=mcrdl.ReduceOp.MIN)
    # without a tuning table, the network as this world measures it now; on a CPU without
    # --peak-flops, the GEMM rate with every rank multiplying (the ranks may share cores)
    machine = _table_machine() or measure_machine()
    peak = (world_gemm_rate(device), "measured GEMM rate, every rank at once") \
        if cfg.peak_flops is None and device.type != "cuda" else None
    error, picked = None, None
    if rank == 0:
        try:
            result = plan(_problem(cfg, world, device, float(least), machine, peak))
            runnable = _runnable(cfg, result, world, engines)
            if not runnable:
                raise PlanError(explain_infeasible(result) if not result.ranked else
                                f"none of the {len(result.ranked)} layouts that fit pass "
                                "the command's own rules (batch split, grid); give the "
                                "layout with the --G-* options")
            picked = [degree_options_of(c) for c, _ in runnable[:max(1, cfg.layout_trials)]]
        except (PlanError, ValueError) as e:
            error = f"{e}"
    error, picked = mcrdl.broadcast_object((error, picked) if rank == 0 else None)
    if error is not None:
        raise ValueError(f"--layout auto: {error}")
    measured: dict[int, float] = {}
    if cfg.layout_trials and len(picked) > 1:
        if build is None:
            raise ValueError("--layout-trials: this command cannot run trials")
        for i, degrees in enumerate(picked):
            measured[i] = _trial(build(_with_degrees(cfg, degrees)), cfg.layout_trial_steps)
    best = min(measured, key=lambda i: (measured[i], i)) if measured else 0
    if rank == 0:
        _print_choice(result, runnable, best, measured, not measured)
    chosen = _with_degrees(cfg, picked[best])
    record = {"layout": "auto", "source": "trials" if measured else "model",
              "degrees": picked[best], "grid": chosen.describe_grid()}
    if rank == 0:
        c = runnable[best][0]
        record.update(predicted_step_s=c.step_seconds, predicted_memory_bytes=c.memory["total"],
                      predicted_comm_bytes=c.comm_bytes,
                      network={"name": machine.name,
                               "alpha_s": machine.latency["intra_node"],
                               "bandwidth_bytes_per_s": machine.bandwidth["intra_node"]},
                      peak_flops=result.problem.peak_flops,
                      peak_source=peak[1] if peak else "default")
        if measured:
            record["trials"] = [{"grid": _with_degrees(cfg, d).describe_grid(),
                                 "measured_step_s": measured[i]}
                                for i, d in enumerate(picked)]
    return chosen, mcrdl.broadcast_object(record if rank == 0 else None)


def _trial(trainer: Any, steps: int) -> float:
    """Seconds per step of `trainer`: the median over its steps after an untimed first
    one of the slowest rank's time."""
    trainer.train_step()
    times = torch.zeros(steps - 1, dtype=torch.float64)
    for i in range(steps - 1):
        mcrdl.barrier("auto")
        t0 = time.perf_counter()
        trainer.train_step()
        times[i] = time.perf_counter() - t0
    if mcrdl.get_size() > 1:
        mcrdl.all_reduce("auto", times, op=mcrdl.ReduceOp.MAX)
    del trainer
    return float(times.median())
