"""The collectives of one training step of the 4D GPT: what the engine sends, exactly.

This is the contract between the communication model and the 4D engine: the engine
issues these calls and no others, and its tests compare mcrdl's communication log (calls
and bytes per (op, axis)) with :func:`call_counts`. Sizes follow the log's convention
(mcrdl.ops: the largest buffer one rank touches): all_reduce, the reduced tensor;
all_gather, the gathered output; reduce_scatter, the input before scattering.

Notation: ``C`` = n_embd, ``V`` = vocab_size, ``T`` = block_size, ``L`` =
n_layer, ``B`` = batch (sequences per step), ``M`` = micro-batches, ``m = B T / (M G_data)``
tokens per data replica per micro-batch (the paper's m) and ``t = m / G_z`` tokens per
rank per micro-batch. Every reduction is a SUM; every tensor has the step's dtype
(``dtype_bytes``). A collective over an axis of degree 1 is never issued; nor is the
step's world all_reduce (``group=None``) on one rank.

Linear layers (``I`` is [t, k] per rank, the weight [n, k] as torch stores it, i.e. the
paper's k x n W). An **N-layer** splits out-features over X and in-features over Y: its
block is [n/G_x, k/G_y], flattened, rank z keeping contiguous chunk z (the shard, k n /
(G_x G_y G_z) elements); its input [t, k/G_y] is replicated over X, its output [t, n/G_x]
over Y. A **T-layer** swaps X and Y. The GPT: ``attn.c_attn`` N (k=C, n=3C),
``attn.c_proj`` T (C, C), ``mlp.c_fc`` N (C, 4C), ``mlp.c_proj`` T (4C, C), ``lm_head`` N
(C, V, no bias). Per Linear and micro-batch:

  forward   all_gather  z  k n / (G_x G_y)   the weight block from the shards (Eq. 5.1)
            all_reduce  y  t n / G_x         the output's partial sums (Eq. 5.3; T-layer:
                                             over x, t n / G_y)
  backward  all_gather  z  k n / (G_x G_y)   only with keep_weights=False
            all_reduce  x  t k / G_y         the input gradient (Eq. 5.4; T-layer: over y,
                                             t k / G_x)
            reduce_scatter z  k n / (G_x G_y) the weight gradient to the shard (Eq. 5.2)
and per step, after the last backward:
  gradients all_reduce  data  k n / (G_x G_y G_z)   the shard gradient (Eq. 5.5)
(``linear_collectives``, one layer as the paper models it). The engine fuses the step's
gradient all_reduces (``collectives``, below): the same elements, fewer calls.

Beyond the paper's equations (the rest of the GPT):

- Embeddings ``wte`` [V, C] and ``wpe`` [T, C]: columns split over Y, rows whole,
  replicated over X, the block sharded over Z like a Linear weight. Per micro-batch: the
  forward all_gather over z (V C / G_y, resp. T C / G_y elements) and the backward
  reduce_scatter over z; per step the shard's all_reduce over data. The lookup's backward
  does not read the weight, so there is no second gather even with keep_weights=False.
- LayerNorm (``ln_1``, ``ln_2`` per block, ``ln_f``): the hidden dimension is split over
  Y, so per micro-batch two all_reduces over y in the forward, the per-token sum (the
  mean) and then the sum of squared deviations (the variance), and the two of their
  gradients in the backward: t float32 elements each, whatever the model's dtype (the
  statistics are computed in float32).
- Logits: ``lm_head``'s output [t, V/G_x] is all-gathered over x (t V elements) before
  the cross-entropy, once per micro-batch; its backward slices locally (no collective).
- Replicated parameters (every bias and LayerNorm weight and bias): their local slices
  (``attn.c_attn.bias`` 3C/G_x, ``mlp.c_fc.bias`` 4C/G_x, the T-layers' biases C/G_y,
  LayerNorm C/G_y) are identical over X (or Y), different over Z and data.
- The step's gradient reductions are fused (training/parallel4d ``reduce_gradients``):
  the replicated parameters' gradients packed into one buffer and all_reduced over z,
  then every gradient (the weight shards of Eq. 5.5, embeddings included, then the
  replicated ones) packed into one buffer and all_reduced over data; each buffer in
  calls of ``bucket_bytes`` (the last one shorter). Same elements as one call per
  tensor, one latency per bucket instead of one per tensor.
- The step's scalars: one all_reduce over the world of 2 float32 (the loss sum and the
  squared gradient norm, each shard counted once) after the gradient reductions, also
  when clipping is off (the norm is reported). Always 4-byte elements.

A Llama (training/models/llama.py) differs: one embedding table ``embed_tokens`` (rotary
positions have none); Linear layers q_proj, k_proj, v_proj N (C -> H d, C -> K d, C -> K
d), o_proj T (H d -> C), gate_proj and up_proj N (C -> F), down_proj T (F -> C), lm_head N,
no biases; RMSNorm (``input_layernorm``, ``post_attention_layernorm`` per block,
``norm``): one all_reduce over y of t float32 (the sum of squares) in the forward, one
(its gradient) in the backward; the replicated parameters are the RMSNorm weights.

Not here: activation checkpointing's recomputation (it would repeat a block's forward
all_reduces), vocabulary-parallel cross-entropy (it replaces the logits all_gather),
pipeline stages. Counts are per step; entries are grouped by phase ("forward",
"backward", "gradients", "step"), not in issue order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ...models.llama import LlamaConfig
from .step import (
    WORLD,
    Grid4D,
    TrainingStep,
    check_grid,
    embedding_tables,
    linear_layers,
    weight_blocks,
)

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"
OPS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)
#: Elements of the step's world all_reduce (loss sum, squared gradient norm) and their bytes.
STEP_SCALARS, STEP_SCALAR_BYTES = 2, 4


@dataclass(frozen=True)
class Collective:
    """``count`` calls per step of ``op`` over one group of ``axis``, each on
    ``elements`` elements of ``dtype_bytes`` bytes (the log's size convention); ``tensor``
    says what is sent, ``phase`` when."""

    op: str
    axis: str
    elements: int
    dtype_bytes: int
    count: int
    phase: str
    tensor: str

    @property
    def nbytes(self) -> int:
        """Bytes of one call, as mcrdl's communication log counts them."""
        return self.elements * self.dtype_bytes


def linear_collectives(tensor: str, k: int, n: int, m: int, grid: Grid4D, *,
                       transposed: bool = False, micro_batches: int = 1,
                       keep_weights: bool = True, dtype_bytes: int = 4) -> list[Collective]:
    """One Linear layer's collectives per step (Eq. 5.1-5.5 with the counts): ``k``
    in-features, ``n`` out-features, ``m`` tokens per data replica per micro-batch;
    ``transposed``: a T-layer. ``tensor`` names the layer (``"attn.c_attn"``)."""
    # Out-features split over out_axis, in-features over in_axis: the output's partial
    # sums are reduced over in_axis, the input gradient's over out_axis.
    out_axis, in_axis = ("y", "x") if transposed else ("x", "y")
    t = m // grid.z
    block = k * n // (grid.x * grid.y)
    mb = micro_batches
    entries = [
        Collective(ALL_GATHER, "z", block, dtype_bytes, mb, "forward", f"{tensor}.weight"),
        Collective(ALL_REDUCE, in_axis, t * n // grid.degree(out_axis), dtype_bytes, mb,
                   "forward", f"{tensor} output"),
        Collective(ALL_REDUCE, out_axis, t * k // grid.degree(in_axis), dtype_bytes, mb,
                   "backward", f"{tensor} input grad"),
        Collective(REDUCE_SCATTER, "z", block, dtype_bytes, mb, "backward",
                   f"{tensor}.weight grad"),
        Collective(ALL_REDUCE, "data", block // grid.z, dtype_bytes, 1, "gradients",
                   f"{tensor}.weight grad"),
    ]
    if not keep_weights:
        entries.insert(2, Collective(ALL_GATHER, "z", block, dtype_bytes, mb, "backward",
                                     f"{tensor}.weight"))
    return _issued(entries, grid)


def collectives(step: TrainingStep, grid: Grid4D) -> list[Collective]:
    """Every collective of one step of ``step`` on ``grid`` (the module docstring's
    conventions). A grid the step does not fit raises ``GridError`` naming each broken
    constraint (its sizes would be floor divisions: a time for a layout that cannot run)."""
    check_grid(step, grid)
    cfg, mb, b = step.model, step.micro_batches, step.dtype_bytes
    v, L = cfg.vocab_size, cfg.n_layer
    m = step.tokens_per_replica(grid)
    t = m // grid.z
    blocks = weight_blocks(cfg, grid)
    out: list[Collective] = []

    def per_block(entries: list[Collective]) -> list[Collective]:
        return [_times(e, L) for e in entries]

    def layer_norm(name: str) -> list[Collective]:
        return [Collective(ALL_REDUCE, "y", t, 4, mb, "forward", f"{name} {stat}")
                for stat in ("mean", "variance")] + \
               [Collective(ALL_REDUCE, "y", t, 4, mb, "backward", f"{name} {stat} grad")
                for stat in ("variance", "mean")]

    def rms_norm(name: str) -> list[Collective]:
        return [Collective(ALL_REDUCE, "y", t, 4, mb, "forward", f"{name} sumsq"),
                Collective(ALL_REDUCE, "y", t, 4, mb, "backward", f"{name} sumsq grad")]

    def passes(entries: list[Collective]) -> list[Collective]:
        """A layer's forward and backward entries (its gradient reduction is fused)."""
        return [e for e in entries if e.phase != "gradients"]

    for name in embedding_tables(cfg):
        out += [Collective(ALL_GATHER, "z", blocks[name], b, mb, "forward", name),
                Collective(REDUCE_SCATTER, "z", blocks[name], b, mb, "backward", f"{name} grad")]
    linear = {"micro_batches": mb, "keep_weights": step.keep_weights, "dtype_bytes": b}
    layers = linear_layers(cfg)

    def linear_passes(layer) -> list[Collective]:
        return passes(linear_collectives(layer.name, layer.k, layer.n, m, grid,
                                         transposed=layer.transposed, **linear))

    llama = isinstance(cfg, LlamaConfig)
    norm = rms_norm if llama else layer_norm
    norms = ("input_layernorm", "post_attention_layernorm", "norm") if llama \
        else ("ln_1", "ln_2", "ln_f")
    mlp_first = next(i for i, layer in enumerate(layers) if layer.name.startswith("mlp."))
    out += per_block(norm(norms[0]))
    for layer in layers[:mlp_first]:
        out += per_block(linear_passes(layer))
    out += per_block(norm(norms[1]))
    for layer in layers[mlp_first:-1]:
        out += per_block(linear_passes(layer))
    out += norm(norms[2])
    out += linear_passes(layers[-1])
    out.append(Collective(ALL_GATHER, "x", t * v, b, mb, "forward", "logits"))
    replicated = sum(elements * count for _, elements, count in _replicated(step, grid))
    once = {*embedding_tables(cfg), "lm_head.weight"}
    shards = sum(blocks[name] // grid.z * (1 if name in once else L) for name in blocks)
    out += _bucketed("z", replicated, step, "replicated parameters grad")
    out += _bucketed("data", shards + replicated, step, "every gradient")
    out.append(Collective(ALL_REDUCE, WORLD, STEP_SCALARS, STEP_SCALAR_BYTES, 1, "step",
                          "loss sum, squared gradient norm"))
    return _issued(out, grid)


def call_counts(step: TrainingStep, grid: Grid4D) -> dict[tuple[str, str], tuple[int, int]]:
    """``{(op, axis): (calls, bytes)}`` per step per rank: what mcrdl's log shows for the
    groups of each axis (``"world"``: the world group). The log's summary rows are keyed
    by group size, not axis: compare its sums with these summed by ``grid.degree(axis)``,
    or map the trace's group ids to axes."""
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for e in collectives(step, grid):
        row = totals[e.op, e.axis]
        row[0] += e.count
        row[1] += e.count * e.nbytes
    return {key: (calls, nbytes) for key, (calls, nbytes) in sorted(totals.items())}


def _replicated(step: TrainingStep, grid: Grid4D) -> list[tuple[str, int, int]]:
    """(name, local elements, tensors per step) of each replicated parameter."""
    cfg = step.model
    c = cfg.n_embd
    if isinstance(cfg, LlamaConfig):  # no biases; RMSNorm weights only
        return [(f"{n}.weight", c // grid.y, cfg.n_layer)
                for n in ("input_layernorm", "post_attention_layernorm")] + \
            [("norm.weight", c // grid.y, 1)]
    norm_params = ("weight", "bias") if cfg.bias else ("weight",)
    out = [(f"{ln}.{p}", c // grid.y, cfg.n_layer) for ln in ("ln_1", "ln_2")
           for p in norm_params]
    if cfg.bias:
        out += [("attn.c_attn.bias", 3 * c // grid.x, cfg.n_layer),
                ("attn.c_proj.bias", c // grid.y, cfg.n_layer),
                ("mlp.c_fc.bias", 4 * c // grid.x, cfg.n_layer),
                ("mlp.c_proj.bias", c // grid.y, cfg.n_layer)]
    out += [(f"ln_f.{p}", c // grid.y, 1) for p in norm_params]
    return out


def _bucketed(axis: str, elements: int, step: TrainingStep, tensor: str) -> list[Collective]:
    """The fused all_reduce of `elements` over `axis`: full buckets, then the rest."""
    b = step.dtype_bytes
    per = elements if step.bucket_bytes is None else max(1, step.bucket_bytes // b)
    full, rest = divmod(elements, per)
    out = []
    if full:
        out.append(Collective(ALL_REDUCE, axis, per, b, full, "gradients", tensor))
    if rest:
        out.append(Collective(ALL_REDUCE, axis, rest, b, 1, "gradients", f"{tensor} (last)"))
    return out


def _times(e: Collective, factor: int) -> Collective:
    return Collective(e.op, e.axis, e.elements, e.dtype_bytes, e.count * factor, e.phase,
                      e.tensor)


def _issued(entries: list[Collective], grid: Grid4D) -> list[Collective]:
    """The entries whose group has more than one rank (the others are never sent)."""
    return [e for e in entries if grid.degree(e.axis) > 1]
