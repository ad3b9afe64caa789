"""The options of AxoNN's pipeline engine: its grid (stages x data replicas), how the
blocks are split into stages, and the pipeline's messages."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.options import Options, option
from ..core.run_options import check_backend_names, check_backends_usable
from ..core.topology import Axis, to_axis
from .engine import MAX_MICROBATCHES


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
                                     "(default nccl on GPUs; on CPUs whose ranks outnumber "
                                     "the cores gloo beside mpi, whose collectives stay on "
                                     "mpi; else mpi, else gloo)")

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

    def uses_4d(self) -> bool:
        """Whether the run uses the 4D engine: not with these options alone (the 4D
        engine's TensorOptions decide where a config has them)."""
        return False

    def check(self) -> None:
        self.axis_order()
        self.blocks_per_stage()
        if self.p2p_backend is not None:
            check_backend_names("--p2p-backend", self.p2p_backend, [self.p2p_backend])
        if self.uses_4d():
            return
        # the rules of Batches and PipelineEngine.run, stated here first
        self.check_batch_split("G_data", [self.G_data])
        replicas = self.G_data * self.micro_batch_size
        n_micro = self.global_batch_size // replicas
        if n_micro > MAX_MICROBATCHES:
            raise ValueError(f"--global-batch-size {self.global_batch_size} makes {n_micro} "
                             f"microbatches of {self.micro_batch_size} per replica; expected "
                             f"at most {MAX_MICROBATCHES} (the pipeline's message tags); "
                             "raise --micro-batch-size or --G-data")

    def check_node(self) -> None:
        if self.p2p_backend is not None:
            check_backends_usable("--p2p-backend", self.p2p_backend, [self.p2p_backend])

    def check_model(self, model) -> None:
        """The rules of partition(): every stage holds a block, or the given split."""
        if self.uses_4d():
            return
        stages, n_layer = self.G_inter, model.n_layer
        if getattr(model, "tie_embeddings", False) and stages > 1:
            raise ValueError(f"--G-inter {stages}: the model ties its LM head to its "
                             "embedding (tie_embeddings, Hugging Face's tie_word_embeddings), "
                             "so the two must sit on one stage, but a pipeline puts the "
                             "embedding on its first stage and the head on its last; use "
                             "--G-inter 1 (scale with --G-data) or the 4D engine "
                             "(--G-x/--G-y/--G-z)")
        split = self.blocks_per_stage()
        if split is None:
            if n_layer < stages:
                raise ValueError(f"--G-inter {stages}: the model has {n_layer} transformer "
                                 f"blocks and each pipeline stage takes at least one; expected "
                                 f"--G-inter <= {n_layer}; use fewer stages or a deeper model "
                                 "(--n-layer)")
            return
        given = f"--layers-per-stage {self.layers_per_stage}"
        if len(split) != stages:
            entries = f"{len(split)} entr{'y' if len(split) == 1 else 'ies'}"
            raise ValueError(f"{given} has {entries} for --G-inter {stages}; "
                             f"expected one block count per stage ({stages})")
        if sum(split) != n_layer:
            raise ValueError(f"{given} places {sum(split)} transformer blocks but the model "
                             f"has {n_layer}; expected counts summing to {n_layer}; change "
                             "the counts or --n-layer")
        for s, b in enumerate(split):
            if b < 0 or (b == 0 and 0 < s < stages - 1):
                raise ValueError(f"{given}: stage {s} would hold {b} blocks; expected >= 1 "
                                 "for an inner stage (>= 0 for the first and the last)")
