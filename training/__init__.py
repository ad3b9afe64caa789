"""mcrdl's training package, one package per engine, in layers (each imports only from
the layers below it; tests/test_architecture.py checks it):

- ``core/``: what every engine shares (options, runtime, runner, checkpoint format,
  report, timers, process grids, data, optimizers, sharding specs, CAC).
- ``models/``: the serial GPT and MoE GPT, every engine's reference.
- ``tensor_parallel/`` (AxoNN's X/Y/Z layers) and ``samo/`` (pruning, SAMO).
- the engines: ``pipeline/`` (AxoNN's message-driven pipeline x data), ``parallel4d/``
  (AxoNN's 4D, with its performance model) and ``ted/`` (DeepSpeed-TED's MoE).
- ``plan/``, over the engines' models: the layout planner (``python -m training.plan``).
- the commands: ``train_gpt``, ``train_moe``, ``checkpoint``, and ``perf_model`` and
  ``ted_model`` (the engines' models under their documented names).

Built only on mcrdl's public API (docs/architecture.md: training/ sits above mcrdl/)."""
