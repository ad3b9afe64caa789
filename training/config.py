"""Training options: config sections as dataclasses, their validation, the command line
built from them, and ``--config FILE`` (TOML or JSON).

A run's config is one flat dataclass composed of sections (``ModelOptions``,
``DataOptions``, ``PipelineOptions``, ``OptimizerOptions``, ``RunOptions``), so every
option is one attribute (``cfg.G_inter``) and one flag. Each field is declared with
``option()``: the field name is the option (``G_inter`` is ``--G-inter`` on the command
line and ``G_inter`` or ``G-inter`` in a config file) and its metadata holds the help
text, the allowed values and, for a grid degree, the ``Axis`` it sets. An engine adds
options by adding a section and composing its own config class; ``parse_args`` builds
the command line of any such class, one argument group per section.

Values come from the field defaults, then ``--config FILE`` (option names as keys, at
the top level or in a table named after their section: ``[parallel]``), then the
command line; ``validate()`` then checks types, ranges and the rules between options.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import typing
from collections.abc import Sequence
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, ClassVar, TypeVar

import torch

from mcrdl.launch import detect as detect_launch
from mcrdl.launch import launch_command

from .optim import OptimConfig
from .pruning import SCOPES, check_sparsity, parse_schedule
from .topology import Axis, GridError, to_axis

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TENSOR_AXES = (Axis.X, Axis.Y, Axis.Z)


def option(default: Any, help: str, *, minimum: float | None = None,
           above: float | None = None, choices: Sequence[str] | None = None,
           axis: Axis | None = None, const: Any = None) -> Any:
    """A config field. ``validate()`` checks `minimum` (the least value), `above` (a
    bound the value must exceed) and `choices`, and that a float is finite; `axis`
    marks a grid degree; `const` is the value of the flag given without a value."""
    metadata = {"help": help, "minimum": minimum, "above": above, "choices": choices,
                "axis": axis, "const": const}
    return field(default=default, metadata=metadata)


def flag(name: str) -> str:
    """The command-line flag of option `name`: ``G_inter`` -> ``--G-inter``."""
    return "--" + name.replace("_", "-")


class Options:
    """Base of the config sections. A section class sets ``section`` (its name in
    ``--help`` and in config files) and may define ``check(self)`` for the rules between
    its options; ``validate()`` checks every field, then runs each section's ``check``.
    The grid is read from the options declared with an ``axis``, whatever their section."""

    section: ClassVar[str]

    def validate(self) -> None:
        """Raise ValueError naming the option (``--flag``) that is wrong and why."""
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            _check_value(f, getattr(self, f.name), hints[f.name])
        for section in sections(type(self)):
            if "check" in vars(section):
                section.check(self)

    def degrees(self) -> dict[Axis, int]:
        """The degree of each grid axis, from the options that declare an axis."""
        return {f.metadata["axis"]: getattr(self, f.name) for f in self._degree_fields()}

    def degree_options(self) -> dict[str, int]:
        """The grid as option name -> degree (``{"G_inter": 2, "G_data": 2}``)."""
        return {f.name: getattr(self, f.name) for f in self._degree_fields()}

    def describe_grid(self) -> str:
        """The grid as options: ``G_inter=2 x G_data=2``; the 4D tensor axes (x, y, z)
        only when one of them has degree > 1."""
        opts = self.degree_options()
        tensor = {f.name for f in self._degree_fields() if f.metadata["axis"] in _TENSOR_AXES}
        if all(opts[name] == 1 for name in tensor):
            opts = {k: v for k, v in opts.items() if k not in tensor}
        return " x ".join(f"{name}={n}" for name, n in opts.items())

    def check_world(self, world_size: int) -> None:
        """Raise GridError unless the grid's degrees multiply to `world_size`, naming the
        options, the launch that fits them and the --G-data that fits the world."""
        opts = self.degree_options()
        total = math.prod(opts.values())
        if total == world_size or min(opts.values(), default=1) < 1:
            return  # a bad degree: validate() and ProcessGrid name it
        fits = ""
        rest = total // opts.get("G_data", 1)
        data = world_size // rest
        # --G-data that fills the world, where the global batch also splits over it
        if ("G_data" in opts and world_size % rest == 0
                and getattr(self, "global_batch_size", 0)
                % (data * getattr(self, "micro_batch_size", 1)) == 0):
            others = " and ".join(f"{flag(n)} {v}" for n, v in opts.items()
                                  if n != "G_data" and v > 1)
            fits = (f" (with {others}: " if others else " (") + f"--G-data {data})"
        raise GridError(f"process grid {self.describe_grid()} needs {total} ranks but the "
                        f"world has {world_size}; launch with {launch_command(total)} or "
                        f"change the degrees so that their product is {world_size}{fits}")

    def _degree_fields(self) -> list[Field]:
        return [f for f in fields(self) if f.metadata.get("axis") is not None]


def sections(config_class: type) -> list[type]:
    """The sections `config_class` is composed of, in the order of their fields."""
    return [c for c in reversed(config_class.__mro__) if "section" in vars(c)]


def _section_fields(section: type) -> list[str]:
    """The options `section` itself declares (not those of its bases)."""
    return list(inspect.get_annotations(section))


@dataclass
class ModelOptions(Options):
    section = "model"
    model: str = option("tiny", "model size (training/models/gpt.py CONFIGS)")
    n_layer: int | None = option(None, "transformer blocks (overrides --model)", minimum=1)
    n_head: int | None = option(None, "attention heads (overrides --model)", minimum=1)
    n_embd: int | None = option(None, "embedding width (overrides --model)", minimum=1)
    block_size: int | None = option(None, "context length in tokens (overrides --model)",
                                    minimum=1)
    activation_checkpointing: bool = option(False, "store activations every ~sqrt(N) blocks")


@dataclass
class DataOptions(Options):
    section = "data"
    data: str = option("stdlib", "'stdlib' (bytes of Python's sources) or a directory of "
                       "nanoGPT train.bin/val.bin")
    vocab_size: int | None = option(None, "vocabulary of --data DIR's tokens", minimum=1)
    micro_batch_size: int = option(2, "sequences per microbatch", minimum=1)
    global_batch_size: int = option(8, "sequences per step, over all data-parallel ranks",
                                    minimum=1)


@dataclass
class PipelineOptions(Options):
    """AxoNN's grid: pipelines of G_inter stages, G_data of them side by side."""

    section = "parallel"
    G_inter: int = option(1, "pipeline stages", minimum=1, axis=Axis.PIPE)
    G_data: int = option(1, "data-parallel replicas of each stage", minimum=1, axis=Axis.DATA)
    grid_order: str = option("x,y,z,pipe,data", "grid axes from the fastest-varying rank "
                             "to the slowest (axes of degree 1 may be left out)")
    layers_per_stage: str | None = option(None, "transformer blocks per stage, e.g. 2,1,1 "
                                          "(default: as even as possible)")
    pipeline_limit: int | None = option(None, "microbatches in flight at stage 0 (default "
                                        "2 x G_inter)", minimum=1)
    p2p_backend: str | None = option(None, "mcrdl backend of the pipeline's messages "
                                     "(default nccl on GPUs, else mpi, else gloo)")

    def axis_order(self) -> list[Axis]:
        """--grid-order as axes, each axis of the grid once; axes of degree 1 that it
        leaves out go last (where they are does not change any rank's place)."""
        try:
            order = [to_axis(a.strip()) for a in self.grid_order.split(",")]
        except ValueError as e:
            raise ValueError(f"--grid-order {self.grid_order!r}: {e}") from None
        degrees = self.degrees()
        order += [a for a in degrees if a not in order and degrees[a] == 1]
        if sorted(order) != sorted(degrees):
            raise ValueError(f"--grid-order {self.grid_order!r}: expected each of "
                             f"{', '.join(a.value for a in degrees)} once (those of "
                             "degree 1 may be left out)")
        return order

    def blocks_per_stage(self) -> list[int] | None:
        """--layers-per-stage as integers (None: spread evenly)."""
        if self.layers_per_stage is None:
            return None
        try:
            return [int(x) for x in self.layers_per_stage.split(",")]
        except ValueError:
            raise ValueError(f"--layers-per-stage {self.layers_per_stage!r}: expected "
                             "comma-separated block counts, one per stage (2,1,1)") from None

    def check(self) -> None:
        self.axis_order()
        self.blocks_per_stage()
        if self.p2p_backend is not None:
            check_backend_names("--p2p-backend", self.p2p_backend, [self.p2p_backend])


@dataclass
class TensorOptions(Options):
    """AxoNN's 4D grid (training/parallel4d): every Linear layer parallelized over
    (G_x, G_y, G_z), replicated over --G-data."""

    section = "tensor"
    G_x: int = option(1, "4D: ranks splitting a Linear's out-features (attention heads)",
                      minimum=1, axis=Axis.X)
    G_y: int = option(1, "4D: ranks splitting a Linear's in-features (the hidden dimension)",
                      minimum=1, axis=Axis.Y)
    G_z: int = option(1, "4D: ranks sharding every weight and the batch (FSDP-like)",
                      minimum=1, axis=Axis.Z)
    engine: str = option("auto", "training engine ('auto': 4d when G_x, G_y or G_z > 1, "
                         "else pipeline)", choices=("auto", "pipeline", "4d"))
    overlap: str = option("none", "4D: collectives overlapped with compute",
                          choices=("none", "oar", "oar+ors", "all"))
    tune_matmul: bool = option(False, "4D: time NN/NT/TN matmul layouts in step 1, keep the "
                               "fastest")
    axis_backends: str | None = option(None, "4D: mcrdl backend per axis, e.g. "
                                       "z=pccl,data=auto (default auto everywhere)")
    regather_weights: bool = option(False, "4D: gather each weight again in the backward "
                                    "instead of keeping it from the forward")

    def tensor_degrees(self) -> dict[str, int]:
        return {"x": self.G_x, "y": self.G_y, "z": self.G_z}

    def uses_4d(self) -> bool:
        """Whether the run uses the 4D engine."""
        if self.engine == "auto":
            return any(n > 1 for n in self.tensor_degrees().values())
        return self.engine == "4d"

    def backend_of_axis(self) -> dict[str, str]:
        """--axis-backends as {axis: backend}, "auto" for the axes it leaves out."""
        out = dict.fromkeys(("x", "y", "z", "data"), "auto")
        if not self.axis_backends:
            return out
        for item in self.axis_backends.split(","):
            axis, sep, backend = (s.strip() for s in item.partition("="))
            if not sep or axis not in out or not backend:
                raise ValueError(f"--axis-backends {self.axis_backends!r}: expected "
                                 "comma-separated AXIS=BACKEND with AXIS one of x, y, z, data "
                                 "(e.g. z=pccl,data=auto)")
            out[axis] = backend
        return out

    #: Options that only one engine reads: given to the other they would be ignored.
    ENGINE_ONLY = {"4d": ("overlap", "tune_matmul", "axis_backends", "regather_weights"),
                   "pipeline": ("layers_per_stage", "pipeline_limit", "p2p_backend")}

    def check(self) -> None:
        check_backend_names("--axis-backends", self.axis_backends,
                            list(self.backend_of_axis().values()))
        engine = "4d" if self.uses_4d() else "pipeline"
        other = "pipeline" if engine == "4d" else "4d"
        defaults = {f.name: f.default for f in fields(self)}
        given = [flag(n) for n in self.ENGINE_ONLY[other]
                 if n in defaults and getattr(self, n) != defaults[n]]
        if given:
            it = "it" if len(given) == 1 else "them"
            raise ValueError(f"{', '.join(given)}: only the {other} engine reads {it}, and "
                             f"this run uses the {engine} engine (G_x={self.G_x}, G_y="
                             f"{self.G_y}, G_z={self.G_z}, --engine {self.engine}); drop {it} "
                             f"or choose --engine {other}")
        tensor = {f"--G-{a}": n for a, n in self.tensor_degrees().items() if n > 1}
        if tensor and self.engine == "pipeline":
            raise ValueError(f"--engine pipeline has no tensor parallelism; drop "
                             f"{', '.join(f'{k} {v}' for k, v in tensor.items())} or use "
                             "--engine 4d")
        if self.uses_4d():
            if self.G_inter > 1:
                shown = ", ".join(f"{k} {v}" for k, v in tensor.items()) or "--engine 4d"
                raise ValueError(f"--G-inter {self.G_inter} (pipeline stages) with {shown} is "
                                 "not supported: the 4D engine runs one pipeline stage; use "
                                 "--G-inter 1, or G_x = G_y = G_z = 1 for the pipeline")
            if self.activation_checkpointing:
                raise ValueError("--activation-checkpointing is not supported by the 4D "
                                 "engine yet")
            if getattr(self, "prune_sparsity", None) is not None:
                raise ValueError("--prune-sparsity/--samo are not supported by the 4D engine "
                                 "yet (training/samo.py runs the pipeline engine)")
            shards = self.G_z * self.G_data
            if self.global_batch_size % shards:
                raise ValueError(f"--global-batch-size {self.global_batch_size} is not "
                                 f"divisible by G_z*G_data={self.G_z}*{self.G_data}={shards}: "
                                 "every (z, data) rank takes whole sequences; choose a "
                                 f"multiple of {shards}")


@dataclass
class OptimizerOptions(Options):
    section = "optimizer"
    lr: float = option(1e-3, "peak learning rate", above=0)
    min_lr: float | None = option(None, "learning rate at the end of the cosine decay "
                                  "(default 1e-4, or --lr where that is lower)", minimum=0)
    warmup_steps: int = option(5, "steps of linear warm-up", minimum=0)
    decay_steps: int | None = option(None, "step where the decay reaches --min-lr "
                                     "(default --steps)", minimum=1)
    weight_decay: float = option(0.1, "AdamW weight decay of matrices and embeddings",
                                 minimum=0)
    grad_clip: float = option(1.0, "global gradient norm bound (0: no clipping)", minimum=0)
    offload_optimizer: bool = option(False, "fp32 master weights and Adam states in host "
                                     "memory (always on for bf16/fp16)")
    bucket_mib: float = option(4.0, "offloaded optimizer's bucket size in MiB", above=0)
    coarsening: int = option(2, "buckets per all-reduce chunk", minimum=1)

    def check(self) -> None:
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}: the decay "
                             "goes from --lr down to --min-lr")

    def optimizer_config(self, total_steps: int) -> OptimConfig:
        """The optimizers' settings for a run of `total_steps` steps."""
        min_lr = min(1e-4, self.lr) if self.min_lr is None else self.min_lr
        return OptimConfig(lr=self.lr, min_lr=min_lr, warmup_steps=self.warmup_steps,
                           decay_steps=self.decay_steps or total_steps,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip,
                           bucket_mib=self.bucket_mib, coarsening=self.coarsening)


def check_backend_names(option: str, given: str, names: list[str]) -> None:
    """ValueError naming `option` when one of `names` is no mcrdl backend (a typo would
    otherwise surface only at init, as a traceback about mcrdl.init)."""
    from mcrdl.backends.registry import known_names

    known = known_names()
    bad = [n.strip() for n in names if n.strip() not in (*known, "auto")]
    if bad:
        raise ValueError(f"{option} {given!r}: unknown backend {bad[0]!r}; mcrdl's backends "
                         f"are {', '.join(known)} (and auto)")


@dataclass
class RunOptions(Options):
    section = "run"
    steps: int = option(20, "training steps", minimum=1)
    dtype: str = option("fp32", "training precision", choices=tuple(DTYPES))
    device: str = option("auto", "torch device ('auto': this rank's GPU if any, else cpu)")
    seed: int = option(1234, "seed of the weights and of the batches", minimum=0)
    backends: str | None = option(None, "mcrdl backends to initialize, comma-separated "
                                  "(default mpi or gloo, plus nccl on GPUs)")
    timeout: float | None = option(None, "seconds before a missing message or rank is an "
                                   "error (default mcrdl's)", minimum=0.001)
    metrics: str | None = option(None, "JSON-lines metrics file (default "
                                 "<out-dir>/metrics.jsonl)")
    out_dir: str = option("runs/gpt", "directory of the metrics and the loss plot")
    checkpoint_dir: str | None = option(None, "directory of the checkpoints")
    checkpoint_every: int = option(0, "steps between checkpoints (0: only at the end)",
                                   minimum=0)
    stop_after: int | None = option(None, "stop (with a checkpoint) after this step")
    resume: str | None = option(None, "resume from --checkpoint-dir's latest checkpoint, or "
                                "from a path", const="latest")
    init_from: str | None = option(None, "start from a serial state_dict (.pt: 'python -m "
                                   "training.checkpoint consolidate' writes one) instead of "
                                   "--seed's weights; any grid or layout (with --resume, the "
                                   "checkpoint's weights)")
    log_interval: int = option(1, "steps between log lines", minimum=1)
    plot: bool = option(True, "save the loss curve as <out-dir>/loss.png")
    progress: bool = option(True, "progress bar on a terminal")
    quiet: bool = option(False, "no start line, step lines or breakdown (benchmarks)")

    @property
    def last_step(self) -> int:
        """The step this run ends after: --stop-after, else --steps."""
        return self.stop_after or self.steps

    @property
    def metrics_path(self) -> Path:
        """--metrics, else <out-dir>/metrics.jsonl."""
        return Path(self.metrics or Path(self.out_dir) / "metrics.jsonl")

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint is written after `step` (1-based)."""
        if not self.checkpoint_dir:
            return False
        every = self.checkpoint_every and step % self.checkpoint_every == 0
        return bool(every) or step == self.last_step

    def check(self) -> None:
        if self.backends:  # names, or KIND=NAME pins (train_moe): every name it initializes
            from .collectives import Backends

            check_backend_names("--backends", self.backends,
                                Backends.parse(self.backends).init)
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"--stop-after {self.stop_after}: expected 1..--steps ({self.steps})")
        if (self.checkpoint_every or self.stop_after) and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every/--stop-after need --checkpoint-dir")
        if self.resume == "latest" and not self.checkpoint_dir:
            raise ValueError("--resume without a path needs --checkpoint-dir")
        if self.init_from is not None and not Path(self.init_from).is_file():
            raise PathOptionError(f"--init-from {self.init_from}: no such file")
        if self.plot or not self.metrics:  # else nothing goes to --out-dir
            _check_directory("--out-dir", self.out_dir)
        if self.checkpoint_dir:
            _check_directory("--checkpoint-dir", self.checkpoint_dir)
        _check_file("--metrics" if self.metrics else "--out-dir", self.metrics_path)


@dataclass
class SamoOptions(Options):
    """Magnitude pruning (training/pruning.py) and SAMO's compressed model states
    (training/samo.py). Its rules read --offload-optimizer and --steps."""

    section = "samo"
    samo: bool = option(False, "store theta32, the gradients and the Adam states compressed "
                        "over the unpruned entries (needs --prune-sparsity)")
    prune_sparsity: float | None = option(None, "fraction of the parameters pruned by "
                                          "magnitude, in [0, 1); without --samo: dense "
                                          "masked training")
    prune_schedule: str | None = option(None, "steps before which to prune, e.g. 0,100,200; "
                                        "round k of n reaches 1-(1-p)^(k/n) (default 0)")
    prune_scope: str = option("global", "one magnitude threshold for the whole model, or "
                              "one per tensor", choices=SCOPES)

    def check(self) -> None:
        if self.prune_sparsity is None:
            if self.samo or self.prune_schedule is not None:
                raise ValueError(f"{'--samo' if self.samo else '--prune-schedule'} needs "
                                 "--prune-sparsity (the fraction of the parameters pruned, "
                                 "e.g. 0.9)")
            return
        check_sparsity(self.prune_sparsity)
        last = parse_schedule(self.prune_schedule, self.prune_sparsity)[-1].step
        if last >= self.steps:
            raise ValueError(f"--prune-schedule {self.prune_schedule!r}: a round before step "
                             f"{last} never runs in a run of --steps {self.steps}; expected "
                             f"steps below {self.steps}")
        if self.samo and self.offload_optimizer:
            raise ValueError("--samo with --offload-optimizer: SAMO keeps its own compressed "
                             "fp32 master weights and Adam states, and --offload-optimizer "
                             "only picks the dense fp32 optimizers' layout; drop it")


@dataclass
class TrainConfig(SamoOptions, RunOptions, OptimizerOptions, TensorOptions, PipelineOptions,
                  DataOptions, ModelOptions):
    """The options of ``python -m training.train_gpt`` (the last base's fields come
    first: model, data, parallel, tensor, optimizer, run, samo)."""

    def optim(self) -> OptimConfig:
        """The optimizers' settings for this run (decay over --steps by default)."""
        return self.optimizer_config(self.steps)


# -- paths ------------------------------------------------------------------------------

class PathOptionError(ValueError):
    """An option names a path this process cannot use, or a value read from a --config
    file is refused. Unlike the other option errors, which follow from the command line
    alone and so are the same on every rank, this one is of this node's file system:
    another node may see another one (or another copy of the file)."""


def _existing_ancestor(path: Path) -> Path:
    """`path` itself, else its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_directory(option: str, given: str | Path) -> None:
    """PathOptionError naming `option` when directory `given` cannot be made or written: it or
    an ancestor is a file, or the nearest existing ancestor is not writable (a run would
    train and then fail at its first save)."""
    path = Path(given)
    found = _existing_ancestor(path)
    if not found.is_dir():
        what = "is a file" if found == path.absolute() else f"is inside the file {found}"
        raise PathOptionError(f"{option} {given} {what}; expected a directory (made if "
                              "missing)")
    if not os.access(found, os.W_OK | os.X_OK):
        raise PathOptionError(f"{option} {given}: {found} is not writable by this user")


def _check_file(option: str, given: str | Path) -> None:
    """PathOptionError naming `option` when file `given` cannot be written: it is a directory,
    or its directory cannot be made (``_check_directory``)."""
    path = Path(given)
    if path.is_dir():
        raise PathOptionError(f"{option}: {given} is a directory; expected a file")
    _check_directory(option, path.parent)


# -- types of values --------------------------------------------------------------------

def _value_types(hint: Any) -> tuple[type, ...]:
    """The types a field annotated `hint` holds (``int | None`` -> (int, NoneType))."""
    if isinstance(hint, UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _scalar_type(hint: Any) -> type:
    return next(t for t in _value_types(hint) if t is not NoneType)


_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_value(f: Field, value: Any, hint: Any) -> None:
    types = _value_types(hint)
    if value is None:
        if NoneType not in types:
            raise ValueError(f"{flag(f.name)} has no value; expected {_EXPECTED[types[0]]}")
        return
    kind = _scalar_type(hint)
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ValueError(f"{flag(f.name)} is {value!r}; expected {_EXPECTED[kind]}")
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{flag(f.name)} is {value!r}; expected a finite number")
    above = f.metadata.get("above")
    if above is not None and not value > above:
        raise ValueError(f"{flag(f.name)} is {value!r}; expected > {above}")
    choices, minimum = f.metadata.get("choices"), f.metadata.get("minimum")
    if choices is not None and value not in choices:
        raise ValueError(f"{flag(f.name)} {value!r}: expected one of {', '.join(choices)}")
    if minimum is not None and value < minimum:
        wanted = "a positive integer" if (kind is int and minimum == 1) else f">= {minimum}"
        raise ValueError(f"{flag(f.name)} is {value!r}; expected {wanted}")


# -- command line and config files ------------------------------------------------------

ConfigT = TypeVar("ConfigT", bound=Options)


class UsageError(ValueError):
    """argparse's complaint about the command line (an unknown flag, a value of the wrong
    type): ``str()`` is its "prog: error: ..." line, ``usage`` the usage lines it prints
    before it."""

    def __init__(self, usage: str, message: str):
        super().__init__(message)
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    """Raises UsageError where argparse would print and exit: the caller decides which
    rank prints it (run_command: one, since every rank has the same command line)."""

    def error(self, message: str):
        raise UsageError(self.format_usage(), f"{self.prog}: error: {message}")

    def print_help(self, file=None):
        if detect_launch().rank == 0:  # --help: the same text on every rank of a launch
            super().print_help(file)


def parse_args(config_class: type[ConfigT], argv: Sequence[str] | None = None, *,
               prog: str | None = None, description: str | None = None) -> ConfigT:
    """A validated `config_class` from the defaults, ``--config FILE`` and `argv` (in
    that order of precedence, the last winning). Raises ValueError naming a bad option
    (UsageError where argparse refuses the command line, PathOptionError for a path this
    node cannot use), FileNotFoundError for a missing config file."""
    parser = _Parser(prog=prog, description=description,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML or JSON file of options (see above)")
    defaults = config_class()
    hints = typing.get_type_hints(config_class)
    by_name = {f.name: f for f in fields(config_class)}
    for section in sections(config_class):
        group = parser.add_argument_group(f"{section.section} options")
        for name in _section_fields(section):
            _add_flag(group, by_name[name], hints[name], getattr(defaults, name))
    args = parser.parse_args(argv)
    try:
        values = read_config_file(args.config, config_class) if args.config else {}
        values.update({name: getattr(args, name) for name in by_name
                       if getattr(args, name) is not None})
        config = config_class(**values)
        config.validate()
    except PathOptionError:
        raise
    except ValueError as e:
        if not args.config:
            raise
        # its values came (or may have come) from this node's copy of the file
        raise PathOptionError(str(e)) from e
    return config


def _add_flag(group, f: Field, hint: Any, default: Any) -> None:
    choices = f.metadata.get("choices")
    help_text = f.metadata["help"] + (f": {', '.join(choices)}" if choices else "")
    if default is not None:
        help_text += f" (default {default})"
    kind = _scalar_type(hint)
    if f.metadata.get("const") is not None:
        group.add_argument(flag(f.name), nargs="?", const=f.metadata["const"], default=None,
                           type=kind, help=help_text)
    elif kind is bool:
        group.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=None,
                           help=help_text)
    else:
        group.add_argument(flag(f.name), type=kind, default=None, help=help_text)


def read_config_file(path: str, config_class: type[Options]) -> dict[str, Any]:
    """Option values from a TOML (``.toml``) or JSON file: option names (with ``_`` or
    ``-``) as keys, at the top level or in a table named after their section."""
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"--config {path}: no such file")
    try:
        if file.suffix == ".toml":
            try:
                import tomllib
            except ImportError as e:  # Python 3.10
                raise ValueError("TOML needs Python >= 3.11; use JSON") from e
            raw = tomllib.loads(file.read_text())
        else:
            raw = json.loads(file.read_text())
    except ValueError as e:  # including the TOML and JSON decoders' errors
        raise ValueError(f"--config {path}: {e}") from e
    except OSError as e:  # a directory, no permission
        raise PathOptionError(f"--config {path}: {e.strerror or e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: expected a table of options, got "
                         f"{type(raw).__name__}")
    known = {f.name for f in fields(config_class)}
    section_fields = {s.section: _section_fields(s) for s in sections(config_class)}
    values = {}
    for key, value in raw.items():
        if key in section_fields and isinstance(value, dict):
            entries = [(key, k, v) for k, v in value.items()]
        else:
            entries = [(None, key, value)]
        for table, option_key, option_value in entries:
            name = option_key.replace("-", "_")
            if name not in known:
                raise ValueError(f"--config {path}: unknown option {option_key!r}")
            if table is not None and name not in section_fields[table]:
                home = next(t for t, names in section_fields.items() if name in names)
                raise ValueError(f"--config {path}: option {option_key!r} is in [{table}]; "
                                 f"it belongs in [{home}] (or at the top level)")
            values[name] = option_value
    return values
