"""Magnitude pruning and SAMO (sparsity-aware memory optimization), used by the pipeline
engine:

- ``pruning``: ``Pruning`` (schedule, masks, their index), ``DenseMasking``.
- ``optimizer``: ``SamoAdamW``, the model states compressed over the unpruned entries.
- ``options``: ``SamoOptions`` (``--prune-sparsity``, ``--samo``).
"""
