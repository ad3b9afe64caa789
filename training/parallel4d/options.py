"""The options of AxoNN's 4D engine (its tensor axes X, Y, Z, overlap, per-axis backends)
and the choice between it and the pipeline engine, with the rules that keep each
engine's options to the run that reads them."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..core.options import Options, flag, option
from ..core.run_options import check_backend_names, check_backends_usable
from ..core.topology import Axis

#: The 4D engine's fused gradient all_reduce buckets without --bucket-mib (MiB).
FUSED_BUCKET_MIB = 4.0


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
                                 "yet (training/samo/ runs with the pipeline engine)")
            if self.dtype == "fp16":
                raise ValueError("--dtype fp16 is not supported by the 4D engine (no loss "
                                 "scaling yet); use bf16 or fp32")
            self.check_batch_split("G_z*G_data", [self.G_z, self.G_data])

    def check_model(self, model) -> None:
        """The 4D engine's rules of a Llama's shape (training/models/llama.py): key/value
        heads split over X with their query heads (tensor_parallel.layers
        check_kv_heads: G_x divides n_kv_head), and untied embeddings."""
        from ..models.llama import LlamaConfig
        from ..tensor_parallel.layers import check_kv_heads

        if not self.uses_4d() or not isinstance(model, LlamaConfig):
            return
        problem = check_kv_heads(model.n_head, model.n_kv_head, self.G_x)
        if problem:
            raise ValueError(f"--G-x {self.G_x} with --arch llama: {problem}")
        if model.intermediate_size % self.G_x:
            raise ValueError(f"--G-x {self.G_x} with --arch llama: intermediate_size="
                             f"{model.intermediate_size} is not divisible by G_x={self.G_x} "
                             "(gate_proj and up_proj's rows are split over X); choose --G-x "
                             "dividing it")
        if model.tie_embeddings:
            raise ValueError("--arch llama with tied embeddings (tie_word_embeddings) is not "
                             "supported by the 4D engine: it splits the embedding (columns "
                             "over Y) and the LM head (rows over X) differently; untie them "
                             "or use the pipeline engine (G_x = G_y = G_z = 1)")

    def check_node(self) -> None:
        if self.axis_backends:
            check_backends_usable("--axis-backends", self.axis_backends,
                                  list(self.backend_of_axis().values()))

    def check_world(self, world_size: int) -> None:
        """The 4D engine's rules of its grid (check_grid, as Trainer4D applies them):
        the world's size, and heads, widths, vocabulary and weight blocks split evenly
        over the tensor axes, every problem named at once."""
        if not self.uses_4d():
            super().check_world(world_size)
            return
        from .perf_model.step import Grid4D, TrainingStep, check_grid

        check_grid(TrainingStep(self.model_config(), self.global_batch_size),
                   Grid4D(self.G_x, self.G_y, self.G_z, self.G_data), world_size)
