"""mcrdl's training package: process grids, models, data, AxoNN's message-driven
pipeline x data parallelism, optimizers, checkpoints and entry points.

Built only on mcrdl's public API (docs/architecture.md: training/ sits above mcrdl/)."""
