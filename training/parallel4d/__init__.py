"""AxoNN's 4D hybrid parallelism (issue 18): a 3D parallel matrix multiplication over
(X, Y, Z) replicated over data-parallel groups, on mcrdl's public API.

- ``comm``: ``AxisComm`` (one axis: group, backend, recorder), ``TensorComms`` (what a
  layer communicates over), ``Overlap``, ``Recorder``, ``GatherSchedule`` (OAG).
- ``layers``: ``ParallelLinear`` (N- and T-layers), ``ParallelEmbedding``,
  ``ParallelLayerNorm``, ``ParallelSelfAttention``, ``Split`` (where a piece of a
  parameter lives), ``gather_last_dim``.
- ``model``: ``GPT4D`` built from the serial GPT, and back (``serial_state_dict``).
- ``trainer``: ``Trainer4D``, one rank's run (``python -m training.train_gpt --G-x ...``).
"""

from .comm import AxisComm, GatherSchedule, Overlap, Recorder, TensorComms
from .layers import (
    ParallelEmbedding,
    ParallelLayerNorm,
    ParallelLinear,
    ParallelSelfAttention,
    Split,
    gather_last_dim,
    owns,
)
from .model import GPT4D, assemble_state_dict, serial_state_dict

__all__ = ["GPT4D", "AxisComm", "GatherSchedule", "Overlap", "ParallelEmbedding",
           "ParallelLayerNorm", "ParallelLinear", "ParallelSelfAttention", "Recorder", "Split",
           "TensorComms", "assemble_state_dict", "gather_last_dim", "owns", "serial_state_dict"]
