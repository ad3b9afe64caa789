"""AxoNN's message-driven pipeline x data parallelism (Singh & Bhatele, IPDPS 2022):

- ``engine``: ``PipelineEngine``, one stage's message-driven schedule, and ``partition``.
- ``trainer``: ``Trainer``, one rank's run (``python -m training.train_gpt --G-inter ...``).
- ``options``: ``PipelineOptions``, its grid and stages.
- ``consolidate``: the serial state_dict from its checkpoints.
"""
