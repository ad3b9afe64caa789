"""Enumerate every layout the engines support for a world and a model, drop those that
cannot run it, and rank the rest by predicted step time.

Layouts: a dense GPT or Llama runs on the pipeline engine (G_inter x G_data, the engine's even
layer split) and the 4D engine (G_x, G_y, G_z, G_data); an MoE GPT on TED (G_tensor,
G_expert, G_data_nonexp), as does a Mixtral. A layout is dropped, with its reason, when it breaks a
divisibility rule of its engine (``"heads"``, ``"width"``, ``"vocab"``, ``"weight
shard"``, ``"layers"``, ``"experts"``, ``"batch"``; a Llama's ``"kv heads"``,
``"intermediate"``, ``"tied"``) or needs more than the memory per GPU
(``"memory"``, ``memory.py``'s models).

**Step time** = compute + communication (no overlap assumed: an upper bound).

- Compute: the model FLOPs of a step (Narayanan et al. 2021, Eq. 3 without activation
  recomputation: ``72 B s L h^2 (1 + s / (6 h) + V / (12 L h))``, i.e. 6 P tokens plus
  attention) over ``world x peak x efficiency``; the pipeline's bubble multiplies it by
  ``(M + G_inter - 1) / M`` (M micro-batches per replica).
- Communication, per rank and step: 4D from ``training.parallel4d.perf_model.predict``;
  TED from ``training.ted.cost_model.step_comm`` (the model's collectives on the
  tensor and expert groups, ZeRO-1's on the data group); the pipeline's data-parallel
  gradient all_reduce of its fullest stage (in the engine's buckets, sized from the
  stage) and its point-to-point activations, ``2 (M + G_inter - 2)`` messages of one
  micro-batch's activations on the critical path. Each collective costs ``alpha A(op,
  p) + B(op, p) n / beta(axis)`` (``mcrdl.tuning.model`` coefficients, Eq. 5.7
  bandwidths of ``Network``), the ranks of each engine nested as it nests them (4D: X
  innermost; pipeline: stages inside replicas; TED: tensor, expert, data).

**Order**: predicted step time (12 significant digits), then predicted communication,
then engine (4d, pipeline, ted), then the layout's degrees ascending: deterministic.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from mcrdl.tuning.model import coefficients

from ..core.flops import model_flops_per_token
from ..core.optim import bucket_bytes
from ..models.gpt import GPTConfig
from ..models.llama import LlamaConfig
from ..models.moe import MoEConfig
from ..parallel4d.options import FUSED_BUCKET_MIB
from ..parallel4d.perf_model import Grid4D, TrainingStep, constraint_violations, grids, predict
from ..ted.cost_model import step_comm
from ..ted.model import TEDLayout
from . import memory
from .network import Machine, PlanError

ENGINES = ("4d", "pipeline", "ted")
#: The 4D engine's fused gradient all_reduce buckets without --bucket-mib.
BUCKET_BYTES = int(FUSED_BUCKET_MIB * 2**20)


@dataclass(frozen=True)
class Problem:
    """What is planned: the model, the world and the machine."""

    model: GPTConfig | LlamaConfig      # (a MixtralConfig is a LlamaConfig)
    world_size: int
    gpus_per_node: int
    memory_per_gpu: float
    machine: Machine
    peak_flops: float
    efficiency: float = 0.5
    batch: int | None = None           # sequences per step (default: one per GPU)
    micro_batch_size: int = 1          # sequences per micro-batch
    dtype: str = "bf16"
    moe: MoEConfig | None = None

    @property
    def w(self) -> int:
        return 2 if self.dtype == "bf16" else 4

    @property
    def sequences(self) -> int:
        return self.world_size if self.batch is None else self.batch


@dataclass(frozen=True)
class Candidate:
    engine: str
    degrees: tuple[int, ...]
    label: str
    memory: dict[str, float]
    comm_bytes: float
    comm_seconds: float
    compute_seconds: float

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds

    def sort_key(self) -> tuple:
        return (float(f"{self.step_seconds:.12g}"), float(f"{self.comm_seconds:.12g}"),
                ENGINES.index(self.engine), self.degrees)


@dataclass(frozen=True)
class Rejected:
    engine: str
    label: str
    constraint: str
    message: str
    memory: float | None = None    # predicted bytes, for "memory"


@dataclass(frozen=True)
class Plan:
    problem: Problem
    ranked: tuple[Candidate, ...]
    rejected: tuple[Rejected, ...] = field(default=())

    def reasons(self) -> Counter:
        return Counter(r.constraint for r in self.rejected)


def model_flops(cfg: GPTConfig, sequences: int) -> float:
    """Narayanan et al.'s FLOPs of one step without recomputation (module docstring;
    training/core/flops.py)."""
    return model_flops_per_token(cfg) * sequences * cfg.block_size


def _seconds(p: Problem, op: str, group: int, calls: float, nbytes: float,
             bandwidth: float, latency: float) -> float:
    """``calls`` calls of ``op`` over ``group`` ranks moving ``nbytes`` in all."""
    if group <= 1 or calls == 0:
        return 0.0
    a, b = coefficients(op, group)
    return calls * latency * a + b * nbytes / bandwidth


def plan(p: Problem) -> Plan:
    """Every layout of ``p``, ranked (see the module docstring)."""
    if p.world_size > p.gpus_per_node and p.world_size % p.gpus_per_node:
        raise PlanError(f"--world-size {p.world_size} is not a whole number of nodes of "
                        f"{p.gpus_per_node} GPUs; use a multiple of {p.gpus_per_node}")
    ranked: list[Candidate] = []
    rejected: list[Rejected] = []
    network = p.machine.network(p.world_size, p.gpus_per_node)
    compute = model_flops(p.model, p.sequences) / (p.world_size * p.peak_flops * p.efficiency)
    sources = (_ted(p, network, compute),) if p.moe is not None else \
        (_grid4d(p, network, compute), _pipeline(p, network, compute))
    for source in sources:
        for item in source:
            if isinstance(item, Candidate) and item.memory["total"] > p.memory_per_gpu:
                item = Rejected(item.engine, item.label, "memory",
                                f"needs {memory.gib(item.memory['total'])} GiB per GPU, "
                                f"more than {memory.gib(p.memory_per_gpu)} GiB",
                                item.memory["total"])
            (ranked if isinstance(item, Candidate) else rejected).append(item)
    ranked.sort(key=Candidate.sort_key)
    return Plan(p, tuple(ranked), tuple(rejected))


def _shards(p: Problem, engine: str, label: str, shards: int, names: str):
    """Micro-batches per data shard, or the Rejected of an indivisible batch."""
    need = shards * p.micro_batch_size
    if p.sequences % need:
        return Rejected(engine, label, "batch",
                        f"batch {p.sequences} is not divisible by {names}*micro-batch-size="
                        f"{need}: every data shard takes whole micro-batches")
    return p.sequences // need


def _grid4d(p: Problem, network, compute: float):
    for grid in grids(p.world_size):
        label = f"4D x={grid.x} y={grid.y} z={grid.z} d={grid.data}"
        n_micro = _shards(p, "4d", label, grid.z * grid.data, "G_z*G_data")
        if isinstance(n_micro, Rejected):
            yield n_micro
            continue
        step = TrainingStep(p.model, p.sequences, n_micro, p.w, bucket_bytes=BUCKET_BYTES)
        violations = constraint_violations(step, grid)
        if violations:
            yield Rejected("4d", label, *violations[0])
            continue
        pred = predict(step, grid, network)
        comm_bytes = sum(c.nbytes * c.count for c, _ in pred.entries)
        yield Candidate("4d", grid.as_tuple(), label,
                        memory.grid_memory(p.model, grid, p.micro_batch_size, p.w),
                        comm_bytes, pred.seconds, compute)


def _pipeline(p: Problem, network, compute: float):
    cfg, w = p.model, p.w
    lat = network.latency["all_reduce"]
    for g_inter in _divisors(p.world_size):
        g_data = p.world_size // g_inter
        label = f"pipeline stages={g_inter} d={g_data}"
        if g_inter > cfg.n_layer:
            yield Rejected("pipeline", label, "layers",
                           f"{cfg.n_layer} transformer blocks cannot fill {g_inter} stages")
            continue
        if g_inter > 1 and getattr(cfg, "tie_embeddings", False):
            yield Rejected("pipeline", label, "tied",
                           "tie_embeddings: the embedding and the LM head share one matrix, "
                           "so the first and last units must sit on one stage; untie them "
                           "or use one stage")
            continue
        n_micro = _shards(p, "pipeline", label, g_data, "G_data")
        if isinstance(n_micro, Rejected):
            yield n_micro
            continue
        mem = memory.pipeline_memory(cfg, g_inter, p.micro_batch_size, n_micro, w)
        stage = max(memory.stage_params(cfg, g_inter))
        bw = network.axis_bandwidths(Grid4D(g_inter, 1, 1, g_data))
        grad = stage * w
        first, later = bucket_bytes(grad, None)  # the data-parallel engine's buckets
        calls = 1 + math.ceil(max(0, grad - first) / later)
        ar = _seconds(p, "all_reduce", g_data, calls, grad, bw["data"],
                      lat)
        messages = 2 * (n_micro + g_inter - 2) if g_inter > 1 else 0
        act = p.micro_batch_size * cfg.block_size * cfg.n_embd * w
        p2p = messages * (lat + act / bw["x"])
        bubble = (n_micro + g_inter - 1) / n_micro
        yield Candidate("pipeline", (g_inter, g_data), label, mem,
                        (grad if g_data > 1 else 0) + messages * act, ar + p2p, compute * bubble)


def _ted(p: Problem, network, compute: float):
    cfg, moe = p.model, p.moe
    lat = network.latency["all_reduce"]
    for g_t in _divisors(p.world_size):
        g_d = p.world_size // g_t
        for g_e in _divisors(g_d):
            layout = TEDLayout(g_t, g_e, g_d)
            label = f"TED t={g_t} e={g_e} d={g_d}"
            try:
                layout.check(cfg, moe, p.world_size)
            except ValueError as e:
                text = str(e)
                kind = "experts" if "experts=" in text else "heads" if "head" in text \
                    else "width" if "n_embd" in text else "layers"
                yield Rejected("ted", label, kind, text)
                continue
            n_micro = _shards(p, "ted", label, g_d, "G_data")
            if isinstance(n_micro, Rejected):
                yield n_micro
                continue
            try:
                model_comm = step_comm(cfg, moe, layout, micro_batch=p.micro_batch_size,
                                       n_micro=n_micro, dtd=True, dtype=p.dtype,
                                       optimizer=False)
            except ValueError as e:
                yield Rejected("ted", label, "batch", str(e))
                continue
            full = step_comm(cfg, moe, layout, micro_batch=p.micro_batch_size, n_micro=n_micro,
                             dtd=True, dtype=p.dtype)
            bw = network.axis_bandwidths(Grid4D(g_t, g_e, 1, g_d // g_e))
            seconds = (_seconds(p, "all_reduce", g_t, model_comm["all_reduce"]["calls"],
                                model_comm["all_reduce"]["bytes"], bw["x"], lat)
                       + _seconds(p, "all_gather", g_t, model_comm["all_gather"]["calls"],
                                  model_comm["all_gather"]["bytes"], bw["x"], lat)
                       + _seconds(p, "all_to_all_single", g_e,
                                  model_comm["all_to_all_single"]["calls"],
                                  model_comm["all_to_all_single"]["bytes"], bw["y"], lat))
            for op in ("all_reduce", "all_gather"):  # ZeRO-1 over the data groups
                calls = full[op]["calls"] - model_comm[op]["calls"]
                nbytes = full[op]["bytes"] - model_comm[op]["bytes"]
                seconds += _seconds(p, op, g_d, calls, nbytes, bw["data"] if g_e < g_d
                                    else bw["y"], lat)
            comm_bytes = sum(v["bytes"] for v in full.values())
            yield Candidate("ted", (g_t, g_e, g_d), label,
                            memory.ted_memory(cfg, moe, layout, p.micro_batch_size, p.dtype),
                            comm_bytes, seconds, compute)


def explain_infeasible(result: Plan) -> str:
    """Why no layout fits: the tightest constraint and what would make one fit."""
    p = result.problem
    memory_only = [r for r in result.rejected if r.constraint == "memory"]
    if memory_only:
        least = min(memory_only, key=lambda r: (r.memory, r.label))
        return (f"no layout of {p.world_size} GPUs fits: the tightest constraint is memory; "
                f"the least any layout needs is {memory.gib(least.memory)} GiB per GPU "
                f"({least.label}), above --memory-per-gpu {memory.gib(p.memory_per_gpu)} GiB. "
                f"Give --memory-per-gpu at least {memory.gib(least.memory)}GiB, use more "
                "GPUs (the parameters and states shard over them), a smaller "
                "--micro-batch-size, or a smaller model")
    if not result.rejected:
        return f"no layout of {p.world_size} GPUs was found"
    counts = result.reasons()
    top = min(counts, key=lambda c: (-counts[c], c))
    example = next(r for r in result.rejected if r.constraint == top)
    hint = {"experts": "choose a world size whose divisors include divisors of the expert "
                       "count, or another --experts",
            "heads": "choose a world size with divisors that divide the head count",
            "batch": "give a --batch that is a multiple of the world size",
            "layers": "use fewer pipeline stages (a deeper model)",
            "kv heads": "choose a world size with divisors that divide the key/value head "
                        "count",
            "tied": "untie the embedding and the LM head (tie_word_embeddings false)"}.get(
                top, "choose a world size that the model's shapes divide")
    every = ", ".join(f"{c} {n}" for c, n in sorted(counts.items(), key=lambda i: (-i[1], i[0])))
    return (f"no layout of {p.world_size} GPUs fits: the tightest constraint is {top} "
            f"({counts[top]} of {len(result.rejected)} layouts; all: {every}), e.g. "
            f"{example.label}: {example.message}; {hint}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
