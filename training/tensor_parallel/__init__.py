"""AxoNN's tensor-parallel layers over the axes (X, Y, Z): the 4D engine builds its whole
model from them, TED its attention and dense MLPs.

- ``comm``: ``AxisComm`` (one axis: group, backend, recorder), ``TensorComms`` (what a
  layer communicates over), ``Overlap``, ``Recorder``, ``GatherSchedule`` (OAG).
- ``layers``: ``ParallelLinear`` (N- and T-layers), ``ParallelEmbedding``,
  ``ParallelLayerNorm``, ``ParallelSelfAttention``, ``ParallelMLP``, ``gather_last_dim``;
  the Llama's ``ParallelRMSNorm``, ``ParallelLlamaAttention`` (grouped-query, its rule
  ``check_kv_heads``: G_x divides n_kv_head), ``ParallelSwiGLU``; where a piece of a
  parameter lives is training/core/sharding.py's ``Split``, and ``read_piece`` reads
  only a rank's piece of a serial tensor not in memory (``SerialPart``).
"""
