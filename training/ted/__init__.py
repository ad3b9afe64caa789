"""DeepSpeed-TED: tensor x expert x data parallelism of a Mixture-of-Experts GPT
(``python -m training.train_moe``):

- ``model``: ``TEDLayout``, ``TEDGroups``, ``TEDGPT`` built from the serial MoEGPT.
- ``autograd_collectives``: the collectives inside autograd (``copy_to``,
  ``reduce_from``, ``all_to_all``, DTD's ``drop_share``/``gather_share``), with CAC.
- ``zero``: ``ZeroAdamW``, ZeRO stage 1 with the tiled optimizer.
- ``trainer``: ``MoETrainer``, one rank's run.
- ``options``: the MoE and layout options and train_moe's config.
- ``consolidate``: the serial MoEGPT state_dict from its checkpoints.
- ``cost_model``: its memory and communication model, and the command that lists the
  layouts that fit (``python -m training.ted.cost_model``).
"""
