"""mcrdl's training package: process grids, models, data, AxoNN's message-driven
pipeline x data parallelism, DeepSpeed-TED's tensor x expert x data parallel MoE
(train_moe), optimizers, checkpoints and entry points.

Built only on mcrdl's public API (docs/architecture.md: training/ sits above mcrdl/)."""
