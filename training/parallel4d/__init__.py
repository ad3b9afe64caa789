"""AxoNN's 4D hybrid parallelism: a 3D parallel matrix multiplication over (X, Y, Z)
replicated over data-parallel groups, on mcrdl's public API. Its layers are
training/tensor_parallel/ (shared with TED).

- ``model``: ``GPT4D`` built from the serial GPT or Llama (or an init source, each rank
  reading its pieces), and back (``serial_state_dict``).
- ``trainer``: ``Trainer4D``, one rank's run (``python -m training.train_gpt --G-x ...``).
- ``tuning``: ``MatmulTuner``, the fastest NN/NT/TN matmul layout per layer.
- ``options``: ``TensorOptions``, its axes and the choice of engine.
- ``consolidate``: the serial state_dict from its checkpoints.
- ``perf_model``: its communication performance model and grid ranking
  (``python -m training.parallel4d.perf_model``).
"""
