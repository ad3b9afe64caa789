"""What every training engine shares: the options framework and the shared option
sections, mcrdl's initialization and the collective parts of a run (``runtime``), the
step loop and the command around it (``runner``), the checkpoint format, report,
timers, process grids, data, optimizers, sharding specs (``Split``) and CAC.

Nothing here imports an engine (tests/test_architecture.py)."""
