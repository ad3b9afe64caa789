"""What runs where: the 4D grid's degrees, one training step's shapes, and whether
they fit together.

``Grid4D(x, y, z, data)`` are the degrees of AxoNN's 4D grid: a 3D parallel matrix
multiplication over (G_x, G_y, G_z), replicated over G_data data-parallel groups. Rank
``r = x + G_x*(y + G_y*(z + G_z*d))`` (X innermost), the layout of
``ProcessGrid(grid.sizes(), order=AXES)``.

``TrainingStep`` is one optimizer step of a GPT (``training.models.gpt.GPTConfig``) or
a Llama (``training.models.llama.LlamaConfig``):
``batch`` whole sequences of ``block_size`` tokens, run as ``micro_batches`` forward and
backward passes whose gradients accumulate before one update.

``constraint_violations`` lists every reason a grid cannot run a step (the engine raises
them with ``check_grid``; the ranking skips such grids and keeps the reasons).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcrdl.launch import launch_command

from ...core.topology import GridError
from ...models.gpt import GPTConfig
from ...models.llama import LlamaConfig

#: The grid's axes from the fastest-varying (consecutive ranks) to the slowest.
AXES = ("x", "y", "z", "data")
#: Collectives over every rank (the step's scalars) name this axis.
WORLD = "world"


@dataclass(frozen=True)
class Grid4D:
    """Degrees of the 4D grid: ``x`` and ``y`` split a Linear layer's output and input
    features (swapped in a transposed layer), ``z`` shards its weights and its tokens,
    ``data`` replicates the whole."""

    x: int
    y: int
    z: int
    data: int

    def __post_init__(self):
        for axis in AXES:
            v = getattr(self, axis)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise GridError(f"Grid4D: degree {axis}={v!r}; expected a positive integer")

    @property
    def size(self) -> int:
        """Ranks the grid needs."""
        return self.x * self.y * self.z * self.data

    def degree(self, axis: str) -> int:
        """Ranks in one group along ``axis`` (``"world"``: all of them)."""
        if axis == WORLD:
            return self.size
        if axis not in AXES:
            raise GridError(f"Grid4D: unknown axis {axis!r}; expected one of "
                            f"{', '.join((*AXES, WORLD))}")
        return getattr(self, axis)

    def sizes(self) -> dict[str, int]:
        """``{"x": G_x, "y": G_y, "z": G_z, "data": G_data}`` for ``ProcessGrid``."""
        return {axis: getattr(self, axis) for axis in AXES}

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.x, self.y, self.z, self.data)

    def __str__(self) -> str:
        return f"({self.x},{self.y},{self.z},{self.data})"


@dataclass(frozen=True)
class TrainingStep:
    """One optimizer step: ``batch`` sequences of ``model.block_size`` tokens in
    ``micro_batches`` forward/backward passes, every tensor (parameters, gradients,
    activations) ``dtype_bytes`` wide, the LayerNorm statistics float32. ``keep_weights``: the
    Z-gathered weight of a Linear layer stays from its forward to its backward; False
    gathers it again in the backward (less memory, one more all_gather).
    ``bucket_bytes``: the step's gradient all_reduces are fused into buckets of this
    many bytes (the engine's --bucket-mib; None: one call per axis)."""

    model: GPTConfig | LlamaConfig
    batch: int
    micro_batches: int = 1
    dtype_bytes: int = 4
    keep_weights: bool = True
    bucket_bytes: int | None = 4 << 20

    def __post_init__(self):
        if not isinstance(self.model, (GPTConfig, LlamaConfig)):
            raise TypeError(f"TrainingStep: model is {type(self.model).__name__}; "
                            "expected a training.models.gpt.GPTConfig or "
                            "training.models.llama.LlamaConfig")
        for name in ("batch", "micro_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TrainingStep: {name}={v!r}; expected a positive integer")
        if self.dtype_bytes not in (1, 2, 4, 8):
            raise ValueError(f"TrainingStep: dtype_bytes={self.dtype_bytes!r}; expected 1, 2, "
                             "4 or 8 (bytes of one element: 4 for float32, 2 for bfloat16)")
        if self.bucket_bytes is not None and (not isinstance(self.bucket_bytes, int)
                                              or self.bucket_bytes < self.dtype_bytes):
            raise ValueError(f"TrainingStep: bucket_bytes={self.bucket_bytes!r}; expected "
                             f"None or an integer >= dtype_bytes ({self.dtype_bytes})")
        if self.batch % self.micro_batches:
            raise ValueError(f"TrainingStep: batch={self.batch} sequences do not split into "
                             f"micro_batches={self.micro_batches} equal passes; choose a "
                             "micro-batch count that divides the batch")

    def tokens_per_replica(self, grid: Grid4D) -> int:
        """The paper's m: tokens one data-parallel replica processes in one micro-batch
        (its ranks hold ``m / G_z`` of them each). Assumes the batch divides by G_data."""
        return self.batch // (self.micro_batches * grid.data) * self.model.block_size


@dataclass(frozen=True)
class LinearLayer:
    """One Linear layer of the GPT as the 4D grid splits it: ``k`` in-features, ``n``
    out-features; ``transposed``: a T-layer (X and Y swapped); ``per_block``: one per
    transformer block (else once per model)."""

    name: str
    k: int
    n: int
    transposed: bool
    per_block: bool

    def local(self, grid: Grid4D, tokens: int) -> tuple[int, int, int]:
        """(t, k, n) of one rank's matmul: ``tokens`` per replica split over Z, the
        in-features over Y (T-layer: X), the out-features over X (T-layer: Y)."""
        in_deg, out_deg = (grid.x, grid.y) if self.transposed else (grid.y, grid.x)
        return tokens // grid.z, self.k // in_deg, self.n // out_deg


def linear_layers(model: GPTConfig | LlamaConfig) -> list[LinearLayer]:
    """The model's Linear layers in forward order (a GPT's N and T alternating; a
    Llama's q, k, v N, o T, gate and up N, down T)."""
    c, v = model.n_embd, model.vocab_size
    if isinstance(model, LlamaConfig):
        q, kv, f = model.n_head * model.head_dim, model.n_kv_head * model.head_dim, \
            model.intermediate_size
        return [LinearLayer("self_attn.q_proj", c, q, False, True),
                LinearLayer("self_attn.k_proj", c, kv, False, True),
                LinearLayer("self_attn.v_proj", c, kv, False, True),
                LinearLayer("self_attn.o_proj", q, c, True, True),
                LinearLayer("mlp.gate_proj", c, f, False, True),
                LinearLayer("mlp.up_proj", c, f, False, True),
                LinearLayer("mlp.down_proj", f, c, True, True),
                LinearLayer("lm_head", c, v, False, False)]
    return [LinearLayer("attn.c_attn", c, 3 * c, False, True),
            LinearLayer("attn.c_proj", c, c, True, True),
            LinearLayer("mlp.c_fc", c, 4 * c, False, True),
            LinearLayer("mlp.c_proj", 4 * c, c, True, True),
            LinearLayer("lm_head", c, v, False, False)]


def embedding_tables(model: GPTConfig | LlamaConfig) -> dict[str, int]:
    """Rows of each embedding table by weight name (their columns are n_embd): a GPT's
    token and position tables, a Llama's token table (rotary positions have none)."""
    if isinstance(model, LlamaConfig):
        return {"embed_tokens.weight": model.vocab_size}
    return {"wte.weight": model.vocab_size, "wpe.weight": model.block_size}


def weight_blocks(model: GPTConfig | LlamaConfig, grid: Grid4D) -> dict[str, int]:
    """Elements of each weight's local [rows/G_x, cols/G_y] block (embeddings: columns
    over Y, rows whole), the block Z shards. Names as in the model's parameters."""
    c = model.n_embd
    xy = grid.x * grid.y
    return {**{name: rows * c // grid.y for name, rows in embedding_tables(model).items()},
            **{f"{layer.name}.weight": layer.k * layer.n // xy
               for layer in linear_layers(model)}}


def constraint_violations(step: TrainingStep, grid: Grid4D) -> list[tuple[str, str]]:
    """Every ``(constraint, message)`` the grid breaks for this step; empty when it fits.
    Constraints: ``"heads"``, ``"width"``, ``"vocab"``, ``"weight shard"``, ``"batch"``;
    a Llama's ``"kv heads"`` (training/tensor_parallel/layers.py check_kv_heads: G_x
    divides n_kv_head), ``"intermediate"`` and ``"tied"``.

    Only X splits heads (c_attn's out-features, attn.c_proj's in-features); Y splits the
    hidden dimension (c_attn's in-features, attn.c_proj's out-features), never a head,
    so it needs n_embd, not n_head, to divide. Whole sequences go to each (z, data)
    shard because attention mixes the tokens of a sequence."""
    m = step.model
    out = []
    if isinstance(m, LlamaConfig) and m.n_kv_head % grid.x:
        out.append(("kv heads", f"n_kv_head={m.n_kv_head} is not divisible by G_x={grid.x}: "
                                "key/value heads are split over X with the query heads "
                                "they serve (each X rank holds n_kv_head/G_x of them); "
                                f"choose --G-x dividing --n-kv-head {m.n_kv_head}"))
    elif m.n_head % grid.x:
        out.append(("heads", f"n_head={m.n_head} is not divisible by G_x={grid.x}: attention "
                             "heads are split over X; choose G_x dividing n_head"))
    if isinstance(m, LlamaConfig) and m.intermediate_size % grid.x:
        out.append(("intermediate", f"intermediate_size={m.intermediate_size} is not "
                                    f"divisible by G_x={grid.x}: gate_proj and up_proj's "
                                    "rows are split over X; choose G_x dividing it"))
    if isinstance(m, LlamaConfig) and m.tie_embeddings:
        out.append(("tied", "tie_embeddings: the 4D engine splits the embedding (columns "
                            "over Y) and the LM head (rows over X, columns over Y) "
                            "differently, so they cannot share one matrix; untie them "
                            "(tie_word_embeddings false) or use the pipeline engine"))
    if m.n_embd % grid.y:
        out.append(("width", f"n_embd={m.n_embd} is not divisible by G_y={grid.y}: the hidden "
                             "dimension is split over Y; choose G_y dividing n_embd"))
    if m.vocab_size % grid.x:
        out.append(("vocab", f"vocab_size={m.vocab_size} is not divisible by G_x={grid.x}: the "
                             "LM head's rows are split over X; choose G_x dividing it or pad "
                             "the vocabulary"))
    if not out:  # block sizes are whole numbers only when the widths divide
        for name, elements in weight_blocks(m, grid).items():
            if elements % grid.z:
                out.append(("weight shard", f"{name}'s local block of {elements} elements is "
                                            f"not divisible by G_z={grid.z}: Z shards every "
                                            "weight block evenly; choose G_z dividing it"))
                break
    shards = grid.z * grid.data * step.micro_batches
    if step.batch % shards:
        out.append(("batch", f"batch={step.batch} sequences are not divisible by G_z*G_data*"
                             f"micro_batches={grid.z}*{grid.data}*{step.micro_batches}={shards}: "
                             "every rank takes whole sequences; choose a batch that is a "
                             f"multiple of {shards}"))
    return out


def check_grid(step: TrainingStep, grid: Grid4D, world_size: int | None = None) -> None:
    """Raise ``GridError`` naming every constraint the grid breaks (and the world size
    when it differs from the grid's)."""
    problems = [msg for _, msg in constraint_violations(step, grid)]
    if world_size is not None and world_size != grid.size:
        tensor = grid.x * grid.y * grid.z
        fitted = Grid4D(grid.x, grid.y, grid.z, world_size // tensor) \
            if world_size % tensor == 0 else None
        # --G-data that fills the world, where the step's constraints also hold with it
        fits = f" (with these G_x, G_y, G_z: --G-data {fitted.data})" \
            if fitted and not constraint_violations(step, fitted) else ""
        problems.insert(0, f"the grid needs G_x*G_y*G_z*G_data={grid.size} ranks but the "
                           f"world has {world_size}; launch with "
                           f"{launch_command(grid.size)} or change the degrees so that their "
                           f"product is {world_size}{fits}")
    if problems:
        raise GridError(f"grid {grid} cannot run this step: " + "; ".join(problems))


def grids(ranks: int) -> list[Grid4D]:
    """Every (G_x, G_y, G_z, G_data) whose product is ``ranks``, in lexicographic order."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"grids: ranks={ranks!r}; expected a positive integer")
    out = []
    for x in _divisors(ranks):
        for y in _divisors(ranks // x):
            for z in _divisors(ranks // (x * y)):
                out.append(Grid4D(x, y, z, ranks // (x * y * z)))
    return out


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})
